"""AnyFlow FAR (`AnyFlowFARTransformer3DModel`: frame-autoregressive video).

Its inference calls carry a KV cache per block: preallocated `[keys/values, rows, heads, tokens, dim]` tensors that a
cache-filling call writes in place and later calls read up to counts in `kv_cache_flag`. A merged call would need
those tensors joined by rows and written back per request, so calls with a cache run alone by rule (their merge
used to raise inside the attention processor).
"""

from __future__ import annotations

from typing import Any

from diffusers import AnyFlowFARTransformer3DModel

from . import ModelSupport, register_model


def _kv_cache_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("kv_cache") is not None:
        return "AnyFlow FAR's KV cache is preallocated per request and written in place"
    return None


@register_model(AnyFlowFARTransformer3DModel)
def _anyflow_far() -> ModelSupport:
    return ModelSupport(refusal=_kv_cache_refusal)
