"""Engine and pipeline exceptions as the OpenAI error objects and HTTP statuses a client can act on."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import traceback
from typing import Any

from ..engine.core import EngineClosedError
from ..engine.scheduler import DeadlineUnmeetable, QueueFull
from .config import ServeConfig
from .extra_fields import SERVER_SET
from .generation import FIELD_OF_ARGUMENT, RequestFailed
from .protocol import APIError
from .request_id import current_request_id, internal_error_body

logger = logging.getLogger(__name__)


def engine_error(exc: BaseException, config: ServeConfig, arguments: dict[str, Any] | None = None) -> APIError:
    """The answer to `exc`, raised by `submit` (the client's input: 400) or by a queued request (`RequestFailed`).

    `arguments`: the pipeline arguments of the request, which `param` of a 400 is chosen from.
    """
    queued = isinstance(exc, RequestFailed)
    if queued:
        exc = exc.cause
    if isinstance(exc, QueueFull):
        return APIError(429, f"{exc}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(config.retry_after_s)})
    if isinstance(exc, DeadlineUnmeetable):
        return APIError(504, f"{exc}; raise deadline_s or retry when the server is less busy", type="timeout_error",
                        param="deadline_s", code="deadline_unmeetable")
    if isinstance(exc, (EngineClosedError, asyncio.CancelledError)) or type(exc).__name__ == "CancelledError":
        return APIError(503, "the server is shutting down; retry on another replica or later", type="server_error",
                        code="server_stopping", headers={"Retry-After": str(max(1, config.retry_after_s))})
    if isinstance(exc, (ValueError, TypeError)) and (not queued or raised_by_a_pipeline(exc)):
        # NOTE: also after queueing: a pipeline checks some arguments only inside its `__call__`
        return APIError(400, str(exc), param=param_of(exc, arguments or {}), code="invalid_value")
    logger.error("request failed", exc_info=exc)
    request_id = current_request_id.get()
    body = internal_error_body(request_id)["error"]
    return APIError(500, body["message"], type="server_error", code="generation_failed",
                    extra={"request_id": request_id})


def raised_by_a_pipeline(exc: BaseException) -> bool:
    """Whether `exc` is a check of the request's arguments: raised by a diffusers pipeline's own code (its
    `__call__`, `check_inputs`), or naming its argument; not a failure deep in a model or in torch."""
    if getattr(exc, "argument", None) is not None:
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}diffusers{os.sep}pipelines{os.sep}" in frames[-1].filename


def param_of(exc: BaseException, arguments: dict[str, Any]) -> str | None:
    """The request field a `submit` error is about: its `.argument` (`InvalidArgument`, also from a pipeline's
    `check_inputs`), else the first of the request's arguments its message names (a size the model can't take)."""
    argument = getattr(exc, "argument", None)
    if argument is not None:
        return FIELD_OF_ARGUMENT.get(argument)
    return mentioned_field(str(exc), arguments)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def mentioned_field(message: str, arguments: dict[str, Any]) -> str | None:
    """The field of the request argument `message` names first, in backticks first ("`height` and `width` ...")."""
    quoted = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", message)
    for word in [*quoted, *_IDENTIFIER.findall(message)]:
        word = word.lower()  # NOTE: "Height must be divisible by 16"
        if word in arguments and word in FIELD_OF_ARGUMENT:
            return FIELD_OF_ARGUMENT[word]
        if word in arguments and word not in SERVER_SET:  # an argument the body passed through by its own name
            return word
    return None
