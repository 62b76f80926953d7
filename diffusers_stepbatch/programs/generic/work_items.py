"""A model call of a pipeline's own `__call__` as a work item, and its runs: what the generic program's proxies
submit (`proxies.py`).

The item's key holds everything but the rows (`models/calls.py` describes the call through the model layer), so
calls with equal keys share one model call, and calls of other sizes with equal pack keys one packed call; each
request's result comes back cut to its rows. Models whose row rules are not proven have the first merge of each
call structure checked against separate calls (`models/merge_checks.py`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...adapters.lora import streams_ambiguous
from ...adapters.state import AdapterState, without_lora_scale
from ...cache.teacache import TeaCacheState
from ...engine.batch import Packable, WorkItem
from ...engine.split_reasons import named_key
from ...models import Packing
from ...models.calls import ModelCall, bound_call, cut, describe_call, fill, slice_rows
from ...models.denoiser_calls import run_packed, run_rows
from ...models.merge_checks import merged_parts, not_rowwise_reason
from ...models.row_kernels import solo_kernels

HOLDERS = "_holders"  # the input that carries each row's result holder through make_batch
LORA = "_lora"  # each row's LoRA state (None: no per-row LoRA)
TEACACHE = "_teacache"  # each row's TeaCache state (None: the model has no TeaCache forward)
ATTENTION_KWARGS = ("joint_attention_kwargs", "cross_attention_kwargs", "attention_kwargs")


class Holder:
    """Where a work item's real result waits for its request (outputs need not be row-wise tensors)."""

    __slots__ = ("output",)

    def __init__(self):
        self.output = None


def model_item(module: torch.nn.Module, kind: str, method: str, args: tuple, kwargs: dict,
               packed_attention: str | None = None, adapters: AdapterState | None = None,
               teacache: TeaCacheState | None = None, paired: tuple[tuple, dict] | None = None,
               paired_teacache: TeaCacheState | None = None) -> tuple[WorkItem, Holder]:
    """One model call as a work item; its key holds everything but the rows, so equal keys can merge, and calls
    of other sizes with equal pack keys can share a packed call. `paired`: another call of the request, run as
    further rows where it has the same signature (its holder is then the item's last)."""
    holder = Holder()
    call = describe_call(module, args, _lora_free(kwargs, adapters), method)
    reason = call.refusal
    if reason is None and call.rows is None:
        reason = "its inputs have no batch rows"
    if reason is None:
        reason = not_rowwise_reason(module, method, call)
    rows = call.rows or 1
    holders, states = [holder] * rows, [teacache] * rows
    if reason is None and paired is not None:
        other = describe_call(module, paired[0], _lora_free(paired[1], adapters), method)
        if other.refusal is None and other.rows and other.signature == call.signature:
            call.row_inputs = [mine + theirs if isinstance(mine, list) else torch.cat((mine, theirs))
                              for mine, theirs in zip(call.row_inputs, other.row_inputs)]
            rows += other.rows
            holders += [Holder()] * other.rows
            states += [paired_teacache] * other.rows
    if reason is not None:
        key = named_key(program=f"generic.{kind}.alone", **{f"generic program: {reason}": id(holder)})
    else:  # NOTE: one key field per argument, so stats()["splits"] names the argument that kept calls apart
        key = named_key(program=f"generic.{kind}", model=(id(module), method), lora=adapters is not None,
                        **{f"argument {name}": part for name, part in call.signature})
    inputs = {f"row{i}": value for i, value in enumerate(call.row_inputs)}
    inputs[HOLDERS] = holders
    inputs[LORA] = [adapters] * rows if adapters is not None else None
    # NOTE: a list for every call of a model with a TeaCache forward (None rows compute), so that calls with
    # and without states merge
    inputs[TEACACHE] = states if call.support.teacache_forward is not None and kind == "denoise" else None
    item = WorkItem(kind, key, inputs, functools.partial(_merged_call, module, call), rows=rows)
    if reason is None and packed_attention is not None and method == "forward":
        if adapters is None or call.support.packing.token_rows is not None:
            item.pack = _packable(module, call, packed_attention, adapters is not None)
    return item, holder


def _lora_free(kwargs: dict, adapters: AdapterState | None) -> dict:
    """The call's keyword arguments; with per-row LoRA, without the attention kwargs' LoRA `scale` (it is in the
    request's per-row adapter weights)."""
    if adapters is None:
        return kwargs
    return {name: (without_lora_scale(value) or None) if name in ATTENTION_KWARGS and isinstance(value, dict)
            else value for name, value in kwargs.items()}


