"""The prompt cache for any pipeline: a text encoder's call, keyed by the encoder's state and its exact inputs.

The generic program sees every text-encoder call (token ids, masks, and for vision-language encoders the image
patches of an edit prompt). An identical call on an encoder in the same state gives the same output, so the
stored output is returned without a model call. The key holds the encoder's weight and adapter fingerprint,
dtype and placement, the method, and a digest of every argument's content, so edit prompts with other reference
images are other entries. Calls with arguments that can't be digested, and encoders in training mode (dropout),
are not cached.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache

from .prompt import PromptCache, placement, weights_fingerprint

_SCALARS = (str, int, float, bool, type(None))


class _NotDigestible(Exception):
    pass


def call_key(module: torch.nn.Module, method: str, args: tuple, kwargs: dict,
             modules: tuple[torch.nn.Module, ...] | None = None) -> Hashable | None:
    """The cache key of this call, or None when it can't be cached (`modules`: the module's walk, if made)."""
    if module.training:
        return None
    digest = hashlib.blake2b(digest_size=20)
    try:
        _feed(digest, (args, sorted(kwargs.items())))
    except _NotDigestible:
        return None
    first = next(module.parameters(), None)
    return ("encoder-call", type(module).__qualname__, weights_fingerprint(module, modules),
            str(getattr(module, "dtype", None)), placement(None if first is None else first.device, module),
            method, digest.hexdigest())


def _feed(digest, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        digest.update(f"T{tuple(value.shape)}{value.dtype}{value.device}".encode())
        digest.update(value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, _SCALARS):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}[{len(value)}".encode())
        for entry in value:
            _feed(digest, entry)
        digest.update(b"]")
    elif isinstance(value, dict):
        _feed(digest, sorted(value.items(), key=lambda item: repr(item[0])))
    elif isinstance(value, (torch.dtype, torch.device)):
        digest.update(f"{value};".encode())
    else:
        raise _NotDigestible(type(value).__name__)


def lookup(cache: PromptCache, key: Hashable) -> Any | None:
    """The stored output as fresh tensors in its own structure, or None."""
    found = cache.get_entry(key)
    if found is None:
        return None
    tensors, (spec, layout) = found
    leaves = []
    for kind, value, start, count in layout:
        if kind == "tensor":
            leaves.append(tensors[start])
        elif kind == "cache":
            leaves.append(_filled(value, tensors[start:start + count]))
        else:
            leaves.append(value)
    return pytree.tree_unflatten(leaves, spec)


def store(cache: PromptCache, key: Hashable, output: Any) -> None:
    """Store `output` if it holds only tensors, plain values and key-value caches (which a text encoder may return
    beside its states: stored as their layers' keys and values)."""
    leaves, spec = pytree.tree_flatten(output)
    tensors, layout = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            layout.append(("tensor", None, len(tensors), 1))
            tensors.append(leaf)
        elif isinstance(leaf, Cache) and (emptied := _emptied(leaf)) is not None:
            template, kv = emptied
            layout.append(("cache", template, len(tensors), len(kv)))
            tensors.extend(kv)
        elif isinstance(leaf, _SCALARS):
            layout.append(("value", leaf, 0, 0))
        else:
            return
    cache.put(key, tensors, structure=(spec, layout))


_KV = ("keys", "values")
_TAKEN = object()  # where a stored cache layer's tensor goes back


def _emptied(cache: Cache) -> tuple[Cache, list[torch.Tensor]] | None:
    """(a copy of `cache` whose layers hold no keys and values, those tensors in layer order), or None when a
    layer holds other tensors."""
    template, tensors = copy.copy(cache), []
    template.layers = []
    for layer in cache.layers:
        if any(isinstance(v, torch.Tensor) and n not in _KV for n, v in vars(layer).items()):
            return None
        part = copy.copy(layer)
        for name in _KV:
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                setattr(part, name, _TAKEN)
        template.layers.append(part)
    return template, tensors


def _filled(template: Cache, tensors: list[torch.Tensor]) -> Cache:
    filled, remaining = copy.copy(template), iter(tensors)
    filled.layers = []
    for layer in template.layers:
        part = copy.copy(layer)
        for name in _KV:
            if vars(layer).get(name) is _TAKEN:
                setattr(part, name, next(remaining))
        filled.layers.append(part)
    return filled
