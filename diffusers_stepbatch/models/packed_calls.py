"""Running one packed denoiser call of several shapes, with per-row LoRA and TeaCache: the runner the generic
program and the dedicated programs share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..adapters.lora import streams_ambiguous
from ..adapters.state import AdapterState, lora_rows
from ..cache.teacache import TeaCacheState, kept_on_failure


def run_packed(model: torch.nn.Module, packed: Callable[[], list], per_shape: Callable[[], list],
               lora: Sequence[AdapterState | None] | None = None,
               token_rows: Callable[[], Sequence[torch.Tensor]] | None = None,
               teacache: Iterable[TeaCacheState | None] = ()) -> list[Any]:
    """Each shape's output of `packed()` (one call of every shape), or of `per_shape()` (a call per shape, in the
    same order) where per-row LoRA can't map the packed call's tokens to rows.

    `lora`: each row's adapters in packed order (None: no per-row LoRA); `token_rows()`: each packed token
    stream's row per token. `teacache` states are put back when the call fails (its retry decides anew).

    >>> run_packed(model, packed, per_shape, lora=rows, token_rows=lambda: streams(parts), teacache=states)
    """
    states = [state for state in teacache if state is not None]
    with kept_on_failure(states):
        if lora is None:
            return packed()
        streams = token_rows()
        # NOTE: TeaCache's packed sub-calls (fewer rows) and token streams of coinciding lengths can't be mapped
        # to rows by shape: each shape runs its own call, adapters still per row
        if states or streams_ambiguous(len(lora), streams):
            return per_shape()
        with lora_rows(model, lora, token_rows=streams):
            return packed()
