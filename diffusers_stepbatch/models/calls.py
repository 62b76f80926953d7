"""One model call as rows: which arguments are per row, what must match to merge, how outputs split.

A call is described by binding its arguments to the model's `forward` signature, so a model's support can
name them. Per-row arguments (tensors whose dim 0 is the batch, and the support's `row_lists`) become row
inputs; everything else goes into the call's signature, and only calls with equal signatures merge.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils import BaseOutput
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from . import DEFAULT_SUPPORT, ModelSupport, RowState, support_for

logger = logging.getLogger(__name__)

_BATCH_NAMES = ("hidden_states", "sample", "x", "input_ids")
_RECORDS = (BaseOutput, ModelOutput)  # diffusers' and transformers' output dataclasses


@dataclass
class ModelCall:
    """A described call: `template` rebuilds it from `row_inputs`; equal `signature`s may share a forward."""

    support: ModelSupport
    method: str
    parameters: inspect.Signature | None
    template: dict[str, Any]
    signature: Any
    row_inputs: list[Any]
    rows: int | None
    refusal: str | None
    arguments: dict[str, Any]  # the call's arguments by name, as given

    @functools.cached_property
    def structure(self) -> Any:
        """The signature without the values of its shared tensors: what a check of row independence covers."""
        return _structure(self.signature)


_signatures: dict[tuple[type, str], inspect.Signature | None] = {}


def _method_signature(model: torch.nn.Module, method: str) -> inspect.Signature | None:
    key = (type(model), method)
    if key not in _signatures:
        try:
            _signatures[key] = inspect.signature(getattr(type(model), method))
        except (AttributeError, TypeError, ValueError):
            _signatures[key] = None
    return _signatures[key]


_keywords: dict[tuple[type, str], tuple[tuple[str, ...], frozenset, frozenset]] = {}


def _keyword_names(model: torch.nn.Module, method: str,
                   signature: inspect.Signature) -> tuple[tuple[str, ...], frozenset, frozenset]:
    """(the names a keyword may bind, in signature order; as a set; the required names) of the method."""
    key = (type(model), method)
    if key not in _keywords:
        parameters = list(signature.parameters.values())[1:]
        names = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        required = frozenset(p.name for p in parameters if p.default is p.empty
                             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        _keywords[key] = (names, frozenset(names), required)
    return _keywords[key]


def _arguments(model: torch.nn.Module, method: str, args: tuple,
               kwargs: dict) -> tuple[inspect.Signature | None, dict[str, Any]]:
    """The call's arguments by name (positional ones as `__arg<i>` where the signature can't bind them)."""
    signature = _method_signature(model, method)
    if signature is not None and not args:  # NOTE: diffusers calls its models by keyword: `bind`'s answer, cheaper
        names, known, required = _keyword_names(model, method, signature)
        if known.issuperset(kwargs) and required.issubset(kwargs):
            return signature, {name: kwargs[name] for name in names if name in kwargs}
    if signature is not None:
        try:
            bound = signature.bind(model, *args, **kwargs)
        except TypeError:
            signature = None
        else:
            named = dict(bound.arguments)
            named.pop(next(iter(signature.parameters)), None)  # self
            return signature, named
    named = {f"__arg{i}": value for i, value in enumerate(args)}
    named.update(kwargs)
    return None, named


def describe_call(model: torch.nn.Module, args: tuple, kwargs: dict, method: str = "forward") -> ModelCall:
    """`model.<method>(*args, **kwargs)` as rows and a signature (`forward`: a call of the model itself)."""
    support = support_for(model)
    signature, named = _arguments(model, method, args, kwargs)
    rows = _batch_size(named, support, signature)
    refusal = support.refusal(model, named) if support.refusal else None
    row_inputs: list[Any] = []
    template, described = {}, []
    for name, value in named.items():
        declared = _declared_rows(support, name, value, rows)
        if declared is not None:
            row_input, template[name], part = declared
            row_inputs.append(row_input)
            template[name].index = len(row_inputs) - 1
            described.append((name, part))
            continue
        template[name], part = _describe(value, None if name in support.shared else rows, row_inputs,
                                         blocks=name in support.row_blocks)
        described.append((name, part))
    if support.merge_key is not None:
        described.append(("merge key", ("value", support.merge_key(named))))
    return ModelCall(support, method, signature, template, tuple(described), row_inputs, rows, refusal, named)


def _batch_size(named: dict[str, Any], support: ModelSupport, signature: inspect.Signature | None) -> int | None:
    for name in support.row_lists:
        value = named.get(name)
        if isinstance(value, (list, tuple)) and value:
            return len(value)
    # the first argument carries the batch (the latents), as in every diffusers denoiser
    first_name = list(signature.parameters)[1] if signature is not None and len(signature.parameters) > 1 else "__arg0"
    first = named.get(first_name)
    if first is None:
        first = next((named[n] for n in _BATCH_NAMES if n in named), None)
    if isinstance(first, torch.Tensor) and first.ndim >= 1:
        return int(first.shape[0])
    return None


def _declared_rows(support: ModelSupport, name: str, value: Any, rows: int | None) -> tuple | None:
    """(row input, template marker, signature part) for an argument the model's support declares per row in a
    form of its own; None for every other argument."""
    if rows is None:
        return None
    if name in support.row_lists and isinstance(value, (list, tuple)) and len(value) == rows:
        return list(value), _Row(0, container=type(value)), ("row list",)  # NOTE: entries of any shape
    state = support.row_states.get(name)
    if state is not None and isinstance(value, state.state_type):
        key = state.key(value) if state.key is not None else None
        return ([(value, row) for row in range(rows)], _Row(0, container=functools.partial(_join_state, state)),
                ("row state", type(value).__name__, freeze(key)))
    if not isinstance(value, torch.Tensor) and not (name in support.timestep_rows and isinstance(value, (int, float))):
        return None
    if name in support.row_dims and value.ndim > support.row_dims[name] and value.shape[support.row_dims[name]] == rows:
        dim = support.row_dims[name]
        moved = value.movedim(dim, 0)
        return moved, _Row(0, dim=dim), ("rows on dim", dim, tuple(moved.shape[1:]), value.dtype, str(value.device))
    if name in support.padded and value.ndim > support.padded[name] and value.shape[0] == rows:
        dim = support.padded[name]
        part = ("padded rows", tuple(n for i, n in enumerate(value.shape) if i not in (0, dim)), value.dtype,
                str(value.device))
        return list(value.unbind(0)), _Row(0, container=functools.partial(_padded_stack, dim - 1)), part
    if name in support.timestep_rows and (not isinstance(value, torch.Tensor) or value.ndim == 0):
        # NOTE: as the model makes a tensor of a number (UNet2DConditionModel: float64 / int64), then per row
        scalar = value if isinstance(value, torch.Tensor) else torch.tensor(
            value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
        return scalar.expand(rows), _Row(0), ("timestep rows", scalar.dtype, str(scalar.device))
    return None


def _padded_stack(dim: int, rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows as one tensor, each zero-padded at the end of `dim` to the longest."""
    longest = max(row.shape[dim] for row in rows)
    padded = [row if row.shape[dim] == longest else torch.cat(
        [row, row.new_zeros(*row.shape[:dim], longest - row.shape[dim], *row.shape[dim + 1:])], dim=dim)
        for row in rows]
    return torch.stack(padded)


