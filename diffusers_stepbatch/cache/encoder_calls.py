"""The prompt cache for any pipeline: a text encoder's call, keyed by the encoder's state and its exact inputs.

The generic program sees every text-encoder call (token ids, masks, and for vision-language encoders the image
patches of an edit prompt). An identical call on an encoder in the same state gives the same output, so the
stored output is returned without a model call. The key holds the encoder's weight and adapter fingerprint,
dtype and placement, the method, and a digest of every argument's content, so edit prompts with other reference
images are other entries. Calls with arguments that can't be digested, and encoders in training mode (dropout),
are not cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .prompt import PromptCache, placement, weights_fingerprint

_SCALARS = (str, int, float, bool, type(None))


class _NotDigestible(Exception):
    pass


def call_key(module: torch.nn.Module, method: str, args: tuple, kwargs: dict) -> Hashable | None:
    """The cache key of this call, or None when it can't be cached."""
    if module.training:
        return None
    digest = hashlib.blake2b(digest_size=20)
    try:
        _feed(digest, (args, sorted(kwargs.items())))
    except _NotDigestible:
        return None
    first = next(module.parameters(), None)
    return ("encoder-call", type(module).__qualname__, weights_fingerprint(module),
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
    tensors, spec = found
    return pytree.tree_unflatten(list(tensors), spec)


def store(cache: PromptCache, key: Hashable, output: Any) -> None:
    leaves, spec = pytree.tree_flatten(output)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        cache.put(key, leaves, structure=spec)
