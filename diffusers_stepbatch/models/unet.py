"""UNets (`UNet2DConditionModel`: SD 1.x / 2.x, SDXL and their img2img, inpaint, ControlNet, adapters).

Rows: sample, timestep (a [B] vector, or one scalar for every row), text and `added_cond_kwargs` are per row.
"""

from __future__ import annotations

from diffusers import UNet2DConditionModel

from . import ModelSupport, register_model


@register_model(UNet2DConditionModel)
def _unet() -> ModelSupport:
    return ModelSupport(trusted=True)
