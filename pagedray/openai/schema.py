"""OpenAPI for routes that read their own bodies: the request and response models declared.

The generation and tokenizer routes take the raw `Request` and validate it themselves, so every
error stays in OpenAI's shape (FastAPI's own validation answers 422 with its own shape). FastAPI
then cannot see their bodies; these helpers declare them, so /openapi.json describes what the
routes really accept and answer, and a schema-driven fuzzer (schemathesis) can exercise them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from pagedray.openai.answer_models import ErrorResponse

_REF = "#/components/schemas/{model}"
# Errors any route may answer (the API key, the body limit, the engine), and what each means.
_ERRORS = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body over the limit",
    500: "internal error (the message carries a request id for the log)",
    503: "engine unavailable or its waiting queue is full (see Retry-After)",
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def responses(
    model: type[BaseModel] | None,
    stream: bool = False,
    errors: tuple[int, ...] = tuple(_ERRORS),
    error_model: type[BaseModel] = ErrorResponse,
) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route answering `model` (and SSE chunks if `stream`) or an error in
    `error_model`'s shape (OpenAI's, unless the route speaks another API)."""
    spec: dict[int | str, dict[str, Any]] = {
        status: {"model": error_model, "description": _ERRORS[status]} for status in errors
    }
    if model is not None:
        spec[200] = {"model": model, "description": "success"}
        if stream:
            events = {"schema": {"type": "string", "description": "server-sent events"}}
            spec[200]["content"] = {"text/event-stream": events}
    return spec


def declare_request_models(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add each model's JSON schema (its nested `$defs` hoisted) to the app's components."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in schemas.items():
                components.setdefault(name, schema)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
