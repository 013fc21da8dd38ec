"""CORS for the ingress, as vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers`
and `--allow-credentials` set it (defaults: any origin, method and header, no credentials).

Starlette's CORSMiddleware does the work; the app is built (and pickled by Serve) before any
replica has its settings, so `ReplicaCORS` builds the middleware from the replica's settings on
its first request.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")


@dataclass(frozen=True)
class CORSSettings:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def cors_settings_of(args: dict[str, Any]) -> CORSSettings:
    """The settings among `build_app`'s args: lists, or JSON text as `serve run key=value` gives
    them; `allow_credentials` a bool or "true"/"false". Raises ValueError naming a bad one."""
    settings: dict[str, Any] = {}
    for name in _LISTS:
        if args.get(name) is not None:
            settings[name] = _string_list(name, args[name])
    credentials = args.get("allow_credentials")
    if isinstance(credentials, str) and credentials.lower() in ("true", "false"):
        credentials = credentials.lower() == "true"
    if credentials is not None:
        if not isinstance(credentials, bool):
            raise ValueError(f"allow_credentials: must be true or false, got {credentials!r}")
        settings["allow_credentials"] = credentials
    return CORSSettings(**settings)


def _string_list(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):  # else refused below, as a non-list
            value = json.loads(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise ValueError(f'{name}: must be a list of strings (JSON: ["*"]), got {value!r}')
    return tuple(value)


class ReplicaCORS:
    """ASGI middleware: CORSMiddleware with `settings_of()`'s settings, read on the first HTTP
    request (the replica's settings exist by then; they never change after)."""

    def __init__(self, app: ASGIApp, settings_of: Callable[[], CORSSettings]) -> None:
        self.app = app
        self.settings_of = settings_of
        self.cors: CORSMiddleware | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan may run before the replica has its settings
            await self.app(scope, receive, send)
            return
        if self.cors is None:
            settings = self.settings_of()
            self.cors = CORSMiddleware(
                self.app,
                allow_origins=settings.allowed_origins,
                allow_methods=settings.allowed_methods,
                allow_headers=settings.allowed_headers,
                allow_credentials=settings.allow_credentials,
            )
        await self.cors(scope, receive, send)