def _join_state(state: RowState, rows: list[tuple[Any, int]]) -> Any:
    """The state of a merged call from its rows' `(state, row)` entries, each call's rows whole and in order."""
    parts: list[tuple[Any, int]] = []
    for own, row in rows:
        if parts and parts[-1][0] is own and row == parts[-1][1]:
            parts[-1] = (own, row + 1)
        elif row == 0:
            parts.append((own, 1))
        else:
            raise ValueError(f"a merged call holds row {row} of a {type(own).__name__} without its earlier rows")
    return parts[0][0] if len(parts) == 1 else state.join(parts)


class _Row:
    __slots__ = ("index", "container", "dim", "blocks")

    def __init__(self, index: int, container: type | None = None, dim: int = 0, blocks: bool = False):
        self.index = index
        self.container = container
        self.dim = dim
        self.blocks = blocks


class Exact:
    """A tensor in a key: equal only to an identical tensor (same shape, dtype, device and values)."""

    __slots__ = ("tensor", "_hash")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._hash = hash((tuple(tensor.shape), tensor.dtype, str(tensor.device)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Exact) or other._hash != self._hash:
            return False
        mine, theirs = self.tensor, other.tensor
        return mine is theirs or (mine.shape == theirs.shape and mine.dtype == theirs.dtype
                                  and mine.device == theirs.device and torch.equal(mine, theirs))


def freeze(value: Any) -> Any:
    """A hashable stand-in for call options, for compatibility keys.

    Dicts become sorted tuples; values that are not hashable (tensors, modules) are keyed by identity, so
    only requests that pass the very same object share a batch.
    """
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    if isinstance(value, torch.Tensor):
        return ("id", id(value))
    return value


def _describe(value: Any, rows: int | None, row_inputs: list, blocks: bool = False) -> tuple[Any, Any]:
    """(template, signature): the value with row tensors replaced by `_Row` markers, and its hashable form.
    `blocks`: tensors (in a tuple too) with a whole number of entries per row along dim 0 are rows of blocks."""
    if isinstance(value, torch.Tensor):
        if rows is not None and value.ndim >= 1 and value.shape[0] == rows:
            row_inputs.append(value)
            return _Row(len(row_inputs) - 1), ("row", tuple(value.shape[1:]), value.dtype, str(value.device))
        if blocks and rows is not None and value.ndim >= 1 and value.shape[0] > rows and value.shape[0] % rows == 0:
            row_inputs.append(value.reshape(rows, value.shape[0] // rows, *value.shape[1:]))
            return _Row(len(row_inputs) - 1, blocks=True), ("row blocks", tuple(row_inputs[-1].shape[1:]),
                                                            value.dtype, str(value.device))
        return value, ("same", Exact(value))
    if isinstance(value, (tuple, list)):
        parts = [_describe(v, rows, row_inputs, blocks) for v in value]
        return type(value)(p[0] for p in parts), (type(value).__name__, tuple(p[1] for p in parts))
    if isinstance(value, dict):
        parts = {k: _describe(v, rows, row_inputs, blocks) for k, v in value.items()}
        return {k: p[0] for k, p in parts.items()}, ("dict", tuple((k, p[1]) for k, p in parts.items()))
    return value, ("value", type(value).__name__, freeze(value))


def _structure(signature: Any) -> Any:
    if isinstance(signature, Exact):
        return ("tensor", tuple(signature.tensor.shape), signature.tensor.dtype)
    if isinstance(signature, tuple):
        return tuple(_structure(part) for part in signature)
    return signature


def fill(template: Any, rows: dict[str, Any]) -> Any:
    """The template with each `_Row` marker replaced by its (batched) row input `rows[f"row{i}"]`."""
    if isinstance(template, _Row):
        value = rows[f"row{template.index}"]
        if template.container is not None:
            return template.container(value)
        if template.dim:
            return value.movedim(0, template.dim).contiguous()
        if template.blocks:
            return value.reshape(-1, *value.shape[2:])
        return value
    if isinstance(template, (tuple, list)):
        return type(template)(fill(v, rows) for v in template)
    if isinstance(template, dict):
        return {k: fill(v, rows) for k, v in template.items()}
    return template


def run_call(model: torch.nn.Module, call: ModelCall, rows: dict[str, Any]) -> Any:
    """Call the model with the described call's arguments, row inputs taken from `rows`."""
    target, args, kwargs = bound_call(model, call, fill(call.template, rows))
    return target(*args, **kwargs)


def bound_call(model: torch.nn.Module, call: ModelCall, arguments: dict[str, Any]
               ) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """(what to call, its positional arguments, its keyword arguments) for the described call's `arguments`
    (its template filled with row inputs)."""
    named = dict(arguments)
    target = model if call.method == "forward" else getattr(model, call.method)  # NOTE: forward via hooks
    if call.parameters is None:
        positional = [named.pop(f"__arg{i}") for i in range(len(named)) if f"__arg{i}" in named]
        return target, tuple(positional), named
    self_name = next(iter(call.parameters.parameters))
    bound = inspect.BoundArguments(call.parameters, {self_name: model, **named})
    return target, tuple(bound.args[1:]), bound.kwargs


class NotRowWise(ValueError):
    pass


def cut(output: Any, begin: int, end: int, total: int, support: ModelSupport = DEFAULT_SUPPORT) -> Any:
    """Rows [begin, end) of a batched output (tensors, model outputs, tuples, dicts, the model's row states)."""
    if isinstance(output, torch.Tensor):
        if output.ndim == 0 or output.shape[0] != total:
            raise NotRowWise(f"an output of shape {tuple(output.shape)} for {total} rows")
        return output[begin:end]
    if isinstance(output, _RECORDS):
        return type(output)(**{k: cut(v, begin, end, total, support) for k, v in output.items()})
    if isinstance(output, DiagonalGaussianDistribution):
        return DiagonalGaussianDistribution(cut(output.parameters, begin, end, total), output.deterministic)
    if isinstance(output, list) and support.output_lists_are_rows:
        if len(output) != total:
            raise NotRowWise(f"a list output of {len(output)} entries for {total} rows")
        return output[begin:end]
    if isinstance(output, (tuple, list)):
        return type(output)(cut(v, begin, end, total, support) for v in output)
    if isinstance(output, dict):
        return {k: cut(v, begin, end, total, support) for k, v in output.items()}
    if isinstance(output, Cache):
        return _cache_rows(output, begin, end, total)
    if output is None or isinstance(output, (bool, int, float, str)):
        return output
    for state in support.row_states.values():
        if state.cut is not None and isinstance(output, state.state_type):
            return state.cut(output, begin, end)
    raise NotRowWise(f"an output of type {type(output).__name__} can't be split by rows")


_KV = ("keys", "values")


def _cache_rows(cache: Cache, begin: int, end: int, total: int) -> Cache:
    """Rows [begin, end) of a key-value cache a text encoder returns with its states (layers of [rows, heads,
    tokens, dim] keys and values); a layer holding other per-row state is not split."""
    rows = copy.copy(cache)
    rows.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        for name, value in vars(layer).items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            if name in _KV and value.shape[0] == total:
                setattr(part, name, value[begin:end])
            elif name in _KV and value.numel() == 0:
                continue  # NOTE: a layer not filled yet
            else:
                raise NotRowWise(f"a {type(layer).__name__} holds {name} of shape {tuple(value.shape)}")
        rows.layers.append(part)
    return rows


def slice_rows(rows: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
    """The row inputs of rows [begin, end) (tensors along dim 0, lists by entry; None stays None)."""
    return {name: None if value is None else value[begin:end] for name, value in rows.items()}


def max_difference(merged: Any, alone: Any) -> float:
    """The largest relative difference between two outputs of the same structure (inf where they don't match)."""
    if isinstance(merged, torch.Tensor) and isinstance(alone, torch.Tensor):
        if merged.shape != alone.shape:
            return float("inf")
        if not merged.is_floating_point():
            return 0.0 if torch.equal(merged, alone) else float("inf")
        scale = alone.detach().abs().max().float().clamp(min=1.0)
        return float((merged.detach().float() - alone.detach().float()).abs().max() / scale) if alone.numel() else 0.0
    if isinstance(merged, DiagonalGaussianDistribution) and isinstance(alone, DiagonalGaussianDistribution):
        return max_difference(merged.parameters, alone.parameters)
    if isinstance(merged, Cache) and isinstance(alone, Cache):
        merged, alone = ([[getattr(layer, name, None) for name in _KV] for layer in cache.layers]
                         for cache in (merged, alone))
    if isinstance(merged, _RECORDS):
        merged, alone = tuple(merged.values()), tuple(alone.values())
    if isinstance(merged, dict) and isinstance(alone, dict):
        if merged.keys() != alone.keys():
            return float("inf")
        merged, alone = list(merged.values()), list(alone.values())
    if isinstance(merged, (tuple, list)) and isinstance(alone, (tuple, list)):
        if len(merged) != len(alone):
            return float("inf")
        return max((max_difference(m, a) for m, a in zip(merged, alone)), default=0.0)
    return 0.0 if merged is alone or merged == alone else float("inf")


def probe_tolerance(output: Any) -> float:
    """How far a merged call may differ from calls run apart before its rows are judged not independent:
    float32 reductions over other batch sizes differ in the last bits; half precision in the third digit."""
    tensor = _first_tensor(output)
    if tensor is not None and tensor.dtype in (torch.float16, torch.bfloat16):
        return 3e-2
    return 1e-4


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, DiagonalGaussianDistribution):
        return output.parameters
    values = output.values() if isinstance(output, (dict, BaseOutput)) else output if isinstance(
        output, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None
