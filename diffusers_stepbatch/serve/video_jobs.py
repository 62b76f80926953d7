"""`VideoJobs`: the server's video jobs, run by the engine independently of any HTTP client.

A job is submitted through `StepBatched.submit` (validated there, so bad input is a 400 before it exists), with
a step callback that records its progress and, every few steps, a preview; its Future's done callback hands the
frames to a small thread pool that writes the MP4 into the job's folder. Clients poll the job, read its events
or download its file; none of them owns it. Finished jobs expire after `video_retention_s` (a sweeper thread
deletes them and their files); at most `max_video_jobs` are kept.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .config import ServeConfig
from .protocol import APIError
from .video_encoding import gif_bytes, to_uint8, write_mp4, write_spritesheet, write_thumbnail
from ..video_preview import VideoPreviewer, video_rgb_projection
from .video_request import VideoPlan

logger = logging.getLogger(__name__)

VIDEO_FILE, THUMBNAIL_FILE, SPRITESHEET_FILE = "video.mp4", "thumbnail.webp", "spritesheet.jpg"
TERMINAL_EVENTS = ("video.completed", "video.failed")
_STEPS_SHARE = 95  # NOTE: progress reaches 95 % with the last step; decoding and encoding take it to 100


@dataclass(eq=False)
class VideoJob:
    """One video job; `status` is OpenAI's: queued -> in_progress -> completed | failed."""

    id: str
    plan: VideoPlan
    model: str
    directory: Path
    sb: Any
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    step: int = 0
    num_steps: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    finished_time: float | None = None  # NOTE: precise, for retention (the API's timestamps are whole seconds)
    error: dict[str, Any] | None = None
    request_id: int | None = None
    handle: Any = None
    cancel_requested: bool = False
    preview: dict[str, Any] | None = None  # the latest preview event
    previews_pending: list[concurrent.futures.Future] = field(default_factory=list)
    live_entry: Any = None
    listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    @property
    def progress(self) -> int:
        if self.status == "completed":
            return 100
        return _STEPS_SHARE * self.step // max(self.num_steps, 1)

    def to_object(self) -> dict[str, Any]:
        """OpenAI's video object, with our extras (`num_frames`, `fps`, `seed`, `num_inference_steps`)."""
        plan = self.plan
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": plan.prompt, "seconds": plan.seconds, "size": plan.size,
                "remixed_from_video_id": None, "error": self.error, "num_frames": plan.num_frames, "fps": plan.fps,
                "seed": plan.seed, "num_inference_steps": self.num_steps or plan.num_steps}


