"""LTX-2 (`LTX2VideoTransformer3DModel`: LTX2Pipeline, image-to-video, condition and the other LTX-2 pipelines).

Rows: video and audio latents, both prompts with their masks, the timesteps and the RoPE coordinates
(`video_coords`, `audio_coords`) are per row; `num_frames`, `height`, `width`, `fps` and `audio_num_frames` are
numbers for the whole call, so plain forwards merge only when they are equal (the call's signature holds them);
`packing.py` packs rows of other frame counts, sizes, audio lengths and prompt lengths into one call (video
timesteps per row or per token, as image-to-video passes them); `teacache.py` is the per-row TeaCache forward on
top of it. Every LoRA layer sees rows on dim 0 or packed tokens, so per-request LoRA applies per row, packed too;
the one exception of a plain forward, the timestep embedders on per-token video timesteps ([rows * video tokens]),
is a token stream (`lora_token_rows`).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2VideoTransformer3DModel

from .. import ModelSupport, Packing, register_model
from .packing import ltx2_packing_unsupported, pack_calls, pack_key, token_rows
from .teacache import LTX2_COEFFICIENTS, teacache_call


def timestep_token_rows(arguments: dict[str, Any]) -> list[torch.Tensor]:
    """The model's forward flattens a per-token video timestep ([rows, video tokens]) before embedding it: each
    entry's row."""
    hidden, timestep = arguments.get("hidden_states"), arguments.get("timestep")
    if not isinstance(hidden, torch.Tensor) or not isinstance(timestep, torch.Tensor):
        return []
    rows = hidden.shape[0]
    if timestep.numel() == rows or timestep.numel() % rows:
        return []
    return [torch.arange(rows).repeat_interleave(timestep.numel() // rows)]


@register_model(LTX2VideoTransformer3DModel)
def _ltx2() -> ModelSupport:
    return ModelSupport(trusted=True, packing=Packing(unsupported=ltx2_packing_unsupported, key=pack_key,
                                                      run=pack_calls, token_rows=token_rows),
                        teacache_coefficients=LTX2_COEFFICIENTS, teacache_forward=teacache_call, lora_rows=True,
                        lora_token_rows=timestep_token_rows)
