"""UNets (`UNet2DConditionModel`: SD 1.x / 2.x, SDXL and their img2img, inpaint, ControlNet, adapters).

Rows: sample, text and `added_cond_kwargs` are per row; a scalar timestep (the pipelines pass one per call) is
made a per-row vector, as the model itself expands it, so calls at different timesteps share a forward.
"""

from __future__ import annotations

from diffusers import UNet2DConditionModel

from . import ModelSupport, register_model


@register_model(UNet2DConditionModel)
def _unet() -> ModelSupport:
    return ModelSupport(timestep_rows=("timestep",), trusted=True, lora_rows=True)
