"""Who may call and how much they may send: bearer-token authentication and a request body limit."""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors


async def require_token(request: Request) -> None:
    """A dependency of every /api and /v1 route; a no-op when no token is configured."""
    token = request.app.state.cfg.token
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise errors.ApiError(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


class BodyLimit:
    """413 for a body over ``max_bytes``: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            too_big = errors.response(413, f"request body over {self.max_bytes} bytes")
            return await too_big(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # raised inside the route's body read: the error handler answers
                raise errors.ApiError(413, f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)
