"""Stable Diffusion 3 (`SD3Transformer2DModel`: SD3 / SD3.5, img2img, inpaint, ControlNet).

Rows: latents, text, pooled text and timestep are per row; `packing.py` packs rows of other sizes into one call.
"""

from __future__ import annotations

from diffusers import SD3Transformer2DModel

from .. import ModelSupport, register_model


@register_model(SD3Transformer2DModel)
def _sd3() -> ModelSupport:
    return ModelSupport(trusted=True, lora_rows=True)
