"""The server's routes, on one module-level `APIRouter`; `create_app` (app.py) includes it.

Each route reaches its server (config, model, metrics) through `request.app.state.server`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..preview import StreamPreview
from .encoding import size_of
from .errors import engine_error
from .generation import (
    ClientDisconnected,
    DisconnectWatch,
    Generation,
    RequestFailed,
    completed_events,
    generate,
    open_stream,
    partial_events,
    plan_edit,
    plan_generation,
    usage,
)
from .inputs import read_form, read_references
from .protocol import APIError, ErrorResponse, ImageEditRequest, ImageGenerationRequest, bad_request
from .state import ServerContext
from .video_request import video_card
from .tenants import admit, owner_filter

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "Bad input, checked before anything is queued (`param` names the field)",
    401: "Missing or wrong API key (`--api-key`)",
    404: "Unknown model",
    413: "Request body over `--max-body-bytes`",
    429: "The engine's queue is full (`Retry-After`)",
    503: "Loading, failed to load, or shutting down (`Retry-After`)",
    504: "`deadline_s` can't be met",
    500: "The model failed on this request",
}.items()}
_IMAGE_RESPONSE = {200: {"description": "JSON `{created, data: [{b64_json}], usage, size, output_format}`, or with "
                                        "`stream: true` server-sent `*.partial_image` / `*.completed` events",
                         "content": {"text/event-stream": {}}}}
_INLINE_ENCODE_PIXELS = 256 * 256  # NOTE: smaller images encode in well under a millisecond: no thread hop


def server_of(request: Request) -> ServerContext:
    return request.app.state.server


def authorize(request: Request) -> None:
    """Who asks: `request.state.key` is the caller's `TenantKey` (None on an open server); 401 for a bad key."""
    tenants = server_of(request).tenants
    request.state.key = None
    if tenants is None:
        return
    request.state.key = tenants.authenticate(request.headers.get("authorization", ""))
    if request.state.key is None:
        raise APIError(401, "Incorrect API key provided: pass `Authorization: Bearer <key>` with a key of the "
                            "server's --api-key / --api-keys", code="invalid_api_key")


def key_of(request: Request) -> Any:
    return getattr(request.state, "key", None)


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)], responses={401: _ERRORS[401]})


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def web_page(request: Request) -> HTMLResponse:
    page = resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page.replace("{{MODEL}}", server_of(request).config.model_name))


@router.get("/static/app.js", include_in_schema=False)
async def web_script() -> Response:
    script = resources.files(__package__).joinpath("static/app.js").read_text(encoding="utf-8")
    return Response(script, media_type="text/javascript")


@router.get("/health", responses={503: _ERRORS[503]})
async def health(request: Request) -> JSONResponse:
    """200 `{"status": "ok"}` once the model is loaded and its engine runs; 503 while loading, after a failed
    load, when stopping, and once the engine thread has died (`"engine_dead"`)."""
    return _probe(request, "ready")


@router.get("/ready", responses={503: _ERRORS[503]})
async def ready(request: Request) -> JSONResponse:
    """Readiness (send traffic here): 200 as `/health`."""
    return _probe(request, "ready")


@router.get("/live", responses={503: _ERRORS[503]})
async def live(request: Request) -> JSONResponse:
    """Liveness (restart when 503): 200 while loading, ready or stopping; 503 after a failed load or once the
    engine thread has died."""
    return _probe(request, "live")


def _probe(request: Request, kind: str) -> JSONResponse:
    server = server_of(request)
    status, is_live, is_ready = server.condition()
    body = {"status": status, "model": server.config.model_name}
    if server.state.error:
        body["error"] = server.state.error
    return JSONResponse(body, status_code=200 if (is_ready if kind == "ready" else is_live) else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text: the engine's collector (batched calls by kind and rows, finished requests, busy fraction)
    and the server's HTTP counters, latencies and requests in flight."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(server_of(request).registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(server: ServerContext) -> dict[str, Any]:
    model = server.state.model
    card = {"id": server.config.model_name, "object": "model", "created": model.created if model else 0,
            "owned_by": "diffusers-stepbatch"}
    if model is not None:
        card.update(video_card(model, server.config) if model.makes_videos else model.card())
    return card


@v1.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served model, with our metadata: `pipeline`, `default_size`, `sizes` (the sizes it draws; others are a
    400) and `edits` (task -> pipeline serving `/v1/images/edits`)."""
    server = server_of(request)
    return {"object": "list", "data": [_model_card(server), *map(functools.partial(_adapter_card, server),
                                                                    _adapters(server))]}


def _adapters(server: ServerContext) -> list[str]:
    model = server.state.model
    return model.lora.names() if model is not None and model.lora is not None else []


def _adapter_card(server: ServerContext, name: str) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists one: a model whose `parent` is the served model (`model=NAME` picks it)."""
    model = server.state.model
    return {"id": name, "object": "model", "created": model.created, "owned_by": "diffusers-stepbatch",
            "parent": server.config.model_name}


@v1.get("/models/{name:path}", responses={404: _ERRORS[404]})
async def get_model(name: str, request: Request) -> dict[str, Any]:
    server = server_of(request)
    if name in _adapters(server):
        return _adapter_card(server, name)
    if name != server.config.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {server.config.model_name!r}",
                       param="model", code="model_not_found")
    return _model_card(server)


