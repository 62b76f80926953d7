"""The step loop's deliberate device-to-host reads, in one seam, so they stay few and can be counted.

A read of a device tensor's value (`float(t)`, `t.item()`, `if t:`) waits for every kernel queued before it,
which empties the device's queue once per read. The engine and the step programs read values only here, and
only where a decision on the host needs one (a TeaCache skip); everything else stays on the device until a
finished request's output leaves it.
"""

from __future__ import annotations

import torch

reads = 0  # how many host reads went through this seam (tests compare it with what they expect)


def host_float(value: torch.Tensor) -> float:
    """`float(value)`: one host-device sync, on purpose."""
    global reads
    reads += 1
    return float(value)
