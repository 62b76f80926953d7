"""Kandinsky 6 (`Kandinsky6Transformer3DModel`).

Its rows are latents, text embeddings, masks, timesteps and token types on dim 0; `visual_rope_pos` is one tuple of
(frame, row, column) position ranges for the whole call (image-to-video passes it: the reference frame reuses frame
position 0). A range as long as the call's rows (a 1x1 patch grid: one entry, one row) is not per row: calls share
it, and merge only where their ranges are equal.
"""

from __future__ import annotations

from diffusers import Kandinsky6Transformer3DModel

from . import ModelSupport, register_model


@register_model(Kandinsky6Transformer3DModel)
def _kandinsky6() -> ModelSupport:
    return ModelSupport(shared=("visual_rope_pos",), trusted=True)
