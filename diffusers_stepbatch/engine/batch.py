"""Work items, and how items of several requests become one batched call and split again.

A step program yields a `WorkItem` wherever a model runs. Items with equal `key` can share one call:
their per-row inputs are concatenated along dim 0 (`make_batch`), the first item's `run` is called once,
and the output is cut back into each item's rows (`split`). The key is the program's promise that `run`
and everything it closes over are interchangeable between those items.

Items whose keys differ only in shape (image size, text length) may also carry a `Packable`: items with equal
`pack.key` can then share one *packed* call, made of one `InputBatch` per shape (`run_packed`). Which shapes
pack is the program's knowledge; whether packing pays is the engine's measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

RowInput = torch.Tensor | list | None


@dataclass
class WorkItem:
    """One model call a request needs; rows are independent along dim 0 of every input and output.

    Args:
        kind: what runs, for statistics and grouping ("encode", "denoise", "decode", ...).
        key: hashable compatibility key; only items with equal keys are batched together.
        inputs: per-row inputs: tensors (rows along dim 0), lists (one entry per row) or None (same for all).
        run: called as `run(**batched_inputs)`; returns a tensor or a tuple of tensors with rows along dim 0.
        rows: the number of rows this item contributes to a batch.
        step: the denoising step this item belongs to (None for encode/decode); feeds progress and stats.
        pack: how the item may share a call with items of other shapes (None: it can't).
        immediate: cheap per-row arithmetic that completes the step of the call before it (e.g. the scheduler
            update after a forward): the engine runs such items in the same engine step, right after its calls.
    """

    kind: str
    key: Hashable
    inputs: dict[str, RowInput]
    run: Callable[..., Any]
    rows: int
    step: int | None = None
    pack: Packable | None = None
    immediate: bool = False


@dataclass(frozen=True)
class Packable:
    """How a work item can share one call with items of other shapes (a mixed-resolution packed call).

    Args:
        key: what must match for a packed call: the item's key without its shape.
        run: called as `run([(context, inputs), ...])` with one entry per shape (`inputs`: that shape's
            batched inputs, as `make_batch` builds them); returns one output per entry, rows along dim 0.
        context: what the item's own `run` closes over that differs by shape (e.g. RoPE position ids).
        tokens: tokens per row (statistics).
    """

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
    return InputBatch(key=items[0].key, run=items[0].run, inputs=inputs, bounds=bounds)


def run_batch(batch: InputBatch) -> Any:
    return batch.run(**batch.inputs)


def run_packed(pack: Packable, contexts: Sequence[Any], batches: Sequence[InputBatch]) -> list[Any]:
    """One packed call over several shapes' batches; returns one output per batch."""
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
