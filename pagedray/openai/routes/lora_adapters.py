"""vLLM's routes that load and unload LoRA adapters while the server runs (an RL trainer
pushing each new adapter, an operator adding a tenant's), on when `--allow-runtime-lora-updating`
(vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) is. An adapter loaded here is a link in
`--lora-resolver-dir`, the folder every engine replica's resolver reads, so it is known to
every replica, one started later too, without a message to each."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from pagedray.engine.lora_adapters import link_adapter, unlink_adapter
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request, error_response

router = APIRouter()
BodyT = TypeVar("BodyT", "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the name requests will give as `model`, the adapter's PEFT folder."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # a name loaded before points at the new folder


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body (its `lora_int_id` is not needed: names are unique)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


async def _update(
    raw: Request,
    server: OpenAIServer,
    body_model: type[BodyT],
    change: Callable[[BodyT], None],
    done: str,
) -> Response:
    """A run-time change: 404 where the routes are off (vLLM's: they are not there), else the
    body parsed and `change` made in a thread (it touches the filesystem), answered as vLLM's:
    `done` in plain text, a 400 for a refusal, a 404 for a name not found."""
    if not server.config.allow_runtime_lora_updating:
        message = "loading LoRA adapters at run time is off (--allow-runtime-lora-updating)"
        return error_response(404, message, "NotFoundError")
    body = await server.parse(raw, body_model)
    if isinstance(body, Response):
        return body
    try:
        await server.in_thread(change, body)
    except LookupError as exc:
        return error_response(404, str(exc), "NotFoundError", param="lora_name")
    except ValueError as exc:
        return bad_request(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {done} successfully.")


@router.post(
    "/v1/load_lora_adapter",
    openapi_extra=request_body(LoadLoRAAdapterRequest),
    responses=responses(None, errors=(400, 401, 404, 413)),
)
async def load_lora_adapter(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    def link(body: LoadLoRAAdapterRequest) -> None:
        link_adapter(server.config, body.lora_name, body.lora_path, body.load_inplace)

    return await _update(raw, server, LoadLoRAAdapterRequest, link, "added")


@router.post(
    "/v1/unload_lora_adapter",
    openapi_extra=request_body(UnloadLoRAAdapterRequest),
    responses=responses(None, errors=(400, 401, 404, 413)),
)
async def unload_lora_adapter(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    def unlink(body: UnloadLoRAAdapterRequest) -> None:
        unlink_adapter(server.config, body.lora_name)

    return await _update(raw, server, UnloadLoRAAdapterRequest, unlink, "removed")
