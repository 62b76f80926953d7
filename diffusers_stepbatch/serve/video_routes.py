"""OpenAI's videos API on a server whose model is a video pipeline: `POST /v1/videos` creates a job,
`GET /v1/videos[/{id}[/content]]` read it, `DELETE /v1/videos/{id}` cancels or deletes it, and
`GET /v1/videos/{id}/events` (ours) streams its progress and previews as server-sent events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .errors import engine_error
from .inputs import _fetch as fetch_reference
from .inputs import decode_image
from .model import ServingModel
from .protocol import APIError, ErrorResponse, bad_request, fold_brackets
from .routes import authorize, key_of
from .tenants import capped_priority, check_shape, owner_filter
from .state import ServerContext
from .video_jobs import VideoJobs
from .video_run import SPRITESHEET_FILE, TERMINAL_EVENTS, THUMBNAIL_FILE, VIDEO_FILE
from .video_request import VIDEO_FIELD_OF_ARGUMENT, VideoCreateRequest, plan_video

_KEEP_ALIVE_S = 15.0
_POLL_AFTER_MS = "250"  # NOTE: the openai client's `poll` helper waits this long between retrieves
_ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "Bad input, checked before the job exists (`param` names the field)",
    404: "Unknown model or video id",
    409: "The video is not completed yet",
    429: "Too many jobs (`--max-video-jobs`) or the engine's queue is full (`Retry-After`)",
    503: "Loading, failed to load, or shutting down (`Retry-After`)",
}.items()}


router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)], tags=["videos"])
page_router = APIRouter()


@page_router.get("/static/video.js", include_in_schema=False)
async def video_script() -> Response:
    """The web page's video mode."""
    script = resources.files(__package__).joinpath("static/video.js").read_text(encoding="utf-8")
    return Response(script, media_type="text/javascript")


def _server(request: Request) -> ServerContext:
    return request.app.state.server


def video_jobs(server: ServerContext) -> VideoJobs:
    """The server's job store, made on first use."""
    if server.videos is None:
        server.videos = VideoJobs(server.config, server.live, server.replica)
    return server.videos


def _video_model(server: ServerContext, requested: str | None) -> ServingModel:
    served = server.ready_model(requested)
    if not served.makes_videos:
        raise bad_request(f"{served.name} ({type(served.sb.pipe).__name__}) makes images, not videos; use "
                          f"/v1/images/generations, or serve a video pipeline (e.g. --model tiny-wan)", "model",
                          code="videos_not_supported")
    return served


async def _read_body(request: Request, server: ServerContext) -> tuple[VideoCreateRequest, Any]:
    """The request (multipart, as OpenAI's client sends it, or JSON) and its decoded `input_reference` or None."""
    config = server.config
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        from starlette.datastructures import UploadFile
        from starlette.exceptions import HTTPException

        try:
            form = await request.form(max_files=2, max_fields=64)
        except HTTPException as exc:
            raise bad_request(f"multipart form: {exc.detail}", None, code="invalid_form") from None
        try:
            fields = {k: v for k, v in form.multi_items() if isinstance(v, str) and not k.startswith("input_reference")}
            body = _validated(fields)
            reference = form.get("input_reference") or form.get("input_reference[image_url]")
            if isinstance(reference, UploadFile):
                image = decode_image(await reference.read(), "input_reference", config)
            elif isinstance(reference, str):
                image = decode_image(await fetch_reference(reference, "input_reference", config), "input_reference",
                                     config)
            else:
                image = None
        finally:
            await form.close()
    elif content_type.startswith("application/json"):
        try:
            body = VideoCreateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise _first_error(exc) from None
        image = None
        if body.input_reference is not None:
            data = await fetch_reference(body.input_reference, "input_reference", config)
            image = decode_image(data, "input_reference", config)
    else:
        raise APIError(415, f"Content-Type {content_type or 'none'!r}: send multipart/form-data (OpenAI's form) or "
                            f"application/json", code="unsupported_media_type")
    return body, None if image is None else image.convert("RGB")


def _validated(fields: dict[str, str]) -> VideoCreateRequest:
    try:
        return VideoCreateRequest.model_validate(fold_brackets(fields))
    except ValidationError as exc:
        raise _first_error(exc) from None


def _first_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    shown = f"={first['input']!r}" if "input" in first and param and first["type"] != "missing" else ""
    return bad_request(f"{param or 'body'}{shown}: {first['msg']}", param)


@router.post("/videos", responses={200: {"description": "The video object, `status: queued`"},
                                   **{s: _ERRORS[s] for s in (400, 404, 429, 503)}})
