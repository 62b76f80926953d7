"""What the engine measures: every batched call (kind, rows, seconds) and every finished request."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from .request import Request, RequestStatus
from .split_reasons import SplitCounter


@dataclass(frozen=True)
class CallRecord:
    """One batched model call."""

    time: float
    kind: str
    rows: int
    seconds: float
    request_ids: tuple[int, ...] = ()  # the requests whose rows the call held


class EngineMetrics:
    """Thread-safe counters; `snapshot()` returns plain data for `StepBatched.stats()`."""

    def __init__(self, history: int = 10_000):
        self._lock = threading.Lock()
        self._history = history
        self._clear()

    def reset(self) -> None:
        """Start a new measurement window: every counter back to zero."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        history = self._history
        self.calls: deque[CallRecord] = deque(maxlen=history)
        self.rows_histogram: dict[str, Counter] = {}
        self.requests_finished: Counter = Counter()
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self.busy_seconds = 0.0
        self.overhead_seconds = 0.0  # scheduling, make_batch and split: the engine's own cost
        self.engine_steps = 0
        self.step_seconds = 0.0  # wall time of engine steps: model calls + everything the engine does around them
        self.outside_model_seconds = 0.0  # the part of the steps' wall time spent outside model calls
        self.started = time.time()
        self._recent_requests: deque[dict] = deque(maxlen=1000)
        self.packed_calls: deque[tuple[int, int, int]] = deque(maxlen=history)  # (rows, tokens, shapes)
        self.packed_total = 0
        self.splits = SplitCounter()  # why calls of one program ran apart (engine/split_reasons.py)

    def record_call(self, kind: str, rows: int, seconds: float, request_ids: tuple[int, ...] = ()) -> None:
        with self._lock:
            self.calls.append(CallRecord(time.time(), kind, rows, seconds, request_ids))
            self.rows_histogram.setdefault(kind, Counter())[rows] += 1
            self.busy_seconds += seconds

    def recent_calls(self, since: float, kind: str | None = None) -> list[CallRecord]:
        """The calls recorded at or after `since` (`time.time()`), oldest first; of one `kind` if given."""
        with self._lock:  # NOTE: a copy: the engine thread appends while callers read
            return [c for c in self.calls if c.time >= since and (kind is None or c.kind == kind)]

    def record_packed(self, rows: int, tokens: int, shapes: int) -> None:
        """A call that packed rows of `shapes` different sizes (also counted by `record_call`)."""
        with self._lock:
            self.packed_calls.append((rows, tokens, shapes))
            self.packed_total += 1

    def record_overhead(self, seconds: float) -> None:
        with self._lock:
            self.overhead_seconds += seconds

    def record_engine_step(self, seconds: float = 0.0, model_seconds: float = 0.0) -> None:
        """One engine step of `seconds` wall time, `model_seconds` of which its model calls took."""
        with self._lock:
            self.engine_steps += 1
            self.step_seconds += seconds
            self.outside_model_seconds += max(seconds - model_seconds, 0.0)

    def record_request(self, request: Request, status: RequestStatus) -> None:
        stats = request.stats
        with self._lock:
            self.requests_finished[status.name] += 1
            if self.first_arrival is None or stats.arrival_time < self.first_arrival:
                self.first_arrival = stats.arrival_time
            self.last_finish = stats.finished_time
            self._recent_requests.append(
                {
                    "request_id": request.request_id,
                    "status": status.name,
                    "queue_time": stats.queue_time,
                    "total_time": stats.total_time,
                    "steps": len(stats.step_times),
                    "step_times": list(stats.step_times),
                    "batch_rows": list(stats.batch_rows),
                }
            )

    def _throughput(self) -> float:
        """Requests finished OK per second, from the first arrival to the latest finish."""
        if self.first_arrival is None or self.last_finish is None or self.last_finish <= self.first_arrival:
            return 0.0
        return self.requests_finished["FINISHED_OK"] / (self.last_finish - self.first_arrival)

    def snapshot(self) -> dict:
        with self._lock:
            elapsed = max(time.time() - self.started, 1e-9)
            denoise = self.rows_histogram.get("denoise", Counter())
            calls = sum(denoise.values())
            denoise_calls = [(round(c.time - self.started, 4), c.rows) for c in self.calls if c.kind == "denoise"]
            return {
                "denoise_rows_over_time": denoise_calls,
                "rows_histogram": {kind: dict(sorted(h.items())) for kind, h in self.rows_histogram.items()},
                "mean_denoise_rows": (sum(r * n for r, n in denoise.items()) / calls) if calls else 0.0,
                "requests_finished": dict(self.requests_finished),
                "throughput_requests_per_s": self._throughput(),
                "busy_fraction": min(self.busy_seconds / elapsed, 1.0),
                "engine_steps": self.engine_steps,
                "overhead_ms_per_step": 1000 * self.overhead_seconds / max(self.engine_steps, 1),
                # programs' own work between forwards (scheduler steps, CFG, callbacks) plus the engine's
                "outside_model_ms_per_step": 1000 * self.outside_model_seconds / max(self.engine_steps, 1),
                "requests": list(self._recent_requests),
                "mixed": self._mixed(calls),
                "splits": self.splits.snapshot(),
            }

    def _mixed(self, denoise_calls: int) -> dict:
        """Calls that mixed sizes: how many, and their rows, tokens and sizes per call (recent history)."""
        recent = list(self.packed_calls)
        mean = (lambda i: sum(c[i] for c in recent) / len(recent)) if recent else (lambda i: 0.0)
        return {
            "calls": self.packed_total,
            "fraction_of_denoise_calls": self.packed_total / denoise_calls if denoise_calls else 0.0,
            "rows_per_call": mean(0),
            "tokens_per_call": mean(1),
            "sizes_per_call": mean(2),
        }
