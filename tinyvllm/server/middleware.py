"""Checks made on every request before any handler runs: the API key, then the body's size.

Both are plain ASGI middleware, so a refused request costs neither a parse nor a handler, and both answer
with OpenAI's error body.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.server.protocol import error_body


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY`; /health and /metrics stay open (as in vLLM).

    The key is compared with hmac.compare_digest, whose time does not depend on where the strings differ, so
    response times tell an attacker nothing about how much of a guess was right."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = JSONResponse(error_body("a valid API key is needed: send 'Authorization: Bearer KEY'",
                                                   code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A request body over `max_bytes` gets 413, by its Content-Length before anything is read, or, when it
    is sent in chunks, as soon as what has arrived is over the limit. The body is read whole here and handed
    on as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending all of it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            body.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # then whatever comes next: the disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(error_body(f"the request body is over {self.max_bytes} bytes, this server's limit",
                                           code="request_too_large"), status_code=413,
                                headers={"Connection": "close"})
        await response(scope, receive, send)
