"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`).

Its forward lays out one joint text/image sequence for the whole call from row 0: `img_mask[0]` (where the
vision-language encoder's image slots sit) and `img_shapes[0]`. Rows share a call only where their masks are equal
(prompts of one token count, condition images of one layout). A request's KV cache of its text and
condition-image tokens (filled at its first step, read after) belongs to that request's calls: those run alone.
"""

from __future__ import annotations

from diffusers import QwenImage21Transformer2DModel

from . import ModelSupport, kv_cache_refusal, register_model


@register_model(QwenImage21Transformer2DModel)
def _qwenimage21() -> ModelSupport:
    return ModelSupport(shared=("img_mask",), refusal=kv_cache_refusal(
        "Qwen-Image 2.1: the KV cache of the text and condition-image tokens belongs to one request's calls"))
