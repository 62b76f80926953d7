"""Which row each entry of a LoRA layer input is, in the packed and TeaCache forwards under per-row LoRA, where each
row has its own t=0 row (`joint_call(own_zero_rows=True)`; the model's one per call would carry one request's
delta): a call's rows on dim 0 and in its timestep then t=0 rows (`embedding_layout`: the timestep embedding,
`modulation`, `norm_out.linear`), and the blocks' one stream of every call's tokens (`token_layout`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...adapters.lora import LoraLayout, lora_active
from .joint import JointCall, joint_tokens


def call_rows(calls: Sequence[dict]) -> list[torch.Tensor]:
    """Each call's rows, numbered across the calls in order."""
    counts = [call["hidden_states"].shape[0] for call in calls]
    return list(torch.arange(sum(counts)).split(counts))


def token_rows(model, calls: Sequence[dict]) -> list[torch.Tensor]:
    """`Packing.token_rows`: each token's row in the blocks' stream of the packed call (`token_layout`)."""
    return [_stream(call_rows(calls), [joint_tokens(call) for call in calls])]


def embedding_layout(model, rows: torch.Tensor) -> LoraLayout | None:
    """One call's rows `rows`, on dim 0 and in its timestep and t=0 rows; None outside a per-row LoRA forward."""
    return LoraLayout(rows, [torch.cat([rows, rows])]) if lora_active(model) else None


def token_layout(model, calls: Sequence[JointCall], rows: Sequence[torch.Tensor]) -> LoraLayout | None:
    """The blocks' stream of `calls` (of rows `rows`); None outside a per-row LoRA forward."""
    if not lora_active(model):
        return None
    return LoraLayout(torch.cat(list(rows)), [_stream(rows, [call.joint.shape[1] for call in calls])])


def _stream(rows: Sequence[torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
    return torch.cat([ids.repeat_interleave(count) for ids, count in zip(rows, tokens)])