@v1.get("/engine/live")
async def engine_live(request: Request, seconds: float = Query(10.0, gt=0, le=120)) -> dict[str, Any]:
    """The engine now (the web page's live panel): denoise forwards of the last `seconds` with their rows and the
    users whose requests were in flight, requests running / waiting in the engine, and the server's recent
    image requests."""
    server = server_of(request)
    model = server.ready_model(None)
    return server.live.snapshot(model.sb, seconds, viewer=owner_filter(key_of(request)))


@v1.post("/images/generations", responses={**_IMAGE_RESPONSE, **{s: _ERRORS[s] for s in (400, 404, 413, 429, 503,
                                                                                           504, 500)}})
async def generations(body: ImageGenerationRequest, request: Request) -> Any:
    """OpenAI's image generation: JSON in; `b64_json` images, or `image_generation.*` events with `stream`."""
    server = server_of(request)
    served = server.ready_model(body.model)
    generation = plan_generation(served, body, server.config.max_prompt_chars)
    return await _answer(server, generation, request, on_end=admit(server.tenants, key_of(request), generation))


def _component_schemas() -> dict[str, Any]:
    """`ImageEditRequest` and the models it uses, for the OpenAPI document's components (the edit route reads
    its body itself: it takes a multipart form or JSON)."""
    schema = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    return {**schema.pop("$defs", {}), "ImageEditRequest": schema}


COMPONENT_SCHEMAS = _component_schemas()
_EDIT_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {"schema": {
            "type": "object", "required": ["image", "prompt"],
            "properties": {
                "image": {"type": "array", "items": {"type": "string", "format": "binary"},
                          "description": "One or several PNG/JPEG/WEBP files (also as `image[]`)"},
                "mask": {"type": "string", "format": "binary",
                         "description": "PNG with alpha (transparent = edit here) or a grayscale mask (white = "
                                        "edit here), the first image's size"},
                **{name: {"type": "string", "description": field.description or ""}
                   for name, field in ImageEditRequest.model_fields.items() if name not in ("images", "mask")},
            }}},
        "application/json": {"schema": {"$ref": "#/components/schemas/ImageEditRequest"}},
    },
}


@v1.post("/images/edits", openapi_extra={"requestBody": _EDIT_BODY},
         responses={**_IMAGE_RESPONSE, **{s: _ERRORS[s] for s in (400, 404, 413, 429, 503, 504, 500)}})
async def edits(request: Request) -> Any:
    """OpenAI's image edit: a multipart form (`image` / `image[]` files, optional `mask` on the first image) or
    JSON with `images` / `mask` as data URLs. With a mask the model's inpainting pipeline repaints the masked
    part; without one its reference-edit or img2img pipeline redraws the image. `image_edit.*` events with
    `stream`."""
    server = server_of(request)
    config = server.config
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        body, inputs = await read_form(request, config)
        served = server.ready_model(body.model)
    elif content_type.startswith("application/json"):
        try:
            body = ImageEditRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            raise bad_request(f"{param or 'body'}: {first['msg']}", param) from None
        served = server.ready_model(body.model)
        inputs = await read_references(body, config)
    else:
        raise APIError(415, f"Content-Type {content_type or 'none'!r}: send multipart/form-data (OpenAI's form) or "
                            f"application/json", code="unsupported_media_type")
    generation = plan_edit(served, body, inputs, config.max_prompt_chars)
    release = admit(server.tenants, key_of(request), generation)
    served.edit_started()  # NOTE: from now on generations go where they can share forwards with this edit

    def on_end() -> None:
        served.edit_finished()
        release()

    return await _answer(server, generation, request, on_end=on_end)


