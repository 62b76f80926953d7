"""A request's lifecycle: its status, its step program, its Future and what it has measured."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batch import WorkItem


class RequestStatus(enum.IntEnum):
    """Finished states sort last: `status > RequestStatus.PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_OK = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class RequestHandle(Future):
    """The Future a submitted request resolves; `abort()` cancels it between two denoising steps."""

    def __init__(self, request_id: int, wake_engine: Any = None):
        super().__init__()
        self.request_id = request_id
        self._wake_engine = wake_engine
        self.pipeline_view: Any = None  # the request's view of the pipeline (its per-call state)

    def abort(self) -> bool:
        """Cancel the request: it stops before its next step and this Future ends cancelled."""
        cancelled = self.cancel()
        if cancelled and self._wake_engine is not None:
            self._wake_engine()
        return cancelled


_request_ids = itertools.count()


def next_request_id() -> int:
    return next(_request_ids)


@dataclass
class RequestStats:
    """Timings of one request, in seconds since the epoch (`time.time`) or as durations."""

    arrival_time: float = field(default_factory=time.time)
    admitted_time: float | None = None
    finished_time: float | None = None
    step_times: list[float] = field(default_factory=list)
    batch_rows: list[int] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted_time is None else self.admitted_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(eq=False)
class Request:
    """One call of the wrapped pipeline, as the engine sees it.

    `program` is the family's step program: a generator that yields `WorkItem`s and returns the pipeline
    output. `num_rows` is the most rows it puts into one batch (images x CFG branches); `num_steps` the
    denoising steps it will run and `tokens_per_row` the image tokens of each row (for cost-aware policies);
    `deadline` an absolute `time.time()` by which it should finish, if any.
    """

    request_id: int
    program: Generator[WorkItem, Any, Any]
    handle: RequestHandle
    num_rows: int
    num_steps: int = 1
    tokens_per_row: int = 1
    priority: int = 0
    deadline: float | None = None
    tenant: str | None = None  # who asked (fair share between tenants); None: nobody in particular
    starts_in_caller: bool = False  # the program's prologue may run in the caller's thread (`start_in_caller`)
    status: RequestStatus = RequestStatus.WAITING
    pending: WorkItem | None = None
    steps_done: int = 0
    stats: RequestStats = field(default_factory=RequestStats)
    started: bool = False  # the program ran to its first work item already (`start_in_caller`)
    early_result: Any = None  # what a program that finished while starting returned

    @property
    def arrival_time(self) -> float:
        return self.stats.arrival_time

    @property
    def remaining_steps(self) -> int:
        return max(self.num_steps - self.steps_done, 0)


def start_in_caller(request: Request) -> None:
    """Run a request's program up to its first work item, in the calling thread, before it is queued.

    The prologue (the pipeline's device lookup, prompt-cache keys, latents, timesteps, checks of the inputs)
    is per-request host work: run in the caller's thread it overlaps the engine's forwards instead of
    delaying them, and whatever it raises reaches the caller directly.
    """
    import torch

    with torch.no_grad():  # NOTE: as in the engine thread, where grad mode is off
        try:
            request.pending = request.program.send(None)
        except StopIteration as stop:
            request.early_result = stop.value
    request.started = True
