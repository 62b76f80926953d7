"""Rotary embeddings remembered by their position ids, so that a request's positions are embedded once, not at
every step.

A request passes the same positions at each of its steps, but not always the same tensors: the FLUX.2 pipelines
build an edit's ids anew at every step, and a part's ids are a slice of the call's. On the CPU the key is therefore
the ids' content (exact bytes, not a hash of them); on an accelerator, where reading the content would wait for the
device, it is the ids tensors themselves while they live unchanged.

>>> cos, sin = remembered(transformer.pos_embed, (txt_ids, img_ids), lambda: embed(txt_ids, img_ids))
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

# NOTE: a few requests' worth: an entry holds [tokens, head dim] tensors, and requests rarely share positions
_ENTRIES = 64
_memo: OrderedDict[tuple, tuple[list[weakref.ref], Any]] = OrderedDict()
_lock = threading.Lock()


def remembered(embed: torch.nn.Module, ids: Sequence[torch.Tensor], compute: Callable[[], Any]) -> Any:
    """`compute()` (the rotary embedding of `ids` by `embed`), or its result for the same `embed` and ids before.

    The result is shared: callers must not change it in place."""
    key, alive = _key(embed, ids)
    with _lock:
        entry = _memo.get(key)
        if entry is not None and all(ref() is obj for ref, obj in zip(entry[0], alive)):
            _memo.move_to_end(key)
            return entry[1]
    value = compute()
    with _lock:
        _memo[key] = ([weakref.ref(obj) for obj in alive], value)
        _memo.move_to_end(key)
        while len(_memo) > _ENTRIES:
            _memo.popitem(last=False)
    return value


def _key(embed: torch.nn.Module, ids: Sequence[torch.Tensor]) -> tuple[tuple, list]:
    """(the memo key, the objects that must still be the ones the key's ids name)."""
    if all(tensor.device.type == "cpu" for tensor in ids):
        content = tuple((tensor.dtype, tuple(tensor.shape), _bytes(tensor))
                        for tensor in ids)
        return (id(embed), content), [embed]
    # NOTE: `_version` moves on an in-place change, so a changed tensor never answers with its old embedding
    return (id(embed), tuple((id(tensor), tensor._version) for tensor in ids)), [embed, *ids]


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
