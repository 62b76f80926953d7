"""Model calls of a pipeline's own `__call__` as work items: what the generic program intercepts.

On a request's view, the denoisers, text encoders and VAE are proxies: a call goes to the engine as a work item
whose key holds everything but the rows (`models/calls.py` describes the call through the model layer), and its
result comes back cut to the request's rows. Calls with equal keys share one model call. Models whose row rules
are not proven have the first merge of each call structure checked against separate calls (`models/merge_checks.py`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from diffusers import ModelMixin
from diffusers.hooks import HookRegistry, group_offloading
from diffusers.models.cache_utils import CacheMixin
from diffusers.utils import torch_utils

from ...adapters.lora import streams_ambiguous
from ...adapters.state import AdapterState, without_lora_scale
from ...cache import encoder_calls
from ...cache.prompt import PromptCache
from ...cache.teacache import TeaCacheConfig, TeaCacheState
from ...engine.batch import Packable, WorkItem
from ...engine.split_reasons import named_key
from ...models import Packing, support_for
from ...models.calls import ModelCall, bound_call, cut, describe_call, fill, slice_rows
from ...models.denoiser_calls import run_packed, run_rows
from ...models.merge_checks import log_once, merged_parts, not_rowwise_reason
from ...models.packing.support import packing_refused
from ...models.row_kernels import solo_kernels
from ...module_scan import PlannedModel, hook_registry, unhooked_device, unhooked_dtype
from .branch_pairs import BranchPairs

HOLDERS = "_holders"  # the input that carries each row's result holder through make_batch
LORA = "_lora"  # each row's LoRA state (None: no per-row LoRA)
TEACACHE = "_teacache"  # each row's TeaCache state (None: the model has no TeaCache forward)
ATTENTION_KWARGS = ("joint_attention_kwargs", "cross_attention_kwargs", "attention_kwargs")


class Holder:
    """Where a work item's real result waits for its request (outputs need not be row-wise tensors)."""

    __slots__ = ("output",)

    def __init__(self):
        self.output = None


# NOTE: diffusers functions that walk a model's modules only to find accelerate or diffusers hooks (private names:
# a diffusers without them gets every module, the same answer)
_HOOK_LOOKUPS = frozenset(function.__code__ for function in (
    getattr(torch_utils, "get_module_execution_device", None),
    getattr(group_offloading, "_get_top_level_group_offload_hook", None)) if function is not None)


def _is_diffusers_reset(method: Any) -> bool:
    return getattr(method, "__func__", None) is CacheMixin._reset_stateful_cache


