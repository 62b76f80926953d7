"""StepScheduler: which requests run in the next engine step. Pure Python: it never touches a tensor.

Requests wait in arrival order until admitted; admitted requests run one work item per engine step until
they finish. Admission keeps the rows of all running requests within `max_batch_size` (a request larger
than the limit runs alone rather than never).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The plan for one engine step: requests admitted now, and every request that runs this step."""

    admitted: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)


class StepScheduler:
    """First-come-first-served admission bounded by rows.

    >>> scheduler = StepScheduler(max_batch_size=8)
    >>> scheduler.add(request); plan = scheduler.schedule()
    """

    def __init__(self, max_batch_size: int = 8):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def running_rows(self) -> int:
        return sum(request.num_rows for request in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        admitted = []
        rows = self.running_rows
        while self.waiting:
            candidate = self.waiting[0]
            fits = rows + candidate.num_rows <= self.max_batch_size
            if not fits and self.running:
                break
            self.waiting.popleft()
            candidate.status = RequestStatus.RUNNING
            self.running.append(candidate)
            admitted.append(candidate)
            rows += candidate.num_rows
            if not fits:  # an oversized request runs alone
                break
        return SchedulerOutput(admitted=admitted, running=list(self.running))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from whichever queue holds it and mark it finished."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status!r}")
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def drain(self) -> list[Request]:
        """Take every waiting and running request out (on engine shutdown)."""
        requests = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        return requests