def _packable(module, call: ModelCall, packed_attention: str, lora: bool) -> Packable | None:
    packing = call.support.packing
    found = packing.key(call.arguments)
    if found is None:
        return None
    key, tokens = found
    run = functools.partial(_packed_call, module, packing, packed_attention)
    return Packable(key=("generic.packed", id(module), packed_attention, lora, key), run=run, context=call,
                    tokens=tokens)


def _packed_call(module, packing: Packing, packed_attention: str, shapes) -> list:
    """One packed call for several shapes' batches; each holder gets its rows of its call's output."""
    holders = [inputs.pop(HOLDERS) for _, inputs in shapes]
    calls = [fill(call.template, _model_inputs(inputs)) for call, inputs in shapes]
    teacache = [inputs[TEACACHE] for _, inputs in shapes]

    def per_shape() -> list:
        outputs = []
        for (call, inputs), shape_holders in zip(shapes, holders):
            with solo_kernels(module, _rows_per_request(shape_holders)):
                outputs.append(_run(module, call, inputs))
        return outputs

    rows = [n for shape_holders in holders for n in _rows_per_request(shape_holders)]
    outputs = run_packed(module, packing, calls, packed_attention, teacache, per_shape,
                         lora=[row for _, inputs in shapes for row in inputs[LORA] or ()] or None,
                         around=functools.partial(solo_kernels, module, rows))
    for (call, _), shape_holders, output in zip(shapes, holders, outputs):
        _hand_out(shape_holders, output, call)
    return [torch.zeros(len(shape_holders)) for shape_holders in holders]


def _rows_per_request(holders: list[Holder]) -> list[int]:
    return [end - begin for begin, end in _bounds(holders)]


def _bounds(holders: list[Holder]) -> list[tuple[int, int]]:
    """Each request's row range in a batch (its rows are consecutive and share one holder)."""
    total = len(holders)
    bounds, start = [], 0
    for i in range(1, total + 1):
        if i == total or holders[i] is not holders[start]:
            bounds.append((start, i))
            start = i
    return bounds


def _hand_out(holders: list[Holder], output: Any, call: ModelCall) -> None:
    bounds = _bounds(holders)
    if len(bounds) == 1:
        holders[0].output = output
        return
    for begin, end in bounds:
        holders[begin].output = cut(output, begin, end, len(holders), call.support)


def _merged_call(module, call: ModelCall, **inputs):
    holders = inputs.pop(HOLDERS)
    total = len(holders)
    bounds = _bounds(holders)
    if len(bounds) == 1:  # one request: its output as the model returned it
        holders[0].output = _run(module, call, inputs)
        return torch.zeros(total)
    if _lora_streams_ambiguous(call, inputs):  # NOTE: each request's rows alone map to tokens unambiguously
        parts = [_run(module, call, slice_rows(inputs, begin, end)) for begin, end in bounds]
    else:
        run = functools.partial(_run, module, call)
        parts = merged_parts(module, call, inputs, bounds, run, inputs[TEACACHE] or ())
    for (begin, _), part in zip(bounds, parts):
        holders[begin].output = part
    return torch.zeros(total)


def _lora_streams_ambiguous(call: ModelCall, inputs: dict) -> bool:
    token_rows, lora = call.support.lora_token_rows, inputs[LORA]
    if lora is None or token_rows is None:
        return False
    return streams_ambiguous(len(lora), token_rows(fill(call.template, _model_inputs(inputs))))


def _model_inputs(inputs: dict) -> dict:
    return {name: value for name, value in inputs.items() if name not in (LORA, TEACACHE)}


def _run(module, call: ModelCall, inputs: dict) -> Any:
    """The model call on these rows, each row with its request's LoRA and TeaCache state where it has one."""
    inputs = dict(inputs)
    lora, teacache = inputs.pop(LORA), inputs.pop(TEACACHE)
    arguments = fill(call.template, inputs)
    token_rows = call.support.lora_token_rows
    streams = token_rows(arguments) if lora is not None and token_rows else None
    return run_rows(module, arguments, support=call.support, lora=lora, token_rows=streams, teacache=teacache,
                    call=bound_call(module, call, arguments))

