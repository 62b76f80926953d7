"""AnimateDiff (`UNetMotionModel`).

The pipelines repeat each prompt's text states once per frame ([batch * frames, tokens, dim]), run a ControlNet
per frame ([batch * frames, ...] residuals) and pass one scalar timestep per call: text and residual rows are
blocks of `frames` entries, the timestep becomes a per-row vector.
"""

from __future__ import annotations

from diffusers import UNetMotionModel

from . import ModelSupport, register_model


@register_model(UNetMotionModel)
def _unet_motion() -> ModelSupport:
    return ModelSupport(row_blocks=("encoder_hidden_states", "down_block_additional_residuals",
                                    "mid_block_additional_residual"), timestep_rows=("timestep",))
