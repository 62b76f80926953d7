"""The runner of every program's denoiser calls, over rows or packed across sizes. The model itself is reached
only in `model_forward` and `packed_forward`, so an executor can make the same call elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..adapters.ip_adapter import per_row_ip_scales
from ..adapters.lora import streams_ambiguous
from ..adapters.state import AdapterState, lora_rows
from ..cache.teacache import TeaCacheState, kept_on_failure
from . import ModelSupport, Packing, support_for
from .packing.support import SPLIT_PACKED


def model_forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A plain or merged call of the model's own forward (or a bound method)."""
    return model(*args, **kwargs)


def packed_forward(packing: Packing, model: torch.nn.Module, calls: list[dict[str, Any]], packed_attention: str,
                   teacache: Sequence) -> list[Any]:
    """A packed call: one output per call of `calls` (their arguments by name)."""
    split = getattr(model, SPLIT_PACKED, None)  # NOTE: under context parallelism, every rank runs its share
    if split is not None:
        return split(packing, calls, packed_attention)
    return packing.run(model, calls, packed_attention, teacache)


def run_rows(model: torch.nn.Module, arguments: dict[str, Any], *, support: ModelSupport | None = None,
             lora: Sequence[AdapterState | None] | None = None, token_rows: Sequence[torch.Tensor] | None = None,
             teacache: Sequence[TeaCacheState | None] | None = None, ip_scales: Sequence | None = None,
             call: tuple[Callable[..., Any], tuple, dict[str, Any]] | None = None) -> Any:
    """The call with `arguments` (by name), through the TeaCache forward where it reproduces the call; `call`:
    (target, args, kwargs) where the forward isn't called by name. TeaCache states are put back on failure."""
    support = support if support is not None else support_for(model)
    with kept_on_failure(teacache or ()), \
            lora_rows(model, lora, token_rows=token_rows) if lora is not None else contextlib.nullcontext(), \
            per_row_ip_scales(ip_scales or ()):
        if teacache is not None and support.teacache_forward is not None and \
                any(state is not None for state in teacache):
            output = support.teacache_forward(model, teacache, arguments)
            if output is not None:
                return output
        if lora is not None and support.lora_forward is not None:
            output = support.lora_forward(model, arguments)
            if output is not None:
                return output
        if call is not None:
            target, args, kwargs = call
            return model_forward(target, *args, **kwargs)
        return model_forward(model, **arguments)


def run_packed(model: torch.nn.Module, packing: Packing, calls: list[dict[str, Any]], packed_attention: str,
               teacache: Sequence[Sequence[TeaCacheState | None] | None], per_shape: Callable[[], list],
               lora: Sequence[AdapterState | None] | None = None,
               around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[Any]:
    """Each call's output of one packed call (inside `around()`), or of `per_shape()` where per-row LoRA can't
    map its tokens to rows. `teacache[i]`: call i's row states or None, put back when the call fails; `lora`: each
    row's adapters in call order (None: no per-row LoRA)."""
    states = [state for per_call in teacache for state in per_call or () if state is not None]
    with kept_on_failure(states):
        if lora is None:
            with around():
                return packed_forward(packing, model, calls, packed_attention, teacache)
        streams = packing.token_rows(model, calls) if packing.token_rows is not None else None
        # NOTE: TeaCache's sub-calls (fewer rows), streams of coinciding lengths or of no rows can't map to rows
        if states or streams is None or streams_ambiguous(len(lora), streams):
            return per_shape()
        with lora_rows(model, lora, token_rows=streams), around():
            return packed_forward(packing, model, calls, packed_attention, teacache)
