"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`).

Its forward lays out one joint text/image sequence for the whole call from row 0: `img_mask[0]` (where the
vision-language encoder's image slots sit) and `img_shapes[0]`. Rows share a call only where their masks are equal
(prompts of one token count, condition images of one layout). Each request's KV cache of its text and
condition-image tokens (`kv_cache.py`) is a row state: a merged call reads the stacked caches of its rows and
stores each row's keys and values in that row's own cache. `packing.py` packs calls of other layouts into one
call; `teacache.py` is the per-row TeaCache forward. Under per-request LoRA each row needs its own t=0 modulation
row (the model's forward has one per call), so every call runs through the packed forward (`lora.py`).
"""

from __future__ import annotations

from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from .. import ModelSupport, Packing, RowState, register_model
from .kv_cache import JoinedKVCache
from .lora import token_rows
from .packing import lora_forward, pack_calls, pack_key, qwenimage21_packing_unsupported
from .teacache import QWENIMAGE21_COEFFICIENTS, teacache_call


@register_model(QwenImage21Transformer2DModel)
def _qwenimage21() -> ModelSupport:
    return ModelSupport(shared=("img_mask",), row_states={"kv_cache": RowState(QwenImage21KVCache, JoinedKVCache)},
                        trusted=True, teacache_coefficients=QWENIMAGE21_COEFFICIENTS, teacache_forward=teacache_call,
                        packing=Packing(unsupported=qwenimage21_packing_unsupported, key=pack_key, run=pack_calls,
                                        token_rows=token_rows), lora_rows=True, lora_forward=lora_forward)
