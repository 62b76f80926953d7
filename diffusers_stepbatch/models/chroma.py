"""Chroma (`ChromaTransformer2DModel`): FLUX.1's layout; its position ids are read from row 0 as FLUX.1's are."""

from __future__ import annotations

from diffusers import ChromaTransformer2DModel

from . import ModelSupport, register_model


@register_model(ChromaTransformer2DModel)
def _chroma() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"))
