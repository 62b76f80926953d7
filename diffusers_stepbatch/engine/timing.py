"""Forward times the cost model can trust on any device, read without stalling the device.

On a CPU a call's wall time is its cost. On CUDA the wall time only measures launches and a sync would stall the
queue, so a call is timed by two CUDA events, read once the end event completed (`poll()`, each engine step).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """What `CallTimer` needs of an event (`torch.cuda.Event(enable_timing=True)` has it)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


def cuda_events() -> Callable[[], DeviceEvent] | None:
    """A factory of timing CUDA events, or None where CUDA is not available."""
    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


def _on_device(output: Any) -> bool:
    """Whether a call's output lives on an asynchronous device (its wall time would only measure launches)."""
    if isinstance(output, torch.Tensor):
        return output.device.type == "cuda"
    if isinstance(output, (tuple, list)) and output:
        return any(_on_device(part) for part in output)
    return False


@dataclass
class Started:
    wall: float
    event: DeviceEvent | None


class CallTimer:
    """Times batched calls: wall time for host outputs, deferred event time for device outputs (`events`: a factory
    of device events, default `cuda_events()`; `on_device(output)`: whether a call ran on the device)."""

    def __init__(self, events: Callable[[], DeviceEvent] | None | str = "auto",
                 on_device: Callable[[Any], bool] = _on_device):
        self.events = cuda_events() if events == "auto" else events
        self.on_device = on_device
        self._pending: deque[tuple[DeviceEvent, DeviceEvent, Callable[[float], None]]] = deque()

    def start(self) -> Started:
        event = None
        if self.events is not None:
            event = self.events()
            event.record()
        return Started(time.perf_counter(), event)

    def device_timed(self, started: Started, output: Any) -> bool:
        """Whether the call that began at `started` and returned `output` is timed by device events."""
        return started.event is not None and self.on_device(output)

    def stop(self, started: Started, output: Any, deliver: Callable[[float], None]) -> float:
        """Measure the call that began at `started`; returns its wall time. `deliver(seconds)` gets its cost: at once
        for host outputs, from `poll()` once the device finished for device outputs."""
        wall = time.perf_counter() - started.wall
        if not self.device_timed(started, output):
            deliver(wall)
            return wall
        end = self.events()
        end.record()
        self._pending.append((started.event, end, deliver))
        return wall

    def poll(self) -> int:
        """Deliver the measurements whose end event has completed, oldest first; returns how many."""
        delivered = 0
        # NOTE: events on one stream complete in order, so the first unfinished one ends the scan.
        while self._pending and self._pending[0][1].query():
            start, end, deliver = self._pending.popleft()
            deliver(start.elapsed_time(end) / 1000)
            delivered += 1
        return delivered

    @property
    def pending(self) -> int:
        return len(self._pending)
