"""CORS for the ingress, as vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers`
and `--allow-credentials` set it (defaults: any origin, method and header, no credentials).

Starlette's CORSMiddleware does the work; the app is built (and pickled by Serve) before any
replica has its settings, so `ReplicaCORS` builds the middleware from the replica's settings on
its first request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send


@dataclass(frozen=True)
class CORSSettings:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


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
