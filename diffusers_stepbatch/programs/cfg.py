"""CFG batching policy: a guided request's two branches in one forward (faster) or two (half the activations).

>>> sb = StepBatched(pipe, cfg_policy=CFGPolicy(batched_above=12 * GiB, sequential_below=4 * GiB))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

GiB = 2**30
_MODES = ("auto", "batched", "sequential")


def free_memory(device: torch.device) -> int:
    """Free bytes on `device`: the CUDA driver's figure on GPUs, available host memory otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is optional: fall back to the free pages the OS reports
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclass
class CFGPolicy:
    """When to run CFG branches as one forward or two; outputs are equal either way, so "auto" follows free memory.

    Args:
        mode: "auto" (decide by free memory before every step), "batched" or "sequential".
        batched_above: free bytes at or above which "auto" batches both branches (default 6 GiB).
        sequential_below: free bytes below which "auto" runs two forwards (default 3 GiB); in between it batches
            when an estimate of the second branch's activations still leaves this much free.
        free_memory: callable(device) -> free bytes; defaults to `free_memory` above (tests inject their own).
    """

    mode: str = "auto"
    batched_above: int = 6 * GiB
    sequential_below: int = 3 * GiB
    free_memory: Callable[[torch.device], int] | None = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode={self.mode!r} is not a CFG policy; use one of {list(_MODES)}")
        if not 0 <= self.sequential_below <= self.batched_above:
            raise ValueError(
                f"need 0 <= sequential_below <= batched_above, got sequential_below={self.sequential_below} and "
                f"batched_above={self.batched_above} (bytes)"
            )

    def batch_branches(self, device: torch.device, branch_bytes: int) -> bool:
        """True: run both branches in one forward. `branch_bytes`: estimated activations of one branch."""
        if self.mode != "auto":
            return self.mode == "batched"
        free = (self.free_memory or free_memory)(device)
        if free >= self.batched_above:
            return True
        if free < self.sequential_below:
            return False
        return free - branch_bytes >= self.sequential_below


def transformer_activation_bytes(rows: int, tokens: int, hidden: int, heads: int, element_size: int) -> int:
    """A rough, safe-side peak of one DiT forward's activations: ~12 hidden-sized tensors plus attention scores."""
    return rows * element_size * (12 * tokens * hidden + heads * tokens * tokens)