async def create_video(request: Request) -> JSONResponse:
    """Create a video job: multipart or JSON with `prompt`, `model`, `seconds` or `num_frames`, `size`,
    `input_reference` (image-to-video models) and our extras (`num_inference_steps`, `guidance_scale`, `seed`,
    `negative_prompt`, `priority`). It runs whether or not the client stays."""
    server = _server(request)
    body, image = await _read_body(request, server)
    served = _video_model(server, body.model)
    plan = plan_video(served, body, image, server.config)
    jobs = video_jobs(server)
    key = key_of(request)
    if key is not None:  # NOTE: the key's limits, its priority cap, and its tenant as the job's `user` and owner
        check_shape(key, plan.width, plan.height, plan.num_steps, plan.num_frames)
        await run_in_threadpool(server.tenants.take_request, key)  # NOTE: a database row when replicas share it
        unfinished = await run_in_threadpool(jobs.store.count, True, key.tenant)
        server.tenants.check_video_jobs(key, unfinished, served.sb)
        plan.priority, plan.user = capped_priority(key, plan.priority), key.tenant
    tenant = None if key is None else key.tenant
    lora = served.lora if "adapters" in plan.kwargs else None
    if lora is not None:
        await lora.admit(list(plan.kwargs["adapters"]))  # NOTE: until submitted; the engine's queue holds it then
    try:  # NOTE: in a thread: submitting an I2V call preprocesses the image, and the job is a database write
        job = await run_in_threadpool(jobs.create, served, plan, stored_request(body, plan), image, tenant)
    except APIError:
        raise
    except Exception as exc:
        error = engine_error(exc, server.config, plan.kwargs)
        argument = getattr(exc, "argument", None)
        if error.status == 400 and argument in VIDEO_FIELD_OF_ARGUMENT:  # NOTE: `image` is `input_reference` here
            error.param = VIDEO_FIELD_OF_ARGUMENT[argument]
        raise error from exc
    finally:
        if lora is not None:
            lora.release()
    return JSONResponse(job)


def stored_request(body: VideoCreateRequest, plan: Any) -> dict[str, Any]:
    """What the job store keeps to run the job again: the body with its seed, frames and size as planned (the
    input image is stored beside it as a file)."""
    request = body.model_dump(exclude_none=True, exclude={"input_reference", "seconds"})
    request.update(seed=plan.seed, num_frames=plan.num_frames, size=plan.size, priority=plan.priority,
                   user=plan.user, fps=plan.fps)
    return request


@router.get("/videos")
async def list_videos(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                      order: str = Query("desc", pattern="^(asc|desc)$")) -> dict[str, Any]:
    """The server's video jobs (until they expire), newest first by default; `after` is the last id seen."""
    return await run_in_threadpool(video_jobs(_server(request)).page, limit, after, order,
                                   owner_filter(key_of(request)))


@router.get("/videos/{video_id}", responses={404: _ERRORS[404]})
async def retrieve_video(video_id: str, request: Request) -> JSONResponse:
    """The video object: `status`, `progress` (0-100), `error` for a failed job."""
    jobs = video_jobs(_server(request))
    job = await run_in_threadpool(jobs.get, video_id, owner_filter(key_of(request)))
    headers = {} if job.finished else {"openai-poll-after-ms": _POLL_AFTER_MS}
    return JSONResponse(jobs.object(job), headers=headers)


@router.delete("/videos/{video_id}", responses={404: _ERRORS[404]})
async def delete_video(video_id: str, request: Request) -> dict[str, Any]:
    """A finished job: deleted with its files (`deleted: true`). A queued or running one: cancelled between two
    denoising steps (`deleted: false, cancelled: true`); it stays listed as `failed` (code "cancelled")."""
    return await run_in_threadpool(video_jobs(_server(request)).delete, video_id, owner_filter(key_of(request)))


@router.get("/videos/{video_id}/content", response_class=FileResponse,
            responses={200: {"content": {"video/mp4": {}, "image/webp": {}, "image/jpeg": {}}}, 400: _ERRORS[400],
                       404: _ERRORS[404], 409: _ERRORS[409]})
async def video_content(video_id: str, request: Request, variant: str = "video") -> FileResponse:
    """The MP4 (`variant=video`, H.264), its first frame (`variant=thumbnail`, WebP) or up to 16 evenly spaced
    frames in a grid (`variant=spritesheet`, JPEG)."""
    jobs = video_jobs(_server(request))
    files = {"video": (VIDEO_FILE, "video/mp4"), "thumbnail": (THUMBNAIL_FILE, "image/webp"),
             "spritesheet": (SPRITESHEET_FILE, "image/jpeg")}
    if variant not in files:
        raise bad_request(f"variant={variant!r} is not served; use 'video' (the MP4), 'thumbnail' or 'spritesheet'",
                          "variant", code="unsupported_parameter")
    job = await run_in_threadpool(jobs.get, video_id, owner_filter(key_of(request)))
    name, media_type = files[variant]
    filename = f"{job.id}.{name.rsplit('.', 1)[1]}"
    found = await run_in_threadpool(jobs.content, job, name)
    if isinstance(found, bytes):  # an fsspec store
        disposition = f'attachment; filename="{filename}"'
        return Response(found, media_type=media_type, headers={"Content-Disposition": disposition})
    return FileResponse(found, media_type=media_type, filename=filename)


@router.get("/videos/{video_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}, 404: _ERRORS[404]})
async def video_events(video_id: str, request: Request) -> StreamingResponse:
    """Server-sent events: `video.progress` (status, progress, step), `video.preview` (an animated GIF of the
    predicted video at latent resolution), then `video.completed` or `video.failed` with the video object.
    Leaving the stream leaves the job running."""
    jobs = video_jobs(_server(request))
    job = await run_in_threadpool(jobs.get, video_id, owner_filter(key_of(request)))
    return StreamingResponse(_sse(jobs.events(job)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    pending = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=_KEEP_ALIVE_S)
            if not done:
                yield ": keep-alive\n\n"
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
            if event["type"] in TERMINAL_EVENTS:
                return
    finally:
        if pending is not None:  # NOTE: the generator can only be closed once its pending step has ended
            pending.cancel()
            await asyncio.wait({pending})
        await events.aclose()
