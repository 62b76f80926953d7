"""A middleware for Ray Serve's HTTP proxy: a request whose replica died answers with an OpenAI error object.

Without it, Ray's proxy answers a request whose replica died mid-flight with a bare `500 Internal Server
Error`. Enable it where the proxy starts (before `ray start` / `ray.init`):

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=diffusers_stepbatch.serve.ray_proxy:proxy_middlewares

The answer is a 502 (`code: "replica_failed"`, `Retry-After: 1`): the official openai client retries it by
itself, and the request goes to a live replica. Kept apart from `serve.ray` so the proxy imports no Ray
Serve deployment code.
"""

from __future__ import annotations

import json
from typing import Any

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "diffusers_stepbatch.serve.ray_proxy:proxy_middlewares"
_MESSAGE = ("the replica serving this request failed before answering (it may have died or been restarted); "
            "nothing was returned: retry the request, another replica will serve it")


class ReplicaFailureMiddleware:
    """Answers 502 + an OpenAI error object when the proxied app ends without having started a response."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
        if not started:
            body = json.dumps({"error": {"message": _MESSAGE, "type": "server_error", "param": None,
                                         "code": "replica_failed"}}).encode()
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """The callback Ray Serve's proxy calls (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFailureMiddleware)]
