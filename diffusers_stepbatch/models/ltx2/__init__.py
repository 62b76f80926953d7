"""LTX-2 (`LTX2VideoTransformer3DModel`: LTX2Pipeline, image-to-video, condition and the other LTX-2 pipelines).

Rows: video and audio latents, both prompts with their masks, the timesteps and the RoPE coordinates
(`video_coords`, `audio_coords`) are per row; `num_frames`, `height`, `width`, `fps` and `audio_num_frames` are
numbers for the whole call, so plain forwards merge only when they are equal (the call's signature holds them);
`packing.py` packs rows of other frame counts, sizes, audio lengths and prompt lengths into one call (video
timesteps per row or per token); `teacache.py` is the per-row TeaCache forward on top of it. LoRA layers see rows
on dim 0 or packed tokens (per-token video timesteps, flattened, too), so per-request LoRA applies per row.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2VideoTransformer3DModel

from .. import ModelSupport, Packing, register_model
from .context_parallel import ltx2_context_parallel_plan
from .packing import ltx2_packing_unsupported, pack_calls, pack_key, token_rows
from .teacache import LTX2_COEFFICIENTS, teacache_call


def timestep_token_rows(arguments: dict[str, Any]) -> list[torch.Tensor]:
    """Each entry's row in a per-token video timestep, which the model's forward flattens before embedding it."""
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
                        lora_token_rows=timestep_token_rows, context_parallel=ltx2_context_parallel_plan)
