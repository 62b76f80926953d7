"""Qwen-Image (`QwenImageTransformer2DModel`: Qwen-Image, Edit, Edit-Plus, img2img, inpaint, ControlNet).

Rows: latents, text (padded, with its mask) and timestep are per row; `img_shapes` is a list the model reads
for RoPE as one value for the call, so plain forwards merge only with equal shapes and text lengths;
`packing.py` packs rows of other grids (edit models' reference images included) and text lengths into one call;
`teacache.py` is the per-row TeaCache forward.
"""

from __future__ import annotations

from diffusers import QwenImageTransformer2DModel

from .. import ModelSupport, Packing, register_model
from .packing import pack_calls, pack_key, qwenimage_packing_unsupported, token_rows
from .teacache import QWENIMAGE_COEFFICIENTS, teacache_call


@register_model(QwenImageTransformer2DModel)
def _qwenimage() -> ModelSupport:
    return ModelSupport(trusted=True, packing=Packing(unsupported=qwenimage_packing_unsupported, key=pack_key,
                                                      run=pack_calls, token_rows=token_rows), lora_rows=True,
                        teacache_coefficients=QWENIMAGE_COEFFICIENTS, teacache_forward=teacache_call)
