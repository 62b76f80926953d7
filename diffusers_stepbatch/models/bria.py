"""Bria and Bria FIBO (`BriaTransformer2DModel`, `BriaFiboTransformer2DModel`): FLUX.1-like position ids, read
from row 0 when given per row, so calls merge only with equal ids."""

from __future__ import annotations

from diffusers import BriaFiboTransformer2DModel, BriaTransformer2DModel

from . import ModelSupport, register_model


@register_model(BriaTransformer2DModel)
def _bria() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"))


@register_model(BriaFiboTransformer2DModel)
def _bria_fibo() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"))
