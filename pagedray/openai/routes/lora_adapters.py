"""vLLM's routes that load and unload LoRA adapters while the server runs (an RL trainer
pushing each new adapter, an operator adding a tenant's), on when `--allow-runtime-lora-updating`
(vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) is. An adapter loaded here is a link in
`--lora-resolver-dir`, the folder every engine replica's resolver reads, so it is known to
every replica, one started later too, without a message to each."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from pagedray.engine.lora_adapters import link_adapter, unlink_adapter
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request, error_response

router = APIRouter()


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


def _off(server: OpenAIServer) -> Response | None:
    """vLLM's answer where the routes are off: they are not there."""
    if server.config.allow_runtime_lora_updating:
        return None
    message = "loading LoRA adapters at run time is off (--allow-runtime-lora-updating)"
    return error_response(404, message, "NotFoundError")


@router.post(
    "/v1/load_lora_adapter",
    openapi_extra=request_body(LoadLoRAAdapterRequest),
    responses=responses(None, errors=(400, 401, 404, 413)),
)
async def load_lora_adapter(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    off = _off(server)
    if off is not None:
        return off
    body = await server.parse(raw, LoadLoRAAdapterRequest)
    if isinstance(body, Response):
        return body
    try:
        await server.in_thread(
            link_adapter, server.config, body.lora_name, body.lora_path, body.load_inplace
        )
    except ValueError as exc:
        return bad_request(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    openapi_extra=request_body(UnloadLoRAAdapterRequest),
    responses=responses(None, errors=(400, 401, 404, 413)),
)
async def unload_lora_adapter(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    off = _off(server)
    if off is not None:
        return off
    body = await server.parse(raw, UnloadLoRAAdapterRequest)
    if isinstance(body, Response):
        return body
    try:
        await server.in_thread(unlink_adapter, server.config, body.lora_name)
    except LookupError as exc:
        return error_response(404, str(exc), "NotFoundError", param="lora_name")
    except ValueError as exc:
        return bad_request(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
