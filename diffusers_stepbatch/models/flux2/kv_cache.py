"""The FLUX.2 klein KV cache as a row state: the reference images' keys and values per layer, returned by a
request's first call (`kv_cache_mode="extract"`) and read by its later ones (`"cached"`)."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache

from .. import RowState


def _new_cache(like: Flux2KVCache) -> Flux2KVCache:
    cache = Flux2KVCache(len(like.double_block_caches), len(like.single_block_caches))
    cache.num_ref_tokens = like.num_ref_tokens
    return cache


def _layers(cache: Flux2KVCache) -> list:
    return cache.double_block_caches + cache.single_block_caches


def join(parts: list[tuple[Flux2KVCache, int]]) -> Flux2KVCache:
    """One cache holding the calls' reference keys and values stacked by row (read only by a cached call)."""
    joined = _new_cache(parts[0][0])
    for layer, own in zip(_layers(joined), zip(*(_layers(cache) for cache, _ in parts))):
        keys, values = zip(*(part.get() for part in own))
        layer.store(torch.cat(keys), torch.cat(values))
    return joined


def cut(cache: Flux2KVCache, begin: int, end: int) -> Flux2KVCache:
    """Rows [begin, end) of the cache a merged extract call returned, copied so each request holds its own."""
    return _rows_of(cache, lambda tensor: tensor[begin:end].clone())


def cache_rows(cache: Flux2KVCache, rows: torch.Tensor) -> Flux2KVCache:
    """The cache of a call of these rows (an index into the cache's rows), for a TeaCache forward's computing rows."""
    return _rows_of(cache, lambda tensor: tensor[rows])


def _rows_of(cache: Flux2KVCache, select) -> Flux2KVCache:
    """A cache of the same layers holding `select(keys)` and `select(values)` of each."""
    rows = _new_cache(cache)
    for layer, whole in zip(_layers(rows), _layers(cache)):
        keys, values = whole.get()
        layer.store(select(keys), select(values))
    return rows


KV_CACHE = RowState(Flux2KVCache, join, key=lambda cache: cache.num_ref_tokens, cut=cut)
