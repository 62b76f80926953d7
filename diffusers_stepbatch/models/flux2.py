"""FLUX.2 (`Flux2Transformer2DModel`: FLUX.2 dev, klein, klein KV).

The forward reads its RoPE positions from the first row only (`img_ids[0]`, `txt_ids[0]`), so those tensors
are not per row even when their dim 0 is the batch: calls merge only with equal positions (same image grid,
same reference images, same text length). The klein KV variant extracts a reference-image KV cache in its
first call and reads it in every later call of the same request, so those calls run alone.
"""

from __future__ import annotations

from typing import Any

from diffusers import Flux2Transformer2DModel

from . import ModelSupport, register_model


def _kv_cache_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("kv_cache_mode") is not None or arguments.get("kv_cache") is not None:
        return "FLUX.2 klein KV: the reference-image KV cache belongs to one request's calls"
    return None


@register_model(Flux2Transformer2DModel)
def _flux2() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"), refusal=_kv_cache_refusal, trusted=True)
