"""HunyuanVideo 1.5's TeaCache forward: `HunyuanVideo15Transformer3DModel.forward` with a skip decision per request
branch. As in TeaCache4HunyuanVideo, the signal is the first block's modulated video input; a skipping row adds
its video tokens' residual from its last computed step. Calls run through the packed forward and each request's
signal comes from its own rows, so its decisions are the same alone, merged or packed.

The polynomial was fitted with `fit_coefficients` on the tiny test model (`HunyuanVideo15Size(heads=4, head_dim=8,
layers=2)`, guidance 3, 32x32, 9 frames, 16 steps): fit the real model's the same way before relying on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ...adapters.lora import row_subset
from ...cache.teacache import TeaCacheState, row_groups
from .packing import hunyuan_video15_packed_forward, hunyuan_video15_packing_unsupported, pack_key, packed_blocks

HUNYUAN_VIDEO15_COEFFICIENTS = (3.5980589e03, -1.39610059e03, 1.76507514e02, -8.06517115e00, 1.7322547e-01)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `HunyuanVideo15Transformer3DModel` call (its arguments by name) with per-row TeaCache decisions, as the
    model returns it; None when the packed forward can't stand in for the model's (then the call runs as is)."""
    if pack_key(arguments) is None or hunyuan_video15_packing_unsupported(transformer) is not None:
        return None
    (output,) = hunyuan_video15_packed_forward(transformer, [arguments], arguments.get("attention_kwargs"),
                                               teacache=[states])
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def hunyuan_video15_signal(block, video: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The TeaCache signal: the first block's modulated video input ([rows, tokens, dim])."""
    shift_msa, scale_msa = block.norm1.linear(block.norm1.silu(temb)).chunk(6, dim=1)[:2]
    return block.norm1.norm(video) * (1 + scale_msa[:, None]) + shift_msa[:, None]


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for HunyuanVideo 1.5: records the signal at the first block."""
    def hook(block, args):
        record(hunyuan_video15_signal(block, args[0], args[2]))

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook)


def teacache_blocks(transformer, rows: Sequence, states: Sequence[TeaCacheState | None], method: str,
                    split: bool) -> list[torch.Tensor]:
    """`packed_blocks` with per-state decisions (`states` per row): rows that skip add their cached residual;
    states change only after the blocks ran (a failed call retried per shape stays correct)."""
    first = transformer.transformer_blocks[0]
    decisions = []
    for state, start, end in row_groups(states):
        group = range(start, end)
        signal = None
        if state is not None:
            videos = [rows[r].video for r in group]
            if all(video.shape == videos[0].shape for video in videos):
                with row_subset(transformer, [rows[r].index for r in group]):
                    signal = hunyuan_video15_signal(first, torch.stack(videos),
                                                    torch.stack([rows[r].temb for r in group]))
            else:
                signal = []
                for r in group:
                    with row_subset(transformer, [rows[r].index]):
                        signal.append(hunyuan_video15_signal(first, rows[r].video[None], rows[r].temb[None]))
                signal = torch.cat(signal)
        compute, accumulated = (True, 0.0) if state is None else state.decide(signal)
        decisions.append((state, group, signal, compute, accumulated))

    compute_rows = [r for _, group, _, compute, _ in decisions if compute for r in group]
    computed = (dict(zip(compute_rows, packed_blocks(transformer, [rows[r] for r in compute_rows], method, split)))
                if compute_rows else {})
    videos = []
    for state, group, _, compute, _ in decisions:
        if compute:
            videos.extend(computed[r] for r in group)
        else:
            cached = state.residual.split([rows[r].video.shape[0] for r in group])
            videos.extend(rows[r].video + residual for r, residual in zip(group, cached))
    for state, group, signal, compute, accumulated in decisions:
        if state is not None:
            residual = torch.cat([computed[r] - rows[r].video for r in group]) if compute else None
            state.commit(signal, compute, accumulated, residual)
    return videos
