"""StepScheduler: which requests run in the next engine step. Pure Python: it never touches a tensor.

Admission keeps the running requests' rows within a budget (a larger request runs alone rather than never), in
the policy's order (FCFS, shortest job first: a diffusion request's length is known on arrival, or priority);
a request waiting longer than `max_wait_s` goes first, so nothing starves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .fair_share import FairShare
from .request import Request, RequestStatus

POLICIES = ("fcfs", "sjf", "priority")


class QueueFull(RuntimeError):
    """The bounded waiting queue is full; retry later or raise `max_queue`."""


class DeadlineUnmeetable(RuntimeError):
    """A request's deadline can't be met given the current load (SLO admission)."""


@dataclass
class SchedulerConfig:
    """How StepBatched admits and batches requests.

    Args:
        max_batch_size: the most rows (images x CFG branches) running at once, and so in one forward.
        policy: "fcfs" (default), "sjf" (shortest job first) or "priority" (higher `priority=` first).
        max_wait_s: a request waiting longer than this is admitted first, whatever the policy.
        max_queue: the most waiting requests; `submit` raises `QueueFull` beyond it (None: unbounded).
        on_unmeetable_deadline: an unmeetable `deadline=`: "reject" (`DeadlineUnmeetable`) or "queue" (runs anyway).
        step_time_target_s: admit only as many rows as keep a measured forward under this (None: throughput).
        cost_aware: split a group into several forwards when that was measured to be faster.
        max_pixels: the largest `height` x `width` a call may ask for, refused at submit beyond (None: no limit).
        burst_wait_s: with nothing running, wait for calls still being prepared (a burst) so they start in one
            batch: until none is left, their rows fill a batch, or none was submitted for this long. 0: no wait.
        burst_settle_s: and until none arrived for this long (at most `burst_wait_s`; 0: no settle time).
        exact: every request's model calls run as its own: its solo run's bits on any path (docs/conformance.md).
        fair_share, tenant_weights: deficit round robin over tenants (`submit(tenant=)`, weights default 1) picks
            whose request is admitted next; the policy orders requests within a tenant (`engine/fair_share.py`).
    """

    max_batch_size: int = 8
    policy: str = "fcfs"
    max_wait_s: float = 30.0
    max_queue: int | None = None
    on_unmeetable_deadline: str = "reject"
    step_time_target_s: float | None = None
    cost_aware: bool = True
    max_pixels: int | None = 8192 * 8192
    burst_wait_s: float = 0.05
    burst_settle_s: float = 0.005
    exact: bool = False
    fair_share: bool = False
    tenant_weights: dict[str, float] | None = None

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {POLICIES}")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s={self.max_wait_s} must be > 0")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1 or None")
        if self.on_unmeetable_deadline not in ("reject", "queue"):
            raise ValueError(f"on_unmeetable_deadline={self.on_unmeetable_deadline!r} must be 'reject' or 'queue'")
        if self.step_time_target_s is not None and self.step_time_target_s <= 0:
            raise ValueError(f"step_time_target_s={self.step_time_target_s} must be > 0 or None")
        for name in ("burst_wait_s", "burst_settle_s"):
            seconds = getattr(self, name)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
                raise ValueError(f"{name}={seconds!r} must be a number of seconds >= 0")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact={self.exact!r} must be True or False")
        if self.max_pixels is not None and (not isinstance(self.max_pixels, int) or self.max_pixels < 1):
            raise ValueError(f"max_pixels={self.max_pixels!r} must be a positive int (pixels) or None")


@dataclass
class SchedulerOutput:
    """The plan for one engine step: requests admitted now, rejected now, and every request that runs."""

    admitted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)


class StepScheduler:
    """Waiting and running queues with policy-ordered, row-bounded admission.

    >>> scheduler = StepScheduler(SchedulerConfig(max_batch_size=8, policy="sjf"))
    >>> scheduler.add(request); plan = scheduler.schedule(now=time.time())
    """

    def __init__(self, config: SchedulerConfig | int = SchedulerConfig()):
        self.config = SchedulerConfig(max_batch_size=config) if isinstance(config, int) else config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.row_budget = self.config.max_batch_size  # lowered by the engine under a step-time target
        self.step_seconds: float | None = None  # the engine's recent seconds per engine step, for deadlines
        self.fair_share = FairShare(self.config.tenant_weights) if self.config.fair_share else None

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size

    @property
    def running_rows(self) -> int:
        return sum(request.num_rows for request in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def job_cost(self, request: Request) -> float:
        """Remaining work: steps x per-step cost, the per-step cost taken as rows x image tokens."""
        return request.remaining_steps * request.num_rows * request.tokens_per_row

    def _order(self, now: float, waiting: Iterable[Request] | None = None) -> list[Request]:
        waiting = self.waiting if waiting is None else waiting
        aged = [r for r in waiting if now - r.arrival_time >= self.config.max_wait_s]
        rest = [r for r in waiting if now - r.arrival_time < self.config.max_wait_s]
        if self.config.policy == "sjf":
            rest.sort(key=lambda r: (self.job_cost(r), r.arrival_time))
        elif self.config.policy == "priority":
            rest.sort(key=lambda r: (-r.priority, r.arrival_time))
        return aged + rest  # both keep arrival order among equals

    def _fair_order(self, now: float) -> Iterator[Request]:
        queues: dict[str | None, list[Request]] = {}
        for request in self.waiting:
            queues.setdefault(request.tenant, []).append(request)
        queues = {tenant: self._order(now, queue) for tenant, queue in queues.items()}
        while (candidate := self.fair_share.pick(queues)) is not None:
            yield candidate
            queues[candidate.tenant].remove(candidate)

    def _misses_deadline(self, request: Request, now: float, must_wait: bool) -> bool:
        if request.deadline is None:
            return False
        if now > request.deadline:
            return True
        if self.step_seconds is None:
            return False  # nothing measured yet: no grounds to reject
        wait_steps = min((r.remaining_steps for r in self.running), default=0) if must_wait else 0
        return now + (wait_steps + request.remaining_steps) * self.step_seconds > request.deadline

    def schedule(self, now: float) -> SchedulerOutput:
        plan = SchedulerOutput()
        budget = max(1, min(self.row_budget, self.config.max_batch_size))
        rows = self.running_rows
        strict = self.config.policy == "fcfs"
        for candidate in self._order(now) if self.fair_share is None else self._fair_order(now):
            fits = rows + candidate.num_rows <= budget or not self.running
            if self.config.on_unmeetable_deadline == "reject" and self._misses_deadline(candidate, now, not fits):
                self.waiting.remove(candidate)
                plan.rejected.append((candidate, self._deadline_message(candidate, now)))
                continue
            aged = now - candidate.arrival_time >= self.config.max_wait_s
            if not fits:
                if strict or aged:
                    break  # keep arrival order: nothing overtakes the head of the line
                continue  # backfill: a smaller request further back may fit
            self.waiting.remove(candidate)
            if self.fair_share is not None:
                self.fair_share.charge(candidate)
            candidate.status = RequestStatus.RUNNING
            self.running.append(candidate)
            plan.admitted.append(candidate)
            rows += candidate.num_rows
        plan.running = list(self.running)
        return plan

    def _deadline_message(self, request: Request, now: float) -> str:
        estimate = "" if self.step_seconds is None else f", about {self.step_seconds:.3f} s per step"
        return (f"request {request.request_id} can't meet its deadline ({request.deadline - now:+.2f} s from now; "
                f"{request.remaining_steps} steps to run{estimate})")

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