class ModelProxy:
    """Stands in for a model on a request's view: the intercepted calls go to `submit`, the rest to the model.

    `methods` maps a method name ("__call__" for the model itself) to the work kind its calls become;
    `packed_attention` (None: never pack) is how packed calls of several sizes keep attention inside each row;
    `adapters` is the request's LoRA, applied to its own rows (None: the model has no LoRA layers);
    `teacache` the request's TeaCache states; `cache` a `PromptCache` that answers calls identical to earlier ones
    (text encoders).
    """

    def __init__(self, module: torch.nn.Module, methods: dict[str, str], submit: Callable[[WorkItem], None],
                 step: Callable[[], int | None] = lambda: None, packed_attention: str | None = None,
                 adapters: AdapterState | None = None, teacache: RequestTeaCache | None = None,
                 cache: PromptCache | None = None, walk: PlannedModel | None = None):
        pairs = BranchPairs() if methods.get("__call__") == "denoise" else None
        self.__dict__.update(_module=module, _methods=methods, _submit=submit, _step=step,
                             _packed_attention=packed_attention, _adapters=adapters, _teacache=teacache,
                             _cache=cache if cache is not None and cache.max_bytes else None, _walk=walk,
                             _pairs=pairs)

    def modules(self) -> Iterator[torch.nn.Module]:
        """The model's modules, from the walk made when the request was planned. diffusers' device lookups
        (`get_module_execution_device`) walk them at every call for hooks only: those get the modules that could
        carry one, the same answer without a raised `AttributeError` per module."""
        if self._walk is None:
            return self._module.modules()
        if sys._getframe(1).f_code in _HOOK_LOOKUPS:
            return iter(self._walk.hook_carriers)
        return iter(self._walk.modules)

    @property
    def dtype(self) -> torch.dtype:
        """The model's `dtype`; for a diffusers model that carried no hook at plan, without diffusers' walk of
        every module for a dtype-casting hook."""
        if self._unhooked_diffusers_model():
            return unhooked_dtype(self._module)
        return self._module.dtype

    @property
    def device(self) -> torch.device:
        """The model's `device`; for a diffusers model that carried no hook at plan, without the walk for one."""
        if self._unhooked_diffusers_model():
            return unhooked_device(self._module)
        return self._module.device

    def _unhooked_diffusers_model(self) -> bool:
        cls = type(self._module)
        diffusers_answers = (getattr(cls, "dtype", None) is ModelMixin.dtype
                             and getattr(cls, "device", None) is ModelMixin.device)
        return self._walk is not None and not self._walk.hooked and diffusers_answers

    @property
    def __class__(self) -> type:  # NOTE: so that the pipeline's isinstance checks see the model's class
        return type(self._module)

    def __getattr__(self, name: str) -> Any:
        kind = self._methods.get(name)
        if kind is None:
            found = getattr(self._module, name)
            if name == "_reset_stateful_cache" and self._walk is not None and _is_diffusers_reset(found):
                return self._reset_planned_registries
            return found
        return functools.partial(self._intercept, kind, name)

    def _reset_planned_registries(self, recurse: bool = True) -> None:
        """diffusers' `_reset_stateful_cache` (every pipeline call ends with it), over the hook registries among
        the modules the plan's walk found able to carry one; diffusers walks every module for them."""
        HookRegistry.check_if_exists_or_initialize(self._module).reset_stateful_hooks(recurse=False)
        if recurse:
            for module in self._walk.hook_carriers:
                registry = hook_registry(module) if module is not self._module else None
                if registry is not None:
                    registry.reset_stateful_hooks(recurse=False)

    def __setattr__(self, name: str, value: Any) -> None:  # as without the proxy: the shared model changes
        setattr(self._module, name, value)

    def __delattr__(self, name: str) -> None:  # NOTE: accelerate removes offload hooks by `delattr(model, "_hf_hook")`
        delattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kind = self._methods.get("__call__")
        if kind is None:
            return self._module(*args, **kwargs)
        return self._intercept(kind, "forward", *args, **kwargs)

    def _intercept(self, kind: str, method: str, *args: Any, **kwargs: Any) -> Any:
        key = None if self._cache is None else encoder_calls.call_key(
            self._module, method, args, kwargs, None if self._walk is None else self._walk.modules)
        if key is not None:
            output = encoder_calls.lookup(self._cache, key)
            if output is not None:
                return output
        output = self._submitted(kind, method, args, kwargs)
        if key is not None:
            encoder_calls.store(self._cache, key, output)
        return output

    def _submitted(self, kind: str, method: str, args: tuple, kwargs: dict) -> Any:
        step = self._step()
        pairs, predicted = self._pairs, None
        if pairs is not None:
            answered, output = pairs.answer(step, (args, kwargs))
            if answered:  # NOTE: its rows ran with the step's first call
                return output
            predicted = pairs.predict(step, (args, kwargs))
        teacache = self._teacache.state(step) if self._teacache is not None else None
        paired_state = self._teacache.state(step) if self._teacache is not None and predicted is not None else None
        item, holder = model_item(self._module, kind, method, args, kwargs, self._packed_attention, self._adapters,
                                  teacache, paired=predicted, paired_teacache=paired_state)
        if predicted is not None:
            undo = None if paired_state is None else self._teacache.giving_back(paired_state)
            if item.inputs[HOLDERS][-1] is not holder:
                pairs.expect(predicted, item.inputs[HOLDERS][-1], undo)
            else:  # NOTE: the two calls can't share rows (other shapes, say of the negative prompt): stop trying
                pairs.off = True
                if undo is not None:
                    undo()
        item.step = step
        self._submit(item)
        return holder.output

class RequestTeaCache:
    """One request's TeaCache states for one denoiser: one per call of a step (the CFG branches, in order)."""

    def __init__(self, config: TeaCacheConfig, model: torch.nn.Module, num_steps: Callable[[], int]):
        self.config, self.model, self.num_steps = config, model, num_steps
        self.states: dict[int, TeaCacheState | None] = {}
        self.step: int | None = None
        self.calls = 0

    def giving_back(self, state: TeaCacheState | None) -> Callable[[], None]:
        """An undo for the call that just took `state` (the last branch of the step): the state as it is now, and
        its branch, are given back (a predicted call that then didn't come)."""
        fields = dict(vars(state)) if state is not None else None
        step = self.step

        def undo() -> None:
            if state is not None:
                vars(state).update(fields)
            if self.step == step:
                self.calls -= 1

        return undo

    def state(self, step: int | None) -> TeaCacheState | None:
        if step != self.step:
            self.step, self.calls = step, 0
        branch, self.calls = self.calls, self.calls + 1
        if branch not in self.states:
            made = self.config.states(self.model, support_for(self.model).teacache_coefficients, self.num_steps(), 1)
            self.states[branch] = made[0] if made else None
        state = self.states[branch]
        if state is not None:
            state.step = step or 0
        return state


def packed_attention_for(module: torch.nn.Module, packed_attention: str | None) -> str | None:
    """The packed attention method for `module`'s calls, or None where its class has no packing or its state
    (attention processors, hooks) does not allow one now. NOTE: the check walks the model's modules."""
    packing = support_for(module).packing
    if packed_attention is None or packing is None or packing.key is None:
        return None
    return None if packing_refused(type(module).__name__, packing.unsupported(module)) else packed_attention


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