async def _answer(server: ServerContext, generation: Generation, request: Request, on_end: Any = None) -> Any:
    """Run a planned request to its JSON answer or its stream of events; `end` runs once, when it is over."""
    served = server.state.model
    lora = served.lora if "adapters" in generation.kwargs else None
    if lora is not None:
        await lora.admit(list(generation.kwargs["adapters"]))  # NOTE: may wait for an adapter to load
    watch = DisconnectWatch(request.receive)
    entry = server.live.start(generation)
    server.http_metrics.generations.inc()
    started = time.perf_counter()

    def end(status: str) -> None:
        watch.close()
        server.http_metrics.generations.dec()
        server.live.finish(entry, status)
        if lora is not None:
            lora.release()
        if status == "done":
            endpoint = "edits" if generation.kind == "edit" else "generations"
            server.request_metrics.observe(generation.sb, generation.request_ids, endpoint, served.name, started)
        if on_end is not None:
            on_end()

    if generation.stream:
        return await _stream_response(server, generation, watch, end)
    status = "failed"
    try:
        try:
            images = await generate(served, generation, watch)
        except ClientDisconnected:
            status = "disconnected"
            return Response(status_code=499)  # nobody reads it; logged and counted as 499
        data = [{"b64_json": b64} for b64 in await _encode_all(images, generation)]
        status = "done"
        return {"created": int(time.time()), "data": data, "usage": usage(served, generation, images),
                "size": size_of(images[0]), "output_format": generation.output_format,
                "quality": "auto", "background": "opaque"}
    except (APIError, asyncio.CancelledError):  # NOTE: a cancelled task (Ray's disconnect) stays cancelled
        raise
    except Exception as exc:
        raise engine_error(exc, server.config, generation.kwargs) from exc
    finally:
        end(status)


async def _stream_response(server: ServerContext, generation: Generation, watch: DisconnectWatch, end: Any) -> Any:
    """A `StreamingResponse` of the request's events (which then owns `end`), or the error known before any."""
    try:
        pump = await open_stream(server.state.model, generation)
    except BaseException as exc:
        end("failed")
        if isinstance(exc, Exception) and not isinstance(exc, APIError):
            raise engine_error(exc, server.config, generation.kwargs) from exc
        raise
    try:
        first = await watch.race(pump.next())  # NOTE: errors known before any event keep their HTTP code
    except BaseException as exc:
        pump.stop()
        end("disconnected" if isinstance(exc, ClientDisconnected) else "failed")
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)
        raise
    if first[0] == "error":
        pump.stop()
        end("failed")
        raise engine_error(RequestFailed(first[1]), server.config)
    return StreamingResponse(_events(server, generation, pump, watch, first, end), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(server: ServerContext, generation: Generation, pump: Any, watch: DisconnectWatch,
                  item: tuple[str, Any], end: Any) -> AsyncIterator[str]:
    served = server.state.model
    schedule, sent, status = set(generation.partial_steps()), 0, "failed"
    try:
        while item[0] == "item":
            value = item[1]
            if isinstance(value, StreamPreview):
                if value.step in schedule:
                    scale = getattr(generation.sb.pipe, "vae_scale_factor", 8)
                    for event in await run_in_threadpool(partial_events, generation, value, sent, scale):
                        yield _sse(event)
                    sent += 1
            else:
                images = generation.finish(value.images)
                events = await run_in_threadpool(completed_events, generation, images,
                                                 usage(served, generation, images))
                for event in events:
                    yield _sse(event)
                status = "done"
            item = await watch.race(pump.next())
        if item[0] == "error":
            error = engine_error(RequestFailed(item[1]), server.config)
            yield _sse({"type": "error", "error": error.body()["error"]}, event="error")
    except ClientDisconnected:
        status = "disconnected"
        logger.info("client disconnected from a stream; its request is aborted")
    finally:
        pump.stop()
        end(status)


async def _encode_all(images: list[Any], generation: Generation) -> list[str]:
    from .encoding import encode_image

    def encode() -> list[str]:
        return [encode_image(image, generation.output_format, generation.compression) for image in images]

    if sum(image.width * image.height for image in images) <= _INLINE_ENCODE_PIXELS:
        return encode()
    return await run_in_threadpool(encode)


def _sse(data: dict[str, Any], event: str | None = None) -> str:
    return f"event: {event or data['type']}\ndata: {json.dumps(data)}\n\n"


router.include_router(v1)
