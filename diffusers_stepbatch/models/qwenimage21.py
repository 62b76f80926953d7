"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`).

Its forward lays out one joint text/image sequence for the whole call from row 0: `img_mask[0]` (where the
vision-language encoder's image slots sit) and `img_shapes[0]`. Rows share a call only where their masks are equal
(prompts of one token count, condition images of one layout). Each request's KV cache of its text and
condition-image tokens (filled by its first step's call, read by the later ones) is a row state: a merged call
reads the stacked caches of its rows and stores each row's keys and values in that row's own cache.
"""

from __future__ import annotations

import torch
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21KVLayerCache

from . import ModelSupport, RowState, register_model


class JoinedLayerCache:
    """One layer's cache for a merged call: `parts` are `(layer cache, rows)` of the calls, in row order."""

    def __init__(self, parts: list[tuple[QwenImage21KVLayerCache, int]]):
        self.parts = parts

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        begin = 0
        for layer, rows in self.parts:  # NOTE: copies, so a finished request's cache frees its own memory
            layer.store(k[begin:begin + rows].clone(), v[begin:begin + rows].clone())
            begin += rows

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = zip(*(layer.get() for layer, _ in self.parts))
        return torch.cat(keys), torch.cat(values)


class JoinedKVCache:
    """The KV cache of a merged call, over the caches of its calls (`(cache, rows)` in row order)."""

    def __init__(self, parts: list[tuple[QwenImage21KVCache, int]]):
        self.parts = parts

    def get_layer(self, layer_idx: int) -> JoinedLayerCache:
        return JoinedLayerCache([(cache.get_layer(layer_idx), rows) for cache, rows in self.parts])


@register_model(QwenImage21Transformer2DModel)
def _qwenimage21() -> ModelSupport:
    return ModelSupport(shared=("img_mask",), row_states={"kv_cache": RowState(QwenImage21KVCache, JoinedKVCache)})
