"""Wan 2.1 / 2.2 (`WanTransformer3DModel`).

Image conditioning (`encoder_hidden_states_image`) holds one CLIP embedding per video for image-to-video and two
(first and last frame) for first-last-frame-to-video, which the model folds in pairs: rows are blocks.
"""

from __future__ import annotations

from diffusers import WanTransformer3DModel

from . import ModelSupport, register_model


@register_model(WanTransformer3DModel)
def _wan() -> ModelSupport:
    return ModelSupport(row_blocks=("encoder_hidden_states_image",))
