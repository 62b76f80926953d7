"""ERNIE-Image (`ErnieImageTransformer2DModel`).

Rows: latents, timestep, text and its lengths. The pipeline zero-pads each batch's prompts to its longest and the
model masks every text position past a row's `text_lens` and places the image after it by that length, so rows
with prompts of other token counts share a call with their text padded further.
"""

from __future__ import annotations

from diffusers import ErnieImageTransformer2DModel

from . import ModelSupport, register_model


@register_model(ErnieImageTransformer2DModel)
def _ernie_image() -> ModelSupport:
    return ModelSupport(padded={"text_bth": 1}, trusted=True)
