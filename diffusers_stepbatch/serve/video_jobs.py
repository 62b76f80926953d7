"""`VideoJobs`: the server's video jobs: rows of a `JobStore` (the truth, shared by replicas) and the runs of
this replica's engine.

Creating a job stores its request (seed included) and its input image, takes its lease and submits it to the
engine, with a step callback that records progress and, every few steps, a preview. The Future's done callback
hands the frames to a small thread pool that writes the MP4 into a folder of that attempt and marks the row
completed, if this replica still holds the job. A heartbeat thread renews this replica's leases (and writes
their progress), reads cancel flags set through other replicas, claims jobs whose leases expired (a replica
died, or the server restarted) and deletes jobs past their retention.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import logging
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..video_preview import VideoPreviewer, video_rgb_projection
from .config import ServeConfig
from .job_store import JobRecord, JobStore
from .protocol import APIError
from .video_encoding import gif_bytes
from .video_files import VideoFiles, write_outputs
from .video_run import REFERENCE_FILE, TERMINAL_EVENTS, LocalRun, job_error, polled_events, progress_event, video_object
from .video_request import VideoPlan

logger = logging.getLogger(__name__)

_SWEEP_EVERY_S = 5.0


class VideoJobs:
    """The jobs of one server. `create` submits; `get`, `page`, `delete`, `events` serve the routes; `start`
    (once the model is loaded) runs the heartbeat that resumes stored jobs."""

    def __init__(self, config: ServeConfig, live: Any = None, replica: str | None = None):
        self.config, self.live = config, live
        self._owns_state = config.state_dir is None and config.jobs_db is None
        state = Path(tempfile.mkdtemp(prefix="stepbatch-jobs-") if self._owns_state else config.state_dir or ".")
        self.state_dir = state
        self.files = VideoFiles(config.video_dir or state / "videos")
        self.root = self.files.root  # NOTE: a Path for a local folder, the store's path for an fsspec URL
        if config.state_dir is not None:
            Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        self.store = JobStore(config.jobs_db or f"sqlite:///{state / 'jobs.sqlite'}")
        self.replica = replica or config.replica_name or f"{socket.gethostname()}:{config.port}"
        self._runs: dict[str, LocalRun] = {}
        self._lock = threading.RLock()
        self._served: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="stepbatch-video")
        # NOTE: one thread, so that a job's previews come in step order
        self._previews = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stepbatch-video-preview")
        self._closing = False
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def start(self, served: Any) -> None:
        """Run jobs from now on: first this replica's own from before a restart, then any whose lease expires."""
        self._served = served
        self._heartbeat = threading.Thread(target=self._beat_loop, name="stepbatch-video-heartbeat", daemon=True)
        self._heartbeat.start()
        if self.store.notifies:  # NOTE: a cancel through another replica arrives now, not at the next heartbeat
            threading.Thread(target=self.store.listen_cancels, args=(self._cancel_local, self._closed),
                             name="stepbatch-video-cancels", daemon=True).start()

    def _cancel_local(self, job_id: str) -> None:
        with self._lock:
            run = self._runs.get(job_id)
            if run is None or run.ended or run.cancel_requested:
                return
            run.cancel_requested = True
        run.handle.abort()  # between two steps; its done callback marks it failed

    # ------------------------------------------------------------------------------------------ create
    def create(self, served: Any, plan: VideoPlan, request: dict[str, Any], image: Any,
               tenant: str | None = None) -> dict[str, Any]:
        """Store and queue a planned job; bad input raises here (nothing is kept), as `submit` does."""
        self._make_room()
        job_id = f"video_{secrets.token_hex(12)}"
        if image is not None:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            self.files.write(f"{job_id}/{REFERENCE_FILE}", buffer.getvalue())
        now = time.time()
        summary = {"prompt": plan.prompt, "width": plan.width, "height": plan.height, "num_frames": plan.num_frames,
                   "fps": plan.fps, "seed": plan.seed}
        with self._lock:  # NOTE: the heartbeat sees the row and its run together
            self.store.insert(id=job_id, tenant=tenant, end_user=plan.user, model=served.name, status="queued",
                              created_at=now, step=0, num_steps=plan.num_steps, request=request, summary=summary,
                              has_reference=image is not None, lease_owner=self.replica,
                              lease_expires_at=now + self.config.job_lease_s, attempt=1, cancel_requested=False)
            try:
                run = self._run(job_id, 1, plan, served, tenant)
            except BaseException:
                self.store.delete(job_id, finished_only=False)
                self.files.remove(job_id)
                raise
        return video_object(self.store.get(job_id), run)

    def _make_room(self) -> None:
        self._sweep(time.time())
        while self.store.count() >= self.config.max_video_jobs:
            oldest = self.store.oldest_finished()
            if oldest is None:
                raise APIError(429, f"{self.config.max_video_jobs} video jobs are queued or running, the most this "
                                    f"server keeps (--max-video-jobs); retry when one has finished",
                               type="rate_limit_error", code="too_many_video_jobs",
                               headers={"Retry-After": str(max(1, self.config.retry_after_s))})
            self._remove(oldest)

    def _run(self, job_id: str, attempt: int, plan: VideoPlan, served: Any, tenant: str | None) -> LocalRun:
        """Submit one attempt to the engine (raises what `submit` raises)."""
        run = LocalRun(id=job_id, attempt=attempt, plan=plan, sb=served.sb, num_steps=plan.num_steps)
        previewer = _previewer(served.sb.pipe)
        every = self.config.video_preview_every or max(1, plan.num_steps // 10)

        def on_step_end(step_pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            total = getattr(step_pipe, "_num_timesteps", None) or plan.num_steps
            due = previewer is not None and (index + 1) % every == 0 and index + 1 < total
            raw = None if previewer is None else previewer.predict(step_pipe.scheduler, index, tensors["latents"], due)
            with self._lock:
                if run.ended or run.cancel_requested:  # NOTE: the engine drops it before the next step
                    return {}
                started = run.step == 0
                run.status, run.step, run.num_steps = "in_progress", index + 1, total
                self._publish(run, progress_event(job_id, run.status, run.step, run.num_steps))
            if started:  # NOTE: stored at once, off the engine thread: a restart must know it was running
                try:
                    self._pool.submit(self._store_progress, run)
                except RuntimeError:  # shutting down
                    pass
            if raw is not None:
                try:
                    run.previews_pending.append(self._previews.submit(self._make_preview, run, previewer, raw,
                                                                      index + 1, total))
                except RuntimeError:  # shutting down: the run is being cancelled, no one waits for previews
                    pass
            return {}

        handle = served.sb.submit(priority=plan.priority, tenant=tenant, callback_on_step_end=on_step_end,
                                  callback_on_step_end_tensor_inputs=["latents"], **plan.kwargs)
        run.handle, run.request_id = handle, handle.request_id
        if self.live is not None:
            run.live_entry = self.live.start(SimpleNamespace(
                user=plan.user, tenant=tenant, kind="video",
                task="image-to-video" if "image" in plan.kwargs else "text-to-video",
                width=plan.width, height=plan.height, num_steps=plan.num_steps, request_ids=[handle.request_id]))
        with self._lock:
            self._runs[job_id] = run
        handle.add_done_callback(lambda done: self._on_done(run, done))
        return run

    def _store_progress(self, run: LocalRun) -> None:
        values = {"status": run.status, "step": run.step, "num_steps": run.num_steps}
        self.store.renew([(run.id, run.attempt, values)], self.replica, self.config.job_lease_s, time.time())

    def _resume(self, job: JobRecord) -> None:
        """Run a stored job again from step 0 with its stored request and seed (the same video)."""
        from PIL import Image

        from .video_request import VideoCreateRequest, plan_video

        attempt = self.store.claim(job, self.replica, self.config.job_lease_s, time.time())
        if attempt is None:
            return  # another replica was first
        try:
            image = None
            if job.has_reference:
                with Image.open(io.BytesIO(self.files.read(f"{job.id}/{REFERENCE_FILE}"))) as opened:
                    image = opened.convert("RGB")
            plan = plan_video(self._served, VideoCreateRequest.model_validate(job.request), image, self.config)
            self._run(job.id, attempt, plan, self._served, job.tenant)
        except Exception as exc:  # the server's settings changed since, or its input is gone: fail it, go on
            logger.exception("resuming %s failed", job.id)
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            self.store.finish(job.id, self.replica, attempt, status="failed", **self._finished_values(),
                              error=job_error("resume_failed", f"running the job again failed: {message}"))
        else:
            logger.info("%s: attempt %d on %s (was %s)", job.id, attempt, self.replica, job.status)

    # ------------------------------------------------------------------------------------ engine side
    def _on_done(self, run: LocalRun, handle: Any) -> None:
        """The engine finished (or dropped) the request: runs in the engine thread, so it only hands work off."""
        if run.lease_lost:
            self._end(run, None)
        elif handle.cancelled():
            if run.cancel_requested:
                self._fail(run, "cancelled", "the job was cancelled by DELETE /v1/videos/{id}")
            elif self._closing:  # NOTE: given back unfinished: a restart or another replica runs it again
                self.store.release(run.id, self.replica, run.attempt)
                self._end(run, None)
            else:
                self._fail(run, "cancelled", "the job was cancelled by the engine")
        elif (exc := handle.exception()) is not None:
            from .errors import engine_error
            from .generation import RequestFailed

            error = engine_error(RequestFailed(exc), self.config)
            self._fail(run, error.code or "generation_failed", error.message, error.type)
        else:
            try:
                self._pool.submit(self._write_files, run, handle.result())
            except RuntimeError:  # the pool shut down: the server is stopping; the job runs again later
                self.store.release(run.id, self.replica, run.attempt)
                self._end(run, None)

    def _write_files(self, run: LocalRun, output: Any) -> None:
        concurrent.futures.wait(run.previews_pending)  # NOTE: a job's previews reach its listeners before its end
        folder = f"{run.id}/attempt-{run.attempt}"  # NOTE: per attempt: a replica that lost the job writes aside
        target = self.files.local_path(folder) or Path(tempfile.mkdtemp(prefix="stepbatch-video-"))
        try:
            write_outputs(output, target, run.plan.fps, run.sb.pipe)
            if self.files.remote:
                self.files.put_folder(target, folder)
        except Exception as exc:  # the job fails, the server goes on
            logger.exception("writing %s failed", run.id)
            shutil.rmtree(target, ignore_errors=True)
            self.files.remove(folder)
            self._fail(run, "encoding_failed", f"writing the MP4 failed: {type(exc).__name__}: {exc}", "server_error")
            return
        if run.cancel_requested:
            self.files.remove(folder)
            self._fail(run, "cancelled", "the job was cancelled by DELETE /v1/videos/{id}")
        elif self.store.finish(run.id, self.replica, run.attempt, status="completed", step=run.num_steps,
                               output=folder, **self._finished_values()):
            self._end(run, "done")
        else:  # NOTE: another replica holds it now (this one lost its lease): its attempt is the one kept
            self.files.remove(folder)
            self._end(run, None)

    def _finished_values(self) -> dict[str, float]:
        now = time.time()
        return {"finished_at": now, "expires_at": now + self.config.video_retention_s}

    def _fail(self, run: LocalRun, code: str, message: str, kind: str = "invalid_request_error") -> None:
        held = self.store.finish(run.id, self.replica, run.attempt, status="failed", step=run.step,
                                 error=job_error(code, message, kind), **self._finished_values())
        self._end(run, "failed" if held else None)

    def _end(self, run: LocalRun, status: str | None) -> None:
        """The run is over; `status` "done" / "failed" if it ended the job (its listeners get the last event)."""
        with self._lock:
            if run.ended:
                return
            run.ended = True
            if self._runs.get(run.id) is run:
                del self._runs[run.id]
        if status is not None:
            job = self.store.get(run.id)
            kind = "video.completed" if status == "done" else "video.failed"
            if job is not None:
                self._publish(run, {"type": kind, "video": video_object(job)})
        if run.live_entry is not None:
            self.live.finish(run.live_entry, status or "released")

    def _make_preview(self, run: LocalRun, previewer: VideoPreviewer, raw: Any, step: int, total: int) -> None:
        frames = previewer.frames(raw)
        temporal = getattr(run.sb.pipe, "vae_scale_factor_temporal", None) or 1
        event = {"type": "video.preview", "video_id": run.id, "step": step, "num_steps": total,
                 "output_format": "gif", "size": f"{frames.shape[2]}x{frames.shape[1]}", "frames": len(frames),
                 "b64_json": base64.b64encode(gif_bytes(frames, run.plan.fps / temporal)).decode("ascii")}
        with self._lock:
            if not run.ended:
                run.preview = event
                self._publish(run, event)

    # ----------------------------------------------------------------------------------- heartbeat
    def _beat_loop(self) -> None:
        adopt: str | None = self.replica  # NOTE: the first beat takes back what this replica held before a restart
        last_sweep = 0.0
        while not self._closed.is_set():
            try:
                self._beat(adopt)
                adopt = None
                if time.monotonic() - last_sweep >= min(_SWEEP_EVERY_S, self.config.video_retention_s / 4):
                    self._sweep(time.time())
                    last_sweep = time.monotonic()
            except Exception:  # NOTE: a database that is briefly away must not end the heartbeat
                logger.exception("video jobs heartbeat failed")
            self._closed.wait(self.config.jobs_poll_s)

    def _beat(self, adopt: str | None) -> None:
        with self._lock:
            runs = [run for run in self._runs.values() if not run.ended]
        held = [(run.id, run.attempt, {"status": run.refreshed().status, "step": run.step,
                                       "num_steps": run.num_steps}) for run in runs]
        lost = set(self.store.renew(held, self.replica, self.config.job_lease_s, time.time()))
        cancelled = set(self.store.cancels_for(self.replica))
        for run in runs:
            if run.id in lost and not run.ended:
                logger.warning("%s: lease lost (another replica took the job); dropping attempt %d", run.id,
                               run.attempt)
                run.lease_lost = True
                run.handle.abort()
            elif run.id in cancelled:
                self._cancel_local(run.id)
        if self._closing:
            return
        for job in self.store.claimable(time.time(), adopt, self._served.name):
            with self._lock:
                if job.id in self._runs:
                    continue
            if job.cancel_requested:
                self.store.fail_unheld(job, status="failed", **self._finished_values(), error=job_error(
                    "cancelled", "the job was cancelled by DELETE /v1/videos/{id}"))
            elif job.status == "in_progress" and not self.config.resume:
                self.store.fail_unheld(job, status="failed", **self._finished_values(), error=job_error(
                    "interrupted", "the server running this job stopped before it finished, and --no-resume is "
                                   "set; create the job again", "server_error"))
            else:
                self._resume(job)

    # ----------------------------------------------------------------------------------- events
    def _publish(self, run: LocalRun, event: dict[str, Any]) -> None:
        for loop, queue in list(run.listeners):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # that listener's event loop closed
                run.listeners.remove((loop, queue))

    async def events(self, job: JobRecord) -> AsyncIterator[dict[str, Any]]:
        """The job's events from now on, starting with its state now: pushed by this replica's run, or read from
        the database every heartbeat when another replica runs it."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            run = self._runs.get(job.id)
            if run is not None and not run.ended:
                queue.put_nowait(progress_event(job.id, run.refreshed().status, run.step, run.num_steps))
                if run.preview is not None:
                    queue.put_nowait(run.preview)
                run.listeners.append((asyncio.get_running_loop(), queue))
            else:
                run = None
        if run is None:
            async for event in polled_events(self.store, job, self.config.jobs_poll_s):
                yield event
            return
        try:
            while True:
                event = await queue.get()
                yield event
                if event["type"] in TERMINAL_EVENTS:
                    return
        finally:
            with self._lock:
                run.listeners = [entry for entry in run.listeners if entry[1] is not queue]

    # ------------------------------------------------------------------------------------- queries
    def get(self, video_id: str, tenant: str | None = None) -> JobRecord:
        job = self.store.get(video_id, tenant)
        if job is None:
            raise APIError(404, f"video_id={video_id!r} does not exist (never made, deleted, or expired after "
                                f"{self.config.video_retention_s:g} s)", type="invalid_request_error",
                           param="video_id", code="video_not_found")
        return job

    def object(self, job: JobRecord) -> dict[str, Any]:
        return video_object(job, self._runs.get(job.id))

    def page(self, limit: int, after: str | None, order: str, tenant: str | None = None) -> dict[str, Any]:
        """OpenAI's cursor page of video objects, newest first with `order="desc"`."""
        try:
            jobs, more = self.store.page(tenant, limit, after, order == "desc")
        except KeyError:
            raise APIError(400, f"after={after!r} is not a video id in this list", param="after",
                           code="invalid_value") from None
        data = [self.object(job) for job in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    def delete(self, video_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Cancel a queued or running job (it ends `failed`, code "cancelled", and stays listed until it expires);
        delete a finished one and its files."""
        job = self.get(video_id, tenant)
        if not job.finished and self.store.request_cancel(job.id):
            self._cancel_local(job.id)
            # NOTE: a job another replica runs stops at the notification (PostgreSQL) or its next heartbeat
            return {"id": job.id, "object": "video.deleted", "deleted": False, "cancelled": True,
                    "status": self.object(job)["status"]}
        self._remove(self.get(video_id, tenant))
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    def content(self, job: JobRecord, name: str) -> Path | bytes:
        """A completed job's file: a local path, or its bytes from a remote store."""
        if job.status != "completed":
            raise APIError(409, f"video {job.id} is {self.object(job)['status']}; its content is there once it is "
                                f"completed", param="video_id", code="video_not_ready")
        relative = f"{job.output}/{name}"
        return self.files.local_path(relative) or self.files.read(relative)

    # ------------------------------------------------------------------------------------ retention
    def _remove(self, job: JobRecord) -> None:
        if self.store.delete(job.id):
            self.files.remove(job.id)

    def _sweep(self, now: float) -> None:
        for job in self.store.expired(now):
            self._remove(job)

    def close(self) -> None:
        """Stop: cancel what runs here and give it back unfinished (a restart or another replica runs it again),
        wait for files being written; finished jobs stay (a temporary state folder goes with the server)."""
        self._closing = True
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join(30)
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            if not run.ended:
                run.handle.abort()
        self._previews.shutdown(wait=True, cancel_futures=True)
        deadline = time.monotonic() + 30
        while any(not run.ended for run in runs) and time.monotonic() < deadline:
            time.sleep(0.02)  # NOTE: aborted runs end at the engine's next step boundary
        self._pool.shutdown(wait=True)
        for run in runs:
            if not run.ended:
                self.store.release(run.id, self.replica, run.attempt)
        if self._owns_state and self.files.remote:  # NOTE: jobs that die with the server leave no files behind
            for job in self.store.page(None, 10**9, None, False)[0]:
                self.files.remove(job.id)
        self.store.close()
        if self._owns_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def _previewer(pipe: Any) -> VideoPreviewer | None:
    projection = video_rgb_projection(pipe)
    return None if projection is None else VideoPreviewer(pipe, projection)
