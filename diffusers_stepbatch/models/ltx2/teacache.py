"""LTX-2's TeaCache forward: `LTX2VideoTransformer3DModel.forward` with a skip decision per request branch. The
signal is the first block's modulated video input (as TeaCache4LTX-Video takes it); a skipping row adds the
residuals of its video and its audio tokens from its last computed step (audio runs beside video in every block).
Calls run through the packed forward, so a request's decisions are the same alone, merged or packed.

The polynomial (degree 1) was fitted with `fit_coefficients` on the tiny test model (`LTX2_PLAIN`, guidance 3,
32x32, 9 frames, 16 steps): fit the real model's the same way before relying on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.transformers.transformer_ltx2 import AudioVisualModelOutput

from ...cache.teacache import TeaCacheState
from .packing import ltx2_packed_forward, ltx2_packing_unsupported, pack_key

LTX2_COEFFICIENTS = (3.23182117e00, 1.51528717e-02)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `LTX2VideoTransformer3DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the packed forward can't stand in for the model's (then the call runs as is)."""
    if pack_key(arguments) is None or ltx2_packing_unsupported(transformer) is not None:
        return None
    (video,), (audio,) = ltx2_packed_forward(transformer, [arguments], arguments.get("attention_kwargs"),
                                             teacache=[states])
    return (video, audio) if not arguments.get("return_dict", True) else AudioVisualModelOutput(
        sample=video, audio_sample=audio)


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for LTX-2: records the first block's modulated video input."""
    def hook(block, args, kwargs):
        hidden, temb = kwargs.get("hidden_states", args[0] if args else None), kwargs["temb"]
        table = block.scale_shift_table
        values = table[None, None] + temb.reshape(temb.shape[0], temb.shape[1], table.shape[0], -1)
        shift_msa, scale_msa = values[:, :, 0], values[:, :, 1]
        record(block.norm1(hidden) * (1 + scale_msa) + shift_msa)

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
