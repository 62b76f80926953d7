"""Ideogram 4 (`Ideogram4Transformer2DModel`, its conditional and unconditional transformers).

Every input is per row (latents, timesteps, text features, position ids `[rows, tokens, 3]`, segment ids and
indicators `[rows, tokens]`; the attention mask is built per row from the segment ids), so the default row rule
holds; trusted, merged calls skip the check against separate calls.
"""

from __future__ import annotations

from diffusers import Ideogram4Transformer2DModel

from . import ModelSupport, register_model


@register_model(Ideogram4Transformer2DModel)
def _ideogram4() -> ModelSupport:
    return ModelSupport(trusted=True)
