"""The server's load for a router or load balancer: ``GET /load`` answers ``{"server_load": N}``,
the generation and embedding requests this API server process is serving now, counted from when
a request arrives until its last byte (a stream's included) has gone, as vLLM's
``--enable-server-load-tracking`` counts them. Without the flag nothing is counted and ``/load``
answers 0, as vLLM's does.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

TRACKED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/invocations",
)
"""The routes whose requests count (those that run the engine)."""


class ServerLoad:
    """How many tracked requests are in flight (one event loop: a plain counter)."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    """ASGI middleware that counts each POST to a :data:`TRACKED_PATHS` route (under any root path)
    in ``load`` while it is being answered."""

    def __init__(self, app: ASGIApp, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracked = (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope.get("path", "").rstrip("/").endswith(TRACKED_PATHS)
        )
        if not tracked:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1
