"""`BodyLimitMiddleware`: a request body over the server's limit is a 413 before it is read whole.

A `Content-Length` over the limit is refused at once, without reading the body. A body without one (chunked)
is read up to the limit and refused when it goes past; a body that outgrows its `Content-Length` fails
mid-read. A plain ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed responses).
"""

from __future__ import annotations

import json
from typing import Any


class BodyTooLarge(Exception):
    """The body outgrew the limit after the app started reading it."""


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                return await self._refuse(send, f"Content-Length {length.decode('latin-1')}")
            return await self.app(scope, _counting(receive, self.limit), send)
        chunks, size = [], 0  # NOTE: chunked: read up to the limit before the app sees any of it
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(send, f"a chunked body of more than {self.limit} bytes")
            chunks.append(message)
            if not message.get("more_body", False):
                break
        return await self.app(scope, _replay(chunks, receive), send)

    async def _refuse(self, send: Any, what: str) -> None:
        message = (f"{what}: the request body is larger than this server takes ({self.limit} bytes, "
                   f"--max-body-bytes); send smaller or fewer images")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _counting(receive: Any, limit: int) -> Any:
    seen = 0

    async def counted() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(f"the body outgrew its Content-Length and the {limit}-byte limit")
        return message

    return counted


def _replay(messages: list[dict], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed
