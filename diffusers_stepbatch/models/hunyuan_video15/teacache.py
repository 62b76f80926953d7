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

from ...cache.teacache import TeaCacheState
from .packing import (
    hunyuan_video15_packed_forward,
    hunyuan_video15_packing_unsupported,
    hunyuan_video15_signal,
    pack_key,
)

HUNYUAN_VIDEO15_COEFFICIENTS = (3.5980589e03, -1.39610059e03, 1.76507514e02, -8.06517115e00, 1.7322547e-01)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `HunyuanVideo15Transformer3DModel` call (its arguments by name) with per-row TeaCache decisions, as the
    model returns it; None when the packed forward can't stand in for the model's (then the call runs as is)."""
    if pack_key(arguments) is None or hunyuan_video15_packing_unsupported(transformer) is not None:
        return None
    (output,) = hunyuan_video15_packed_forward(transformer, [arguments], arguments.get("attention_kwargs"),
                                               teacache=[states])
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for HunyuanVideo 1.5: records the signal at the first block."""
    def hook(block, args):
        record(hunyuan_video15_signal(block, args[0], args[2]))

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook)
