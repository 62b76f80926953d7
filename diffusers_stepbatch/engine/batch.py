"""Work items, and how items of several requests become one batched call and split again.

Items with equal `key` share one call: rows concatenated along dim 0 (`make_batch`), the first item's `run`
called once, the output cut back per item (`split`); the key promises that `run` is interchangeable between
them. Items of other shapes with equal `pack.key` may share one packed call (`run_packed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager  # NOTE: the type of `row_kernels(rows)`
from dataclasses import dataclass, field
from typing import Any

import torch

RowInput = torch.Tensor | list | None


@dataclass
class WorkItem:
    """One model call a request needs: `run(**batched inputs)` of `kind` ("encode", "denoise", ...), batched with
    items of equal `key`. `inputs` are tensors (rows along dim 0), lists (an entry per row) or None; outputs have
    rows along dim 0. `step`: the denoising step (None outside the loop); `pack`: how it may share a call with other
    shapes; `immediate`: cheap arithmetic (the scheduler update) run in the same engine step as the call before;
    `row_kernels(rows per item)`: a context in which a merged call computes each item's rows as its solo call would
    (`models.row_kernels.row_kernels_of(model)`)."""

    kind: str
    key: Hashable
    inputs: dict[str, RowInput]
    run: Callable[..., Any]
    rows: int
    step: int | None = None
    pack: Packable | None = None
    immediate: bool = False
    row_kernels: Callable[[Sequence[int]], AbstractContextManager] | None = None


@dataclass(frozen=True)
class Packable:
    """How a work item can share one call with items of other shapes: items of equal `key` (theirs without the
    shape) run as `run([(context, batched inputs), ...])`, one entry and one output per shape; `context` is what
    differs by shape (e.g. RoPE ids), `tokens` the tokens per row."""

    key: Hashable
    run: Callable[[list[tuple[Any, dict[str, RowInput]]]], list[Any]]
    context: Any = None
    tokens: int = 0


@dataclass
class InputBatch:
    """Items merged into one call: `inputs` are the concatenated rows, `bounds[i]` item i's row range."""

    key: Hashable
    run: Callable[..., Any]
    inputs: dict[str, RowInput]
    bounds: list[tuple[int, int]] = field(default_factory=list)
    row_kernels: Callable[[Sequence[int]], AbstractContextManager] | None = None

    @property
    def num_rows(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0


def _concat(values: Sequence[RowInput]) -> RowInput:
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return first if len(values) == 1 else torch.cat(list(values), dim=0)
    merged: list = []
    for value in values:
        merged.extend(value)
    return merged


def make_batch(items: Sequence[WorkItem]) -> InputBatch:
    """Concatenate the inputs of compatible items (equal keys) row-wise into one `InputBatch`."""
    if not items:
        raise ValueError("make_batch needs at least one work item")
    bounds, start = [], 0
    for item in items:
        bounds.append((start, start + item.rows))
        start += item.rows
    names = items[0].inputs.keys()
    inputs = {name: _concat([item.inputs[name] for item in items]) for name in names}
    return InputBatch(key=items[0].key, run=items[0].run, inputs=inputs, bounds=bounds,
                      row_kernels=items[0].row_kernels)


def _solo_kernels(batches: Sequence[InputBatch]) -> AbstractContextManager:
    rows = [end - begin for batch in batches for begin, end in batch.bounds]
    row_kernels = batches[0].row_kernels
    return row_kernels(rows) if row_kernels is not None and len(rows) > 1 else contextlib.nullcontext()


def run_batch(batch: InputBatch) -> Any:
    with _solo_kernels([batch]):
        return batch.run(**batch.inputs)


def run_packed(pack: Packable, contexts: Sequence[Any], batches: Sequence[InputBatch]) -> list[Any]:
    """One packed call over several shapes' batches (their rows in order); returns one output per batch."""
    with _solo_kernels(batches):
        outputs = pack.run([(context, batch.inputs) for context, batch in zip(contexts, batches)])
    if len(outputs) != len(batches):
        raise RuntimeError(f"a packed call returned {len(outputs)} outputs for {len(batches)} shapes")
    return list(outputs)


def split(output: Any, bounds: Sequence[tuple[int, int]]) -> list[Any]:
    """Cut a batched output (tensor, or tuple/list of tensors) back into per-item row ranges."""
    if isinstance(output, torch.Tensor):
        if len(bounds) == 1 and bounds[0] == (0, output.shape[0]):
            return [output]
        return [output[start:end] for start, end in bounds]
    if isinstance(output, (tuple, list)):
        columns = [split(part, bounds) for part in output]
        return [tuple(column[i] for column in columns) for i in range(len(bounds))]
    raise TypeError(f"a work item's run must return tensors with rows along dim 0, got {type(output).__name__}")
