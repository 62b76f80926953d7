"""`create_app`: the FastAPI app around one `StepBatched` engine (OpenAI Images API, health, metrics, web page)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.core import EngineClosedError
from ..engine.scheduler import DeadlineUnmeetable, QueueFull
from ..preview import StreamPreview
from .config import ServeConfig
from .encoding import size_of
from .generation import (
    ClientDisconnected,
    DisconnectWatch,
    RequestFailed,
    completed_events,
    generate,
    open_stream,
    partial_events,
    plan_generation,
    usage,
)
from .metrics import HTTPMetrics, MetricsMiddleware, ReplicaHeaderMiddleware
from .model import ServingModel, load_model
from .protocol import APIError, ImageGenerationRequest, param_of_error

logger = logging.getLogger(__name__)


class ServerState:
    """Where the server is in its life: "loading" -> "ready" (or "failed") -> "stopping"."""

    def __init__(self):
        self.phase = "loading"
        self.model: ServingModel | None = None
        self.error: str | None = None

    def begin_shutdown(self) -> None:
        """New generation requests get 503 from now on; in-flight ones finish."""
        self.phase = "stopping"


def create_app(config: ServeConfig | None = None, *, model: ServingModel | None = None,
               loader: Callable[[ServeConfig], ServingModel] = load_model, close_model: bool | None = None,
               replica: str | None = None) -> FastAPI:
    """The server's FastAPI app. Without `model`, `loader(config)` runs in a thread at startup (503 until then).
    `close_model`: close the engine at shutdown (default: only one the app loaded itself). `replica` names
    this copy of the server in an `X-StepBatch-Replica` response header (Ray Serve sets it).

    >>> app = create_app(ServeConfig(max_batch_size=8))
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    from prometheus_client import CollectorRegistry

    config = config or ServeConfig()
    state = ServerState()
    registry = CollectorRegistry()
    http_metrics = HTTPMetrics(registry)

    def attach(loaded: ServingModel) -> None:
        loaded.sb.register_prometheus(registry)
        state.model = loaded
        if state.phase == "loading":
            state.phase = "ready"

    async def load_in_background() -> None:
        try:
            attach(await asyncio.to_thread(loader, config))
        except Exception as exc:
            logger.exception("loading %s failed", config.model)
            state.phase, state.error = "failed", f"{type(exc).__name__}: {exc}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if model is not None:
            attach(model)
        else:
            loading = asyncio.create_task(load_in_background())
        yield
        state.begin_shutdown()
        if loading is not None:
            await loading  # NOTE: a load can't be interrupted; close what it made
        if state.model is not None and (loading is not None if close_model is None else close_model):
            await asyncio.to_thread(state.model.close)  # in-flight requests finish first

    app = FastAPI(title="diffusers-stepbatch", lifespan=lifespan)
    app.state.server_state = state
    app.state.config = config
    app.add_middleware(MetricsMiddleware, metrics=http_metrics)
    if replica is not None:
        app.add_middleware(ReplicaHeaderMiddleware, replica=replica)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
        if "input" in first and param:
            message = f"{param}={first['input']!r}: {first.get('msg', 'invalid value')}"
        return await api_error(request, APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                                 type=kind, code=kind))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), config.api_key):
            raise APIError(401, "Incorrect API key provided: pass `Authorization: Bearer <key>` with the server's "
                                "--api-key", code="invalid_api_key")

    def ready_model(requested: str | None) -> ServingModel:
        if state.phase != "ready" or state.model is None:
            reason = {"loading": "the model is still loading", "stopping": "the server is shutting down",
                      "failed": f"the model failed to load ({state.error})"}.get(state.phase, state.phase)
            raise APIError(503, f"{reason}; retry later", type="server_error", code=f"server_{state.phase}",
                           headers={"Retry-After": str(max(1, config.retry_after_s))})
        if requested is not None and requested != state.model.name:
            raise APIError(404, f"model={requested!r} does not exist; this server serves {state.model.name!r}",
                           param="model", code="model_not_found")
        return state.model

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def web_page() -> HTMLResponse:
        page = resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", config.model_name))

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if state.phase == "ready" else state.phase, "model": config.model_name}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if state.phase == "ready" else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        created = state.model.created if state.model is not None else 0
        return {"id": config.model_name, "object": "model", "created": created, "owned_by": "diffusers-stepbatch"}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def get_model(name: str) -> dict[str, Any]:
        if name != config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/images/generations", dependencies=[Depends(authorize)])
    async def generations(body: ImageGenerationRequest, request: Request) -> Any:
        served = ready_model(body.model)
        generation = plan_generation(served, body)
        watch = DisconnectWatch(request.receive)
        http_metrics.generations.inc()
        streaming = False
        try:
            if body.stream:
                response = await _stream_response(served, generation, watch)
                streaming = isinstance(response, StreamingResponse)  # its events end the count and the watch
                return response
            try:
                images = await generate(served, generation, watch)
            except ClientDisconnected:
                return Response(status_code=499)  # nobody reads it; logged and counted as 499
            data = [{"b64_json": b64} for b64 in await _encode_all(images, generation)]
            return {"created": int(time.time()), "data": data, "usage": usage(served, generation, images),
                    "size": size_of(images[0]), "output_format": generation.output_format,
                    "quality": "auto", "background": "opaque"}
        except (APIError, asyncio.CancelledError):  # NOTE: a cancelled task (Ray's disconnect) stays cancelled
            raise
        except Exception as exc:
            raise _engine_error(exc, config) from exc
        finally:
            if not streaming:
                watch.close()
                http_metrics.generations.dec()

    async def _stream_response(served: ServingModel, generation: Any, watch: DisconnectWatch) -> Any:
        pump = await open_stream(served, generation)
        try:
            first = await watch.race(pump.next())  # NOTE: errors known before any event keep their HTTP code
        except ClientDisconnected:
            pump.stop()
            watch.close()
            return Response(status_code=499)
        if first[0] == "error":
            pump.stop()
            watch.close()
            raise _engine_error(RequestFailed(first[1]), config)
        return StreamingResponse(_events(served, generation, pump, watch, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(served: ServingModel, generation: Any, pump: Any, watch: DisconnectWatch,
                      item: tuple[str, Any]) -> AsyncIterator[str]:
        schedule, sent = set(generation.partial_steps()), 0
        try:
            while item[0] == "item":
                value = item[1]
                if isinstance(value, StreamPreview):
                    if value.step in schedule:
                        scale = getattr(served.sb.pipe, "vae_scale_factor", 8)
                        for event in await run_in_threadpool(partial_events, generation, value, sent, scale):
                            yield _sse(event)
                        sent += 1
                else:
                    images = value.images
                    events = await run_in_threadpool(completed_events, generation, images,
                                                     usage(served, generation, images))
                    for event in events:
                        yield _sse(event)
                item = await watch.race(pump.next())
            if item[0] == "error":
                error = _engine_error(RequestFailed(item[1]), config)
                yield _sse({"type": "error", "error": error.body()["error"]}, event="error")
        except ClientDisconnected:
            logger.info("client disconnected from a stream; its request is aborted")
        finally:
            pump.stop()
            watch.close()
            http_metrics.generations.dec()

    return app


_INLINE_ENCODE_PIXELS = 256 * 256  # NOTE: smaller images encode in well under a millisecond: no thread hop


async def _encode_all(images: list[Any], generation: Any) -> list[str]:
    from .encoding import encode_image

    def encode() -> list[str]:
        return [encode_image(image, generation.output_format, generation.compression) for image in images]

    if sum(image.width * image.height for image in images) <= _INLINE_ENCODE_PIXELS:
        return encode()
    return await run_in_threadpool(encode)


def _sse(data: dict[str, Any], event: str | None = None) -> str:
    return f"event: {event or data['type']}\ndata: {json.dumps(data)}\n\n"


def _engine_error(exc: BaseException, config: ServeConfig) -> APIError:
    """An engine exception as the OpenAI error object and HTTP status a client can act on.

    Errors raised at submit are the client's (400 for bad input); a `RequestFailed` happened after queueing.
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
    if isinstance(exc, (ValueError, TypeError)) and not queued:
        message = str(exc)
        return APIError(400, message, param=param_of_error(message), code="invalid_value")
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"the model failed on this request: {type(exc).__name__}: {exc}", type="server_error",
                    code="generation_failed")
