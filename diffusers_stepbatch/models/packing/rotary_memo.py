"""Rotary embeddings remembered by their position ids tensors: a request's positions are embedded once, not at
every step. The key is the tensor a view comes from (FLUX.2 passes [batch, tokens, 4] ids; the model reads row 0),
with the view's geometry and version; never the ids' content, whose reading would wait for the device.

>>> cos, sin = remembered(transformer.pos_embed, (txt_ids, img_ids), lambda: embed(txt_ids, img_ids))
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

# NOTE: an entry holds [tokens, head dim] tensors; a budget, not a count, bounds what the memo keeps alive
MAX_BYTES = 64 * 2**20
_memo: OrderedDict[tuple, tuple[list[weakref.ref], Any, int]] = OrderedDict()
_held = 0  # bytes of the tensors in `_memo`
_dead: list[tuple] = []  # keys whose ids tensors were collected (appended by weakref callbacks, dropped under lock)
_lock = threading.Lock()


def remembered(embed: torch.nn.Module, ids: Sequence[torch.Tensor], compute: Callable[[], Any]) -> Any:
    """`compute()` (the rotary embedding of `ids` by `embed`), or its result for the same `embed` and ids before.

    The result is shared: callers must not change it in place."""
    if any(tensor.is_inference() for tensor in ids):
        return compute()  # NOTE: inference tensors keep no version counter, so a change in place would go unseen
    key, alive = _key(embed, ids)
    with _lock:
        entry = _memo.get(key)
        if entry is not None and all(ref() is obj for ref, obj in zip(entry[0], alive)):
            _memo.move_to_end(key)
            return entry[1]
    value = compute()
    size = sum(t.numel() * t.element_size() for t in _tensors(value))
    with _lock:
        _drop(*_dead)
        _dead.clear()
        _drop(key)
        if size <= MAX_BYTES:
            refs = [weakref.ref(obj, lambda _, key=key: _dead.append(key)) for obj in alive]
            _store(key, (refs, value, size))
    return value


def held_bytes() -> int:
    """Bytes of the embeddings the memo keeps (entries of collected ids tensors count until the next lookup)."""
    return _held


def _store(key: tuple, entry: tuple) -> None:
    global _held
    _memo[key] = entry
    _held += entry[2]
    while _held > MAX_BYTES:
        _held -= _memo.popitem(last=False)[1][2]


def _drop(*keys: tuple) -> None:
    global _held
    for key in keys:
        entry = _memo.pop(key, None)
        if entry is not None:
            _held -= entry[2]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _key(embed: torch.nn.Module, ids: Sequence[torch.Tensor]) -> tuple[tuple, list]:
    """(the memo key, the objects that must still be the ones the key names)."""
    roots = [tensor if tensor._base is None else tensor._base for tensor in ids]
    # NOTE: a view shares its base's version counter: a change in place to either is seen
    views = tuple((id(root), tensor._version, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
                  for root, tensor in zip(roots, ids))
    return (id(embed), views), [embed, *roots]
