"""Request ids: every response carries `x-request-id` (the client's, if it sent a usable one), every log line
written while answering a request names it, and an unexpected failure is a 500 that gives the id, never the
exception text.

A plain ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed responses).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid
from typing import Any

logger = logging.getLogger(__name__)

HEADER = b"x-request-id"
_USABLE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")  # NOTE: a client's id lands in headers and logs: keep it tame
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("stepbatch_request_id", default=None)


def request_id_of(scope: dict) -> str:
    """The client's `x-request-id` if it is usable, else a new one."""
    sent = dict(scope.get("headers", ())).get(HEADER, b"").decode("latin-1")
    return sent if _USABLE.match(sent) else uuid.uuid4().hex


def internal_error_body(request_id: str | None) -> dict[str, Any]:
    """OpenAI's error object for a failure that is not the client's: the id to report, no exception text."""
    return {"error": {"message": f"the server failed on this request (request id {request_id}); retry, or give the "
                                 f"operator the request id", "type": "server_error", "param": None,
                      "code": "internal_error", "request_id": request_id}}


class RequestIdMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = current_request_id.set(request_id)
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error")
            if started:
                raise  # NOTE: a stream already under way can only be cut off
            body = json.dumps(internal_error_body(request_id)).encode()
            await send_with_id({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
            await send_with_id({"type": "http.response.body", "body": body})
        finally:
            current_request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the request being answered in this context, or "-")."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage(), "request_id": getattr(record, "request_id", None) or "-"}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger as `--log-level` / `--log-format` ("text" or "json") say; every line names its request."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JSONFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
