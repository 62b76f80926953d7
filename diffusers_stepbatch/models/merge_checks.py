"""The first merge of each call structure, on a model whose row rules no test proves, checked against the same
calls run apart: where its rows were not independent, the separate outputs stand and such calls run alone from
then on (a record kept per model). Used by the generic program, which runs calls through `run(inputs)`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..cache.teacache import TeaCacheState, saved
from ..engine.split_reasons import split_inside
from .calls import ModelCall, NotRowWise, cut, max_difference, probe_tolerance, slice_rows
from .row_kernels import solo_kernels

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


class RowRecord:
    """What one model's merged calls have shown, per (method, call structure)."""

    __slots__ = ("not_rowwise", "methods_not_rowwise", "verified")

    def __init__(self):
        self.not_rowwise: dict[tuple, str] = {}  # why its merged calls failed: such calls run alone
        self.methods_not_rowwise: set[str] = set()  # methods with an entry there: look their calls up
        self.verified: set[tuple] = set()  # merged outputs matched separate calls


# NOTE: held by the model itself, not its address: a model made where a freed one was starts with no record
_row_records: weakref.WeakKeyDictionary[torch.nn.Module, RowRecord] = weakref.WeakKeyDictionary()
_row_records_lock = threading.Lock()


def row_record(module: torch.nn.Module) -> RowRecord:
    with _row_records_lock:
        record = _row_records.get(module)
        if record is None:
            record = _row_records[module] = RowRecord()
        return record


def log_once(model: str, reason: str) -> None:
    if (model, reason) not in _logged:
        _logged.add((model, reason))
        logger.info("StepBatched runs %s calls one at a time: %s", model, reason)


def not_rowwise_reason(module: torch.nn.Module, method: str, call: ModelCall) -> str | None:
    record = _row_records.get(module)  # NOTE: read without the lock: a model with no record has no refusal
    if record is None or method not in record.methods_not_rowwise:  # NOTE: skips building the call's structure
        return None
    return record.not_rowwise.get((method, call.structure))


def merged_parts(module: torch.nn.Module, call: ModelCall, inputs: dict, bounds: Sequence[tuple[int, int]],
                 run: Callable[[dict], Any], states: Sequence[TeaCacheState | None] = ()) -> list:
    """Each request's part (rows `bounds`) of one merged call of `inputs`; checked against the calls run apart
    the first time its structure merges. `states`: the rows' TeaCache states, put back for the separate calls."""
    seen, total = (call.method, call.structure), bounds[-1][1]
    checked = not call.support.trusted and seen not in row_record(module).verified
    before = saved(states) if checked else None
    try:
        with solo_kernels(module, [end - begin for begin, end in bounds]):
            output = run(inputs)
    except torch.OutOfMemoryError:
        raise  # NOTE: the engine caps the rows of this key and retries
    except Exception as exc:  # the merged call itself is what fails: these calls run alone from now on
        return _apart(module, seen, inputs, bounds, run, f"a merged call raised {type(exc).__name__}: {exc}")
    try:
        parts = [cut(output, begin, end, total, call.support) for begin, end in bounds]
    except NotRowWise as exc:
        return _apart(module, seen, inputs, bounds, run, f"its output is not row-wise ({exc})")
    if not checked:
        return parts
    after = saved(states)
    before()
    alone = [run(slice_rows(inputs, begin, end)) for begin, end in bounds]
    difference = max(max_difference(part, own) for part, own in zip(parts, alone))
    if difference > probe_tolerance(alone[0]):
        _mark_not_rowwise(module, seen, f"merged outputs differed from separate calls by {difference:.2e}",
                          len(bounds))
        return alone
    after()  # NOTE: the merged outputs stand, and the states as the merged call left them
    row_record(module).verified.add(seen)
    return parts


def _mark_not_rowwise(module, seen: tuple, reason: str, calls: int) -> None:
    """Calls of this structure run alone from now on; the `calls` of the running merged call ran apart."""
    record = row_record(module)
    record.not_rowwise[seen] = reason
    record.methods_not_rowwise.add(seen[0])
    log_once(type(module).__name__, reason)
    split_inside(f"generic program: {reason}", calls - 1)


def _apart(module, seen, inputs, bounds, run, reason: str) -> list:
    _mark_not_rowwise(module, seen, reason, len(bounds))
    return [run(slice_rows(inputs, begin, end)) for begin, end in bounds]
