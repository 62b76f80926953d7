"""One video job as the routes and the engine see it: `LocalRun` (an attempt in this replica's engine), the OpenAI
video object of a stored job, and its events."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .job_store import JobRecord
from .video_request import VideoPlan

VIDEO_FILE, THUMBNAIL_FILE, SPRITESHEET_FILE, REFERENCE_FILE = ("video.mp4", "thumbnail.webp", "spritesheet.jpg",
                                                                "input_reference.png")
TERMINAL_EVENTS = ("video.completed", "video.failed")
STEPS_SHARE = 95  # NOTE: progress reaches 95 % with the last step; decoding and encoding take it to 100


@dataclass(eq=False)
class LocalRun:
    """One attempt at a job, in this replica's engine: what the step callback and the events stream see."""

    id: str
    attempt: int
    plan: VideoPlan
    sb: Any
    status: str = "queued"
    step: int = 0
    num_steps: int = 0
    handle: Any = None
    request_id: int | None = None
    cancel_requested: bool = False
    lease_lost: bool = False
    ended: bool = False
    preview: dict[str, Any] | None = None  # the latest preview event
    previews_pending: list[concurrent.futures.Future] = field(default_factory=list)
    live_entry: Any = None
    listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=list)

    def refreshed(self) -> LocalRun:
        """A queued run the engine has admitted is `in_progress` before its first step ends."""
        if self.status == "queued" and any(r.request_id == self.request_id for r in self.sb.engine.scheduler.running):
            self.status = "in_progress"
        return self


def video_object(job: JobRecord, run: LocalRun | None = None) -> dict[str, Any]:
    """OpenAI's video object, with our extras (`num_frames`, `fps`, `seed`, `num_inference_steps`); a run of
    this replica gives fresher progress than its row (written every heartbeat)."""
    status, step, num_steps = job.status, job.step, job.num_steps
    if run is not None and not job.finished and not run.ended:
        run.refreshed()
        status, step, num_steps = run.status, run.step, run.num_steps or num_steps
    summary = job.summary
    progress = 100 if status == "completed" else STEPS_SHARE * step // max(num_steps, 1)
    return {"id": job.id, "object": "video", "model": job.model, "status": status, "progress": progress,
            "created_at": int(job.created_at), "completed_at": _whole(job.finished_at),
            "expires_at": _whole(job.expires_at), "prompt": summary["prompt"],
            "seconds": f"{(summary['num_frames'] - 1) / summary['fps']:g}",
            "size": f"{summary['width']}x{summary['height']}", "remixed_from_video_id": None, "error": job.error,
            "num_frames": summary["num_frames"], "fps": summary["fps"], "seed": summary["seed"],
            "num_inference_steps": num_steps}


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def progress_event(job_id: str, status: str, step: int, num_steps: int) -> dict[str, Any]:
    return {"type": "video.progress", "video_id": job_id, "status": status,
            "progress": STEPS_SHARE * step // max(num_steps, 1), "step": step, "num_steps": num_steps}


def job_error(code: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"code": code, "message": message, "type": kind, "param": None}


async def polled_events(store: Any, job: JobRecord | None, poll_s: float) -> AsyncIterator[dict[str, Any]]:
    """A job's events read from the database every `poll_s` (another replica runs it): its progress when it
    changes, then its end."""
    from starlette.concurrency import run_in_threadpool

    seen = None
    while True:
        if job is None:
            return
        if job.finished:
            kind = "video.completed" if job.status == "completed" else "video.failed"
            yield {"type": kind, "video": video_object(job)}
            return
        state = (job.status, job.step, job.num_steps)
        if state != seen:
            seen = state
            yield progress_event(job.id, *state)
        await asyncio.sleep(poll_s)
        job = await run_in_threadpool(store.get, job.id)
