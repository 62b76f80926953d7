"""Qwen-Image (`QwenImageTransformer2DModel`: Qwen-Image, Edit, Edit-Plus, img2img, inpaint, ControlNet).

Rows: latents, text (padded, with its mask) and timestep are per row; `img_shapes` is a list the model reads
for RoPE as one value for the call, so plain forwards merge only with equal shapes; `packing.py` packs rows
of other sizes into one call.
"""

from __future__ import annotations

from diffusers import QwenImageTransformer2DModel

from .. import ModelSupport, register_model


@register_model(QwenImageTransformer2DModel)
def _qwenimage() -> ModelSupport:
    return ModelSupport(trusted=True)