class VideoJobs:
    """The jobs of one server. `create` submits; `get`, `page`, `delete`, `subscribe` serve the routes."""

    def __init__(self, config: ServeConfig, live: Any = None):
        self.config, self.live = config, live
        self._jobs: dict[str, VideoJob] = {}  # NOTE: insertion order is creation order
        self._lock = threading.RLock()
        self._owns_root = config.video_dir is None
        self.root = Path(tempfile.mkdtemp(prefix="stepbatch-videos-") if self._owns_root else config.video_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="stepbatch-video")
        # NOTE: one thread, so that a job's previews come in step order
        self._previews = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stepbatch-video-preview")
        self._closed = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="stepbatch-video-sweeper", daemon=True)
        self._sweeper.start()

    # ------------------------------------------------------------------------------------------ create
    def create(self, served: Any, plan: VideoPlan) -> VideoJob:
        """Queue a planned job in the engine; bad input raises here (nothing is kept), as `submit` does."""
        with self._lock:
            self._make_room()
            job_id = f"video_{secrets.token_hex(12)}"
            job = VideoJob(id=job_id, plan=plan, model=served.name, directory=self.root / job_id, sb=served.sb,
                           num_steps=plan.num_steps)
        job.directory.mkdir()
        previewer = self._previewer(served.sb.pipe)
        every = self.config.video_preview_every or max(1, plan.num_steps // 10)

        def on_step_end(step_pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            total = getattr(step_pipe, "_num_timesteps", None) or plan.num_steps
            due = previewer is not None and (index + 1) % every == 0 and index + 1 < total
            raw = None if previewer is None else previewer.predict(step_pipe.scheduler, index, tensors["latents"], due)
            with self._lock:
                if job.finished:  # NOTE: cancelled while this step ran: the engine drops it before the next
                    return {}
                job.status, job.step, job.num_steps = "in_progress", index + 1, total
                self._publish(job, self._progress_event(job))
            if raw is not None:
                try:
                    job.previews_pending.append(self._previews.submit(self._make_preview, job, previewer, raw,
                                                                      index + 1, total))
                except RuntimeError:  # shutting down: the job is being cancelled, no one waits for previews
                    pass
            return {}

        try:
            handle = served.sb.submit(priority=plan.priority, callback_on_step_end=on_step_end,
                                      callback_on_step_end_tensor_inputs=["latents"], **plan.kwargs)
        except BaseException:
            shutil.rmtree(job.directory, ignore_errors=True)
            raise
        job.handle, job.request_id = handle, handle.request_id
        if self.live is not None:
            job.live_entry = self.live.start(SimpleNamespace(
                user=plan.user, kind="video", task="image-to-video" if "image" in plan.kwargs else "text-to-video",
                width=plan.width, height=plan.height, num_steps=plan.num_steps, request_ids=[handle.request_id]))
        with self._lock:
            self._jobs[job.id] = job
        handle.add_done_callback(lambda done: self._on_done(job, done))
        return job

    @staticmethod
    def _previewer(pipe: Any) -> VideoPreviewer | None:
        projection = video_rgb_projection(pipe)
        return None if projection is None else VideoPreviewer(pipe, projection)

    def _make_room(self) -> None:
        self._sweep(time.time())
        while len(self._jobs) >= self.config.max_video_jobs:
            oldest = next((job for job in self._jobs.values() if job.finished), None)
            if oldest is None:
                raise APIError(429, f"{len(self._jobs)} video jobs are queued or running, the most this server keeps "
                                    f"(--max-video-jobs); retry when one has finished", type="rate_limit_error",
                               code="too_many_video_jobs",
                               headers={"Retry-After": str(max(1, self.config.retry_after_s))})
            self._remove(oldest)

    # ------------------------------------------------------------------------------------ engine side
    def _on_done(self, job: VideoJob, handle: Any) -> None:
        """The engine finished (or dropped) the request: runs in the engine thread, so it only hands work off."""
        if handle.cancelled():
            reason = "cancelled by DELETE /v1/videos/{id}" if job.cancel_requested else "cancelled by the engine"
            self._fail(job, "cancelled", f"the job was {reason}")
            return
        exc = handle.exception()
        if exc is not None:
            from .errors import engine_error
            from .generation import RequestFailed

            error = engine_error(RequestFailed(exc), self.config)
            self._fail(job, error.code or "generation_failed", error.message, error.type)
            return
        try:
            self._pool.submit(self._write_files, job, handle.result())
        except RuntimeError:  # the pool shut down: the server is stopping
            self._fail(job, "server_stopping", "the server shut down before the video was written")

    def _write_files(self, job: VideoJob, output: Any) -> None:
        concurrent.futures.wait(job.previews_pending)  # NOTE: a job's previews reach its listeners before its end
        try:
            frames = to_uint8(output.frames[0])
            write_mp4(frames, job.directory / VIDEO_FILE, job.plan.fps)
            write_thumbnail(frames, job.directory / THUMBNAIL_FILE)
            write_spritesheet(frames, job.directory / SPRITESHEET_FILE)
        except Exception as exc:  # the job fails, the server goes on
            logger.exception("writing %s failed", job.id)
            self._fail(job, "encoding_failed", f"writing the MP4 failed: {type(exc).__name__}: {exc}", "server_error")
            return
        with self._lock:
            if job.cancel_requested:
                self._fail(job, "cancelled", "the job was cancelled by DELETE /v1/videos/{id}")
                shutil.rmtree(job.directory, ignore_errors=True)
                return
            job.status, job.step = "completed", job.num_steps
            self._stamp_finished(job)
            self._end(job, "done", {"type": "video.completed", "video": job.to_object()})

    def _fail(self, job: VideoJob, code: str, message: str, kind: str = "invalid_request_error") -> None:
        with self._lock:
            if job.finished:
                return
            job.status = "failed"
            self._stamp_finished(job)
            job.error = {"code": code, "message": message, "type": kind, "param": None}
            self._end(job, "failed", {"type": "video.failed", "video": job.to_object()})

    def _stamp_finished(self, job: VideoJob) -> None:
        job.finished_time = time.time()
        job.completed_at = int(job.finished_time)
        job.expires_at = int(job.finished_time + self.config.video_retention_s)

    def _end(self, job: VideoJob, status: str, event: dict[str, Any]) -> None:
        self._publish(job, event)
        if job.live_entry is not None:
            self.live.finish(job.live_entry, status)

    def _make_preview(self, job: VideoJob, previewer: VideoPreviewer, raw: Any, step: int, total: int) -> None:
        frames = previewer.frames(raw)
        temporal = getattr(job.sb.pipe, "vae_scale_factor_temporal", None) or 1
        event = {"type": "video.preview", "video_id": job.id, "step": step, "num_steps": total,
                 "output_format": "gif", "size": f"{frames.shape[2]}x{frames.shape[1]}", "frames": len(frames),
                 "b64_json": base64.b64encode(gif_bytes(frames, job.plan.fps / temporal)).decode("ascii")}
        with self._lock:
            if not job.finished:
                job.preview = event
                self._publish(job, event)

    @staticmethod
    def _progress_event(job: VideoJob) -> dict[str, Any]:
        return {"type": "video.progress", "video_id": job.id, "status": job.status, "progress": job.progress,
                "step": job.step, "num_steps": job.num_steps}

    # ----------------------------------------------------------------------------------- events
    def _publish(self, job: VideoJob, event: dict[str, Any]) -> None:
        for loop, queue in list(job.listeners):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # that listener's event loop closed
                job.listeners.remove((loop, queue))

    def subscribe(self, job: VideoJob) -> asyncio.Queue:
        """A queue of the job's events from now on, starting with its state now (and its latest preview)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if job.finished:
                kind = "video.completed" if job.status == "completed" else "video.failed"
                queue.put_nowait({"type": kind, "video": job.to_object()})
                return queue
            queue.put_nowait(self._progress_event(self.refreshed(job)))
            if job.preview is not None:
                queue.put_nowait(job.preview)
            job.listeners.append((asyncio.get_running_loop(), queue))
        return queue

    def unsubscribe(self, job: VideoJob, queue: asyncio.Queue) -> None:
        with self._lock:
            job.listeners = [entry for entry in job.listeners if entry[1] is not queue]

    # ------------------------------------------------------------------------------------- queries
    def get(self, video_id: str) -> VideoJob:
        with self._lock:
            job = self._jobs.get(video_id)
        if job is None:
            raise APIError(404, f"video_id={video_id!r} does not exist (never made, deleted, or expired after "
                                f"{self.config.video_retention_s:g} s)", type="invalid_request_error",
                           param="video_id", code="video_not_found")
        return self.refreshed(job)

    @staticmethod
    def refreshed(job: VideoJob) -> VideoJob:
        """A queued job the engine has admitted is `in_progress` before its first step ends."""
        running = list(job.sb.engine.scheduler.running)
        if job.status == "queued" and any(r.request_id == job.request_id for r in running):
            job.status = "in_progress"
        return job

    def page(self, limit: int, after: str | None, order: str) -> dict[str, Any]:
        """OpenAI's cursor page of video objects, newest first with `order="desc"`."""
        with self._lock:
            jobs = list(self._jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise APIError(400, f"after={after!r} is not a video id in this list", param="after",
                               code="invalid_value")
            jobs = jobs[ids.index(after) + 1:]
        data = [self.refreshed(job).to_object() for job in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}

    def delete(self, video_id: str) -> dict[str, Any]:
        """Cancel a queued or running job (it ends `failed`, code "cancelled", and stays listed until it expires);
        delete a finished one and its files."""
        job = self.get(video_id)
        with self._lock:
            if not job.finished:
                job.cancel_requested = True
                job.handle.abort()  # between two steps; its done callback marks it failed
                return {"id": job.id, "object": "video.deleted", "deleted": False, "cancelled": True,
                        "status": job.status}
            self._remove(job)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    def file(self, job: VideoJob, name: str) -> Path:
        if job.status != "completed":
            raise APIError(409, f"video {job.id} is {job.status}; its content is there once it is completed",
                           param="video_id", code="video_not_ready")
        return job.directory / name

    # ------------------------------------------------------------------------------------ retention
    def _remove(self, job: VideoJob) -> None:
        self._jobs.pop(job.id, None)
        shutil.rmtree(job.directory, ignore_errors=True)

    def _sweep(self, now: float) -> None:
        with self._lock:
            for job in [job for job in self._jobs.values() if job.finished_time is not None
                        and job.finished_time + self.config.video_retention_s <= now]:
                self._remove(job)

    def _sweep_loop(self) -> None:
        interval = min(max(self.config.video_retention_s / 4, 0.05), 30.0)
        while not self._closed.wait(interval):
            try:
                self._sweep(time.time())
            except Exception:  # the sweeper must outlive a bad folder
                logger.exception("sweeping expired video jobs failed")

    def close(self) -> None:
        """Cancel what runs, wait for files being written, delete every job's files (jobs live in memory only)."""
        self._closed.set()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if not job.finished:
                job.handle.abort()
        self._previews.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True)
        with self._lock:
            for job in list(self._jobs.values()):
                self._remove(job)
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
