"""Qwen-Image 2.1's KV cache as a row state: each request's cache of its text and condition-image keys and values,
filled by its first step's call and read by the later ones. A merged call gets the caches of its calls joined."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21KVLayerCache


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


def cache_rows(cache: QwenImage21KVCache | JoinedKVCache | None, rows: list[int], total: int):
    """The cache of a call of rows `rows` (ascending) of a `total`-row call: whole calls' caches only."""
    if cache is None or len(rows) == total:
        return cache
    parts, begin, wanted = [], 0, set(rows)
    for own, count in cache.parts if isinstance(cache, JoinedKVCache) else [(cache, total)]:
        held = wanted.intersection(range(begin, begin + count))
        if held and len(held) != count:
            raise ValueError("a TeaCache decision split the rows of one request's KV cache")
        if held:
            parts.append((own, count))
        begin += count
    return parts[0][0] if len(parts) == 1 else JoinedKVCache(parts)
