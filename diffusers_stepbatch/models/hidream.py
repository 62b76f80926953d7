"""HiDream-I1 (`HiDreamImageTransformer2DModel`).

The Llama-3 text states come as [layers, batch, tokens, dim]: their rows lie on dim 1. Read as a shared tensor,
two requests' merged call would re-split one request's states over both (the model reshapes them with `.view`).
"""

from __future__ import annotations

from diffusers import HiDreamImageTransformer2DModel

from . import ModelSupport, register_model


@register_model(HiDreamImageTransformer2DModel)
def _hidream() -> ModelSupport:
    return ModelSupport(row_dims={"encoder_hidden_states_llama3": 1})
