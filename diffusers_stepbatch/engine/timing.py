"""Forward times the cost model can trust on any device, read without stalling the device.

On a CPU a call's wall time is its cost. On CUDA the kernels run asynchronously: the wall time around a call
measures its launches, and synchronizing to measure would stall the queue the engine keeps full. There a call
is timed by two CUDA events recorded on the current stream around it, and read once the end event has
completed: `poll()` at the start of each engine step hands every finished measurement to its consumer (the
cost model), oldest first; nothing ever waits for the device.

>>> timer = CallTimer()                          # CUDA events where CUDA is available, wall time otherwise
>>> started = timer.start()
>>> output = run_batch(batch)
>>> timer.stop(started, output, lambda seconds: costs.observe(key, rows, seconds))
>>> timer.poll()                                 # later: delivers what the device has finished
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
    """Times batched calls: wall time for host outputs, deferred event time for device outputs.

    Args:
        events: a factory of device events; default `cuda_events()` (None: wall time only).
        on_device: decides from a call's output whether it ran on the asynchronous device.
    """

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
        """Measure the call that began at `started`; returns its wall time (what the host saw).

        `deliver(seconds)` gets the call's cost: at once for host outputs, from `poll()` once the device
        finished for device outputs.
        """
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
