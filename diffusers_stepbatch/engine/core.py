"""EngineCore: the background loop that turns many step programs into shared batched calls.

One thread per engine, started at the first submit and asleep while idle. Each engine step is
schedule -> execute -> update: the scheduler picks the running requests, their pending work items are
grouped by compatibility key, each group runs as one batched call, and every request gets its rows back
and advances to its next work item. A request that finishes resolves its Future at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .batch import make_batch, run_batch, run_packed, split
from .costs import BatchCostModel, PackingCostModel
from .faults import RowCaps, check_row_count, is_out_of_memory
from .metrics import EngineMetrics
from .ownership import current_owner, set_owner
from .request import Request, RequestStatus
from .scheduler import DeadlineUnmeetable, QueueFull, SchedulerConfig, SchedulerOutput, StepScheduler
from .split_reasons import running
from .timing import CallTimer

logger = logging.getLogger(__name__)


# NOTE: a program yields at most a few immediate items in a row; any left over run in the next engine step.
_IMMEDIATE_ROUNDS = 4


class EngineClosedError(RuntimeError):
    """Raised when a request is submitted to an engine that was closed."""


@dataclass
class _StepClock:
    """One engine step's start and the engine's own share of it (scheduling, grouping)."""

    started: float
    overhead: float = 0.0


@dataclass
class _PackedCall:
    """Groups of several shapes that share one packed call."""

    pack_key: Any
    shapes: list[list[Request]]


class EngineCore:
    """Runs requests' step programs in one background thread, batching their compatible work items."""

    def __init__(self, config: SchedulerConfig, name: str = "StepBatched-engine", mixed_shapes: bool = True,
                 timer: CallTimer | None = None, on_idle: Callable[[], None] | None = None):
        self.config = config
        self.scheduler = StepScheduler(config)
        self.costs = BatchCostModel()
        self.row_caps = RowCaps()
        self.timer = timer or CallTimer()  # device-true call times for the cost models (engine/timing.py)
        self.packing = PackingCostModel(self.costs)
        self.mixed_shapes = mixed_shapes  # items of different shapes may share a packed call (`WorkItem.pack`)
        self.packing_refusal: str | None = None  # why items carry no `pack`, where a rule turned packing off
        self.metrics = EngineMetrics()
        self._name = name
        self._wakeup = threading.Condition()
        self._inbox: list[Request] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self._cancel_on_close = False
        self._step_model_seconds = 0.0
        self._idle = True
        self._preparing = 0  # calls between `preparing()` and their submit, in callers' threads
        self._last_submit = 0.0
        self._last_arrival = 0.0  # the latest submit or `preparing()` entry
        self._on_idle = on_idle  # run in the engine thread when its work runs out (`_run_idle_hook`)
        self._idle_hook_due = False  # a step ran since the hook last ran
        self._in_idle_hook = False  # callers' `preparing()` waits while it runs
        self._held_outcomes: list[Callable[[], None]] | None = None  # a step's results, given after it (`_release`)

    # ----------------------------------------------------------------------------------- caller side
    def submit(self, request: Request) -> None:
        with self._wakeup:
            if self._closing:
                raise EngineClosedError("this StepBatched engine is closed; create a new StepBatched(pipe)")
            queued = len(self._inbox) + len(self.scheduler.waiting)
            if self.config.max_queue is not None and queued >= self.config.max_queue:
                raise QueueFull(f"{queued} requests are waiting (max_queue={self.config.max_queue}); retry later")
            self._inbox.append(request)
            self._last_submit = self._last_arrival = time.perf_counter()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._wakeup.notify()

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """A caller prepares a request it will submit (validation, planning, the caller-side prologue).

        While any caller is preparing and nothing runs, the engine waits for it (`SchedulerConfig.burst_wait_s`).
        """
        with self._wakeup:
            self._wakeup.wait_for(lambda: not self._in_idle_hook)  # NOTE: it may change what a prologue reads
            self._preparing += 1
            self._last_arrival = time.perf_counter()
        try:
            yield
        finally:
            with self._wakeup:
                self._preparing -= 1
                self._wakeup.notify_all()  # NOTE: all: a `wait_idle` caller may be first in line

    def wake(self) -> None:
        with self._wakeup:
            self._wakeup.notify()

    def in_engine_thread(self) -> bool:
        """True in the engine thread and in helper threads it runs step programs in (generic program)."""
        if current_owner() is self:
            return True
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop the engine. Running and waiting requests finish first unless `cancel_pending`."""
        with self._wakeup:
            self._closing = True
            self._cancel_on_close = self._cancel_on_close or cancel_pending
            thread = self._thread
            self._wakeup.notify_all()
        if thread is not None and not self.in_engine_thread():
            thread.join(timeout)
        if thread is None:  # never started: nothing runs, but queued requests still need an outcome
            self._resolve_leftovers()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the engine has nothing to do (every step it started is over); False on timeout."""
        with self._wakeup:
            return self._wakeup.wait_for(lambda: self._thread is None or not self._thread.is_alive()
                                         or (self._idle and not self._inbox), timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------------------------- engine side
    def _loop(self) -> None:
        set_owner(self)
        try:
            self._serve()
        finally:  # whatever ended the loop, every Future gets an outcome
            self._resolve_leftovers()
            with self._wakeup:
                self._idle = True
                self._wakeup.notify_all()

    def _resolve_leftovers(self) -> None:
        with self._wakeup:
            arrived, self._inbox = self._inbox, []
        for request in arrived:
            self.scheduler.add(request)
        for request in self.scheduler.drain():
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _serve(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread; diffusers runs pipelines under no_grad
        while True:
            with self._wakeup:
                idle_hook_turn = self._sleep_until_work()
                if not idle_hook_turn:
                    self._wait_for_preparing_callers()
                    arrived, self._inbox = self._inbox, []
                    closing, cancel = self._closing, self._cancel_on_close
            if idle_hook_turn:
                self._run_idle_hook()
                continue
            for request in arrived:
                self.scheduler.add(request)
            if cancel or (closing and not self.scheduler.has_work()):
                break
            self._idle_hook_due = self._on_idle is not None
            self._held_outcomes = []
            try:
                self.step()
            except BaseException as exc:  # an engine bug must not strand anyone, nor spin: fail what it holds
                logger.exception("StepBatched engine step failed")
                for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                    if not request.status.is_finished:
                        self._finish(request, RequestStatus.FINISHED_ERROR, exc)
            self._release()
        for request in self.scheduler.drain():
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _release(self) -> None:
        """Give the step's finished requests their outcomes. When the step ended the engine's work, the idle hook
        runs first, so that a caller finds the pipeline as a plain call leaves it (offload hooks back, models on the
        CPU)."""
        held, self._held_outcomes = self._held_outcomes, None
        if not held:
            return
        with self._wakeup:
            work_ran_out = (not self._inbox and not self.scheduler.has_work() and not self._closing
                            and self._take_idle_hook_turn())
        if work_ran_out:
            self._run_idle_hook()
        for give in held:
            give()

    def _sleep_until_work(self) -> bool:
        """Sleep (under `self._wakeup`) until there is work or the engine closes. True instead when the idle
        hook's turn comes first: the work ran out since it last ran and no caller is preparing a request."""
        while not self._inbox and not self.scheduler.has_work() and not self._closing:
            if self._take_idle_hook_turn():
                return True
            self._idle = True
            self._wakeup.notify_all()  # `wait_idle` callers
            self._wakeup.wait()
        self._idle = False
        return False

    def _take_idle_hook_turn(self) -> bool:
        """(Under `self._wakeup`.) Whether the idle hook is due (a step ran since it last ran) and no caller is
        preparing a request; if so the turn is taken: callers' `preparing()` waits until it has run."""
        if not self._idle_hook_due or self._preparing:
            return False
        self._idle_hook_due = False
        self._in_idle_hook = True
        return True

    def _run_idle_hook(self) -> None:
        """Run `on_idle` (the wrapper: the pipeline's `maybe_free_model_hooks`, as after a plain call); callers
        that start preparing meanwhile wait for it, `wait_idle` returns after it."""
        try:
            self._on_idle()
        except Exception:  # NOTE: requests already have their results; the engine goes on
            logger.exception("StepBatched engine's idle hook failed")
        finally:
            with self._wakeup:
                self._in_idle_hook = False
                self._wakeup.notify_all()

    def _wait_for_preparing_callers(self) -> None:
        """With nothing running, wait for callers still preparing requests: until none is left and none arrived
        for `burst_settle_s`, their rows fill a batch, or none was submitted for `burst_wait_s`. Held under
        `self._wakeup`.

        NOTE: the callers' prologues are Python under the GIL; a model call started among them waits for the GIL at
        every torch op, and its requests would run a step ahead of the rest. The settle time covers callers that
        have not reached `preparing()` yet: another thread's prologue holds the GIL for up to a switch interval.
        """
        wait = self.config.burst_wait_s
        if self.scheduler.running or not wait:
            return
        batch_rows = min(self.scheduler.row_budget, self.config.max_batch_size)  # what the next step may admit
        while not self._closing and self._waiting_rows() < batch_rows:
            deadline = self._last_submit + wait
            if not self._preparing:
                deadline = min(deadline, self._last_arrival + self.config.burst_settle_s)
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.wait(remaining)

    def _waiting_rows(self) -> int:
        return sum(request.num_rows for request in (*self._inbox, *self.scheduler.waiting))

    def step(self) -> None:
        """One engine step: schedule (drop aborted requests, admit), execute each group of work items once, then
        update the step-time estimates admission reads."""
        with self._timed_step() as clock:
            plan = self._schedule(clock)
            groups, calls = self._batch(plan.running, clock)
            for call in calls:
                if isinstance(call, _PackedCall):
                    self._execute_packed(call)
                else:
                    self._execute(call)
            self._run_immediate(plan.running)
            self._update(groups, clock)

    @contextmanager
    def _timed_step(self) -> Iterator[_StepClock]:
        """The step's clock; after it, its time, its model calls' time and the engine's own share to the metrics."""
        self.timer.poll()  # device times of earlier calls that have finished since: to the cost models
        clock = _StepClock(time.perf_counter())
        self._step_model_seconds = 0.0  # what this step's model calls take (`_record_call`)
        yield clock
        self.metrics.record_overhead(clock.overhead)
        self.metrics.record_engine_step(time.perf_counter() - clock.started, self._step_model_seconds)

    def _schedule(self, clock: _StepClock) -> SchedulerOutput:
        """Finish aborted and rejected requests, admit others and start their programs; the scheduler's plan."""
        for request in list(self.scheduler.waiting) + list(self.scheduler.running):
            if request.handle.cancelled():
                self._finish(request, RequestStatus.FINISHED_ABORTED)
        started, now = time.perf_counter(), time.time()
        plan = self.scheduler.schedule(now)
        clock.overhead += time.perf_counter() - started
        for request, reason in plan.rejected:
            self._finish(request, RequestStatus.FINISHED_ERROR, DeadlineUnmeetable(reason))
        for request in plan.admitted:
            request.stats.admitted_time = now
            if not request.started:
                self._advance(request, None)
            elif request.pending is None:  # it finished while starting in its caller's thread
                self._finish(request, RequestStatus.FINISHED_OK, request.early_result)
        return plan

    def _batch(self, running: list[Request], clock: _StepClock) -> tuple[dict[Any, list[Request]], list]:
        """Running requests' pending work items by (kind, key), and the calls they run as."""
        started = time.perf_counter()
        groups: dict[Any, list[Request]] = defaultdict(list)
        for request in running:
            if request.pending is not None and not request.status.is_finished:
                groups[(request.pending.kind, request.pending.key)].append(request)
        calls = self._plan_calls(groups)
        self.metrics.splits.observe(calls)  # stats()["splits"]: why calls of one program ran apart
        clock.overhead += time.perf_counter() - started
        return groups, calls

    def _update(self, groups: dict[Any, list[Request]], clock: _StepClock) -> None:
        """The step-time estimates, from this step's largest denoising group."""
        denoise_groups = [group_key for group_key in groups if group_key[0] == "denoise"]
        if denoise_groups:
            largest = max(denoise_groups, key=lambda group_key: sum(r.num_rows for r in groups[group_key]))
            self._update_step_estimates(time.perf_counter() - clock.started, largest)

    def _plan_calls(self, groups: dict[Any, list[Request]]) -> list[list[Request] | _PackedCall]:
        """Per group one call (or the cost model's split); groups of several shapes that can pack may share one."""
        if self.config.exact:
            return [[request] for members in groups.values() for request in members]
        calls: list[list[Request] | _PackedCall] = []
        packable: dict[Any, list[Any]] = defaultdict(list)
        refused_shapes = 0
        for group_key, members in groups.items():
            pack = members[0].pending.pack
            if self.mixed_shapes and pack is not None:
                packable[(group_key[0], pack.key)].append(group_key)
            else:
                calls.extend(self._chunk(group_key, members))
                if pack is None and self.packing_refusal is not None and group_key[0] == "denoise":
                    refused_shapes += 1
        if refused_shapes > 1:  # NOTE: the model layer refuses such packs itself (hooks on the model); say why here
            self.metrics.splits.add(f"denoise: {self.packing_refusal}", refused_shapes - 1)
        for pack_key, group_keys in packable.items():
            item_rows = [[r.pending.rows for r in groups[group_key]] for group_key in group_keys]
            parts = [(group_key, sum(rows)) for group_key, rows in zip(group_keys, item_rows)]
            if len(group_keys) > 1 and (not self.config.cost_aware
                                        or self.packing.should_pack(pack_key, parts, item_rows)):
                calls.append(_PackedCall(pack_key, [groups[group_key] for group_key in group_keys]))
            else:
                calls.extend(chunk for group_key in group_keys for chunk in self._chunk(group_key, groups[group_key]))
        return calls

    def _run_immediate(self, requests: list[Request]) -> None:
        """Items marked `immediate` (e.g. every request's scheduler update after the forwards) run in this
        engine step: one call per compatibility key, never split."""
        for _ in range(_IMMEDIATE_ROUNDS):
            groups: dict[Any, list[Request]] = defaultdict(list)
            for request in requests:
                item = request.pending
                if item is not None and item.immediate and not request.status.is_finished:
                    groups[(item.kind, item.key)].append(request)
            if not groups:
                return
            for members in groups.values():
                for call in ([[request] for request in members] if self.config.exact else [members]):
                    self._execute(call)

    def _chunk(self, group_key: Any, members: list[Request]) -> list[list[Request]]:
        """One forward for the group, or several when the cost model measured that to be faster."""
        if len(members) == 1:
            return [members]
        chunks = [members]
        if self.config.cost_aware:
            indices = self.costs.chunk(group_key, [request.pending.rows for request in members])
            chunks = [[members[i] for i in chunk] for chunk in indices]
        # NOTE: after an out-of-memory error, forwards of this key stay below the row count that failed.
        return [[chunk[i] for i in part] for chunk in chunks
                for part in self.row_caps.split(group_key, [request.pending.rows for request in chunk])]

    def _update_step_estimates(self, seconds: float, group_key: Any) -> None:
        previous = self.scheduler.step_seconds
        self.scheduler.step_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        target = self.config.step_time_target_s
        if target is not None:
            self.scheduler.row_budget = self.costs.rows_within(group_key, target, self.config.max_batch_size)

    def _execute(self, members: list[Request]) -> None:
        assembling = time.perf_counter()
        batch = make_batch([request.pending for request in members])
        kind = members[0].pending.kind
        timing = self.timer.start()
        started = timing.wall
        self.metrics.record_overhead(started - assembling)
        try:
            with running(self.metrics.splits, kind):
                output = run_batch(batch)
            check_row_count(output, batch.num_rows, kind)
        except BaseException as exc:  # a BaseException from a model or hook fails its request, not the engine
            if is_out_of_memory(exc):
                self.row_caps.record_oom((kind, batch.key), batch.num_rows)
            if len(members) == 1:
                self._finish(members[0], RequestStatus.FINISHED_ERROR, exc)
                return
            # NOTE: retry alone so that only the request(s) whose rows raise are failed.
            logger.warning("a batched %s of %d requests failed (%s); retrying each alone", kind, len(members), exc)
            for request in members:
                self._execute([request])
            return
        self.row_caps.record_success((kind, batch.key), batch.num_rows)
        # NOTE: a call timed on the device (CUDA) paid one-time costs at each new row count (`BatchCostModel`)
        observe = functools.partial(self.costs.observe, (kind, batch.key), batch.num_rows,
                                    new_size_warms_up=self.timer.device_timed(timing, output))
        elapsed = self.timer.stop(timing, output, observe)
        self._record_call(kind, batch.num_rows, elapsed, members, members[0].pending.immediate)
        self._deliver(members, batch, output, elapsed)
        self.metrics.record_overhead(time.perf_counter() - started - elapsed)

    def _execute_packed(self, call: _PackedCall) -> None:
        """One packed call for groups of several shapes; if it fails, each shape runs as its own call."""
        assembling = time.perf_counter()
        shapes = call.shapes
        batches = [make_batch([request.pending for request in members]) for members in shapes]
        first = shapes[0][0].pending
        contexts = [members[0].pending.pack.context for members in shapes]
        parts = [((first.kind, batch.key), batch.num_rows) for batch in batches]
        timing = self.timer.start()
        started = timing.wall
        self.metrics.record_overhead(started - assembling)
        try:
            outputs = run_packed(first.pack, contexts, batches)
            for batch, output in zip(batches, outputs):
                check_row_count(output, batch.num_rows, first.kind)
        except BaseException as exc:  # as in _execute: a model's BaseException must not end the engine
            # NOTE: per-shape calls then isolate the failing request (and each is retried alone if it fails).
            logger.warning("a packed %s of %d shapes failed (%s); running each shape on its own", first.kind,
                           len(shapes), exc)
            for members in shapes:
                self._execute(members)
            return
        elapsed = self.timer.stop(timing, outputs, functools.partial(self.packing.observe, call.pack_key, parts))
        rows = sum(batch.num_rows for batch in batches)
        tokens = sum(request.pending.rows * request.pending.pack.tokens for members in shapes for request in members)
        self._record_call(first.kind, rows, elapsed, [request for members in shapes for request in members])
        self.metrics.record_packed(rows, tokens, len(shapes))
        for members, batch, output in zip(shapes, batches, outputs):
            self._deliver(members, batch, output, elapsed, call_rows=rows)
        self.metrics.record_overhead(time.perf_counter() - started - elapsed)

    def _record_call(self, kind: str, rows: int, seconds: float, members: list[Request],
                     immediate: bool = False) -> None:
        if not immediate:  # NOTE: immediate items are the engine's arithmetic between model calls
            self._step_model_seconds += seconds
        self.metrics.record_call(kind, rows, seconds, tuple(request.request_id for request in members))

    def _deliver(self, members: list[Request], batch: Any, output: Any, elapsed: float,
                 call_rows: int | None = None) -> None:
        """Cut a call's output into each request's rows and advance each request's program."""
        parts = split(output, batch.bounds)
        for request, rows in zip(members, parts):
            item, request.pending = request.pending, None
            if item.step is not None:
                request.steps_done = item.step + 1
                request.stats.step_times.append(elapsed)
                request.stats.batch_rows.append(call_rows or batch.num_rows)
            self._advance(request, rows)

    def _advance(self, request: Request, value: Any) -> None:
        """Send `value` into the request's program and keep the next work item it yields."""
        try:
            request.pending = request.program.send(value)
        except StopIteration as stop:
            self._finish(request, RequestStatus.FINISHED_OK, stop.value)
        except BaseException as exc:  # KeyboardInterrupt/SystemExit from a callback: that request's outcome
            self._finish(request, RequestStatus.FINISHED_ERROR, exc)

    def _finish(self, request: Request, status: RequestStatus, value: Any = None) -> None:
        self.scheduler.finish(request, status)
        request.pending = None
        request.stats.finished_time = time.time()
        try:
            request.program.close()
        except BaseException:  # the program's own cleanup failed; the outcome below still stands
            logger.exception("closing the step program of request %d failed", request.request_id)
        handle = request.handle
        if status == RequestStatus.FINISHED_ABORTED:
            notify_cancelled(handle)
            self.metrics.record_request(request, status)
            return
        if not handle.set_running_or_notify_cancel():  # aborted by the caller while it finished
            request.status = RequestStatus.FINISHED_ABORTED
            self.metrics.record_request(request, request.status)
            return
        give = functools.partial(handle.set_result if status == RequestStatus.FINISHED_OK else handle.set_exception,
                                 value)
        self.metrics.record_request(request, status)
        if self._held_outcomes is not None and self.in_engine_thread():
            self._held_outcomes.append(give)
        else:
            give()



def notify_cancelled(handle: Any) -> None:
    """Cancel a Future and tell its waiters (`concurrent.futures.wait`, `as_completed`): `cancel()` alone leaves
    it CANCELLED, which waiters never see; `set_running_or_notify_cancel()` moves it to CANCELLED_AND_NOTIFIED."""
    if handle.done() and not handle.cancelled():
        return
    handle.cancel()
    if handle._state == "CANCELLED":  # NOTE: not yet notified (a second call would raise RuntimeError)
        handle.set_running_or_notify_cancel()
