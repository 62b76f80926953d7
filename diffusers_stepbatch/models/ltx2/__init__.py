"""LTX-2 (`LTX2VideoTransformer3DModel`: LTX2Pipeline, image-to-video, condition and the other LTX-2 pipelines).

Rows: video and audio latents, both prompts with their masks, the timesteps and the RoPE coordinates
(`video_coords`, `audio_coords`) are per row; `num_frames`, `height`, `width`, `fps` and `audio_num_frames` are
numbers for the whole call, so plain forwards merge only when they are equal (the call's signature holds them);
`packing.py` packs rows of other frame counts, sizes, audio lengths and prompt lengths into one call (video
timesteps per row or per token, as image-to-video passes them); `teacache.py` is the per-row TeaCache forward on
top of it.
"""

from __future__ import annotations

from diffusers import LTX2VideoTransformer3DModel

from .. import ModelSupport, Packing, register_model
from .packing import ltx2_packing_unsupported, pack_calls, pack_key
from .teacache import LTX2_COEFFICIENTS, teacache_call


@register_model(LTX2VideoTransformer3DModel)
def _ltx2() -> ModelSupport:
    return ModelSupport(trusted=True, packing=Packing(unsupported=ltx2_packing_unsupported, key=pack_key,
                                                      run=pack_calls),
                        teacache_coefficients=LTX2_COEFFICIENTS, teacache_forward=teacache_call)
