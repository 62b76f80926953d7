"""`create_app`: the FastAPI app around one `StepBatched` engine (OpenAI Images API, health, metrics, web page).

The routes live on `routes.router`; this module wires one server around them: its state, the model's loading
in the background, middleware (body limit, metrics) and the handlers that turn every error into OpenAI's
error object.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServeConfig
from .limits import BodyLimitMiddleware
from .metrics import HTTPMetrics, MetricsMiddleware, ReplicaHeaderMiddleware
from .launch_knobs import warm_up
from .model import ServingModel, load_model
from .protocol import APIError
from .request_id import RequestIdMiddleware
from .request_metrics import RequestMetrics, register_gauges
from .routes import COMPONENT_SCHEMAS, router
from .state import ServerContext, ServerState
from .tenants import Tenants
from .video_routes import page_router as video_page_router
from .video_routes import router as video_router
from .video_routes import video_jobs

logger = logging.getLogger(__name__)

__all__ = ["ServerState", "create_app"]


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
    registry = CollectorRegistry()
    server = ServerContext(config=config, state=ServerState(), registry=registry, http_metrics=HTTPMetrics(registry),
                           replica=replica, tenants=Tenants.from_config(config))
    state = server.state
    server.request_metrics = RequestMetrics(registry)
    register_gauges(registry, lambda: state.model, lambda: server.videos)

    def attach(loaded: ServingModel) -> None:
        loaded.sb.register_prometheus(registry)
        state.model = loaded
        if loaded.makes_videos:  # NOTE: stored jobs (a restart, a dead replica's) run without waiting for a client
            video_jobs(server).start(loaded)
        if state.phase == "loading":
            state.phase = "ready"

    async def start_in_background(given: ServingModel | None) -> None:
        """Load the model (unless given), then run the warm-up requests (`/health` says "warming")."""
        try:
            loaded = given if given is not None else await asyncio.to_thread(loader, config)
            state.phase = "warming" if config.warmup and state.phase == "loading" else state.phase
            attach(loaded)
            if state.phase == "warming":
                await asyncio.to_thread(warm_up, loaded, config.warmup)
        except Exception as exc:
            logger.exception("loading or warming up %s failed", config.model)
            state.phase, state.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        if state.phase == "warming":
            state.phase = "ready"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if model is not None and not config.warmup:
            attach(model)
        else:
            loading = asyncio.create_task(start_in_background(model))
        yield
        state.begin_shutdown()
        if server.videos is not None:
            await asyncio.to_thread(server.videos.close)  # NOTE: cancels running video jobs; finished ones stay
        if server.tenants is not None:
            server.tenants.close()
        if loading is not None:
            await loading  # NOTE: a load can't be interrupted; close what it made
        if state.model is not None and (model is None if close_model is None else close_model):
            await asyncio.to_thread(state.model.close)  # in-flight requests finish first

    app = FastAPI(title="diffusers-stepbatch", lifespan=lifespan,
                  description="An OpenAI-compatible image server around one StepBatched engine: concurrent "
                              "requests (generations and edits) share its denoising batches.")
    app.state.server = server
    app.state.server_state = state
    app.state.config = config
    app.include_router(router)
    app.include_router(video_router)
    app.include_router(video_page_router)
    app.openapi = functools.partial(_openapi, app)
    for handled, handler in ((APIError, api_error), (RequestValidationError, validation_error),
                             (StarletteHTTPException, http_error)):
        app.add_exception_handler(handled, handler)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=server.http_metrics)  # NOTE: counts the 413s too
    app.add_middleware(RequestIdMiddleware)  # NOTE: outside the rest: every answer (500s too) carries the id
    if replica is not None:
        app.add_middleware(ReplicaHeaderMiddleware, replica=replica)
    return app


def _openapi(app: FastAPI) -> dict:
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENT_SCHEMAS)
        app.openapi_schema = schema
    return app.openapi_schema


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid body")
    if "input" in first and param:
        message = f"{param}={first['input']!r}: {first.get('msg', 'invalid value')}"
    return await api_error(request, APIError(400, message, param=param, code="invalid_value"))


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                             type=kind, code=kind))
