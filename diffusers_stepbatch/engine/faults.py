"""What the engine does when a batched call goes wrong: wrong row counts and out-of-memory caps.

A batched call must return one row per input row: a buggy model or hook that returns another count would hand
requests someone else's rows. After an out-of-memory error a key is capped at half the failing rows and raised by
one row after a growing run of successes, so a size that doesn't fit fails once, not at every step.

>>> caps = RowCaps()
>>> caps.record_oom(("denoise", key), rows=8)   # now at most 4 rows per forward of that key
>>> caps.limit(("denoise", key))
4
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .costs import partition


class BatchRowMismatch(RuntimeError):
    """A batched call returned another number of rows than it was given."""


def row_counts(output: Any) -> list[int]:
    """Dim 0 of every tensor in a work item's output (a tensor, or nested tuples/lists of tensors)."""
    import torch

    if isinstance(output, torch.Tensor):
        return [int(output.shape[0]) if output.ndim else -1]
    if isinstance(output, (tuple, list)):
        return [count for part in output for count in row_counts(part)]
    return []


def check_row_count(output: Any, rows: int, kind: str) -> None:
    """Raise `BatchRowMismatch` unless every output tensor has `rows` rows along dim 0."""
    wrong = sorted({count for count in row_counts(output) if count != rows})
    if wrong:
        raise BatchRowMismatch(
            f"a batched {kind} call of {rows} rows returned {wrong[0] if wrong[0] >= 0 else 'a 0-d'} rows; every "
            "output must keep the input's rows along dim 0 (a custom model or hook changed the batch size)"
        )


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass
class _Cap:
    rows: int
    successes: int = 0
    probe_after: int = 16
    probing: bool = False  # `rows` was just raised by one and no forward of that size has succeeded yet


class RowCaps:
    """Per-key row caps learnt from out-of-memory errors, probed upward after `first_probe_after` successes (the
    wait doubles after every failed probe, up to `max_probe_after`)."""

    def __init__(self, first_probe_after: int = 16, max_probe_after: int = 4096):
        if first_probe_after < 1 or max_probe_after < first_probe_after:
            raise ValueError(f"need 1 <= first_probe_after <= max_probe_after, got {first_probe_after}, "
                             f"{max_probe_after}")
        self.first_probe_after = first_probe_after
        self.max_probe_after = max_probe_after
        self._caps: dict[Hashable, _Cap] = {}
        self.ooms = 0

    def limit(self, key: Hashable) -> int | None:
        cap = self._caps.get(key)
        return None if cap is None else cap.rows

    def record_oom(self, key: Hashable, rows: int) -> None:
        """A forward of `rows` rows ran out of memory: cap the key below it (at least one row)."""
        rows = max(1, rows)
        self.ooms += 1
        cap = self._caps.get(key)
        if cap is None:  # NOTE: halve: stepping down one row at a time would cost an OOM per step
            self._caps[key] = _Cap(rows=max(1, rows // 2), probe_after=self.first_probe_after)
            return
        if cap.probing and rows >= cap.rows:  # a failed probe: back below it, and wait twice as long next time
            cap.probe_after = min(cap.probe_after * 2, self.max_probe_after)
            cap.rows = max(1, cap.rows - 1)
        else:  # memory got tighter than when the cap was learnt
            cap.rows = max(1, min(cap.rows, rows) // 2)
        cap.probing = False
        cap.successes = 0

    def record_success(self, key: Hashable, rows: int) -> None:
        cap = self._caps.get(key)
        if cap is None or rows < cap.rows:
            return
        cap.probing = False
        cap.successes += 1
        if cap.successes >= cap.probe_after:
            cap.rows += 1
            cap.successes = 0
            cap.probing = True

    def split(self, key: Hashable, item_rows: Sequence[int]) -> list[list[int]]:
        """Consecutive items in chunks within the key's cap (an item larger than the cap runs alone)."""
        limit = self.limit(key)
        if limit is None:
            return [list(range(len(item_rows)))]
        return partition(item_rows, limit)
