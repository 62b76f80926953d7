"""Rank 0 makes every context-parallel model call; the other ranks make the same call, in the same order.

Under diffusers' context parallelism each rank must call the model with the same inputs at the same time (its
hooks split the sequence and gather the output). The engine, its scheduler and every decision stay on rank 0;
`CallRelay` sends each call's inputs to the followers before rank 0 makes it, and `follow` makes it on a follower.

A call travels as a header (the arguments' structure and every non-tensor value, pickled, on a gloo group that
waits without a time limit so an idle follower can wait for the next call) and its tensors (broadcast on the
models' group, over NCCL on GPUs). A follower that dies breaks rank 0's next collective; from then on every call
fails at once with `RanksLost`, never a hang.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..models.packing.support import SPLIT_PACKED
from .packed import run_split_packed, splits_packed

logger = logging.getLogger(__name__)

_STOP = "stop"
_CALL = "call"
_PACKED = "packed"
# NOTE: a follower waits for rank 0's next call as long as the server idles
_IDLE_WAIT = datetime.timedelta(days=365)


class RanksLost(RuntimeError):
    """A follower rank is gone (its process died or stopped answering): context-parallel calls can't run."""


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


class CallRelay:
    """Rank 0's side: wraps each model's `forward` so its inputs reach every follower before rank 0 runs it.

    >>> relay = CallRelay([pipe.transformer], device, header_group())    # on rank 0, after `enable_context_parallel`
    >>> ...                                      # every pipe.transformer(...) now runs on all ranks
    >>> relay.close()                            # followers' `follow()` returns
    """

    def __init__(self, models: Sequence[torch.nn.Module], device: torch.device, headers: Any):
        self._headers = headers
        self._device = device
        self._lock = threading.Lock()  # NOTE: one call at a time, so every rank sees the same order
        self._lost: BaseException | None = None
        self._closed = False
        self.calls = 0  # relayed so far (each follower makes as many)
        self._forwards = []
        for index, model in enumerate(models):
            inner = model.forward
            self._forwards.append((model, inner))
            model.forward = self._relayed(index, inner)
            if splits_packed(model):
                setattr(model, SPLIT_PACKED, functools.partial(self._packed, index, model))

    def _relayed(self, index: int, inner):
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run((_CALL, index), (args, kwargs), lambda: inner(*args, **kwargs))

        forward.__wrapped__ = inner
        return forward

    def _packed(self, index: int, model: torch.nn.Module, packing: Any, calls: list, packed_attention: str) -> list:
        return self._run((_PACKED, index), ((calls, packed_attention), {}),
                         lambda: run_split_packed(packing, model, calls, packed_attention))

    def _run(self, op: tuple[str, int], call: tuple[tuple, dict], run) -> Any:
        """Send `call` to the followers, then `run()` it here; one at a time, in order."""
        with self._lock:
            if self._lost is not None:
                raise RanksLost(f"a context-parallel follower rank is gone ({self._lost}); restart the "
                                "launch (torchrun) to serve again") from self._lost
            if self._closed:
                raise RuntimeError("this context-parallel relay is closed: the followers have stopped")
            try:
                _send(self._headers, op, call, self._device)
                self.calls += 1
                return run()
            except (RuntimeError, dist.DistBackendError) as exc:
                if _is_transport_error(exc):
                    self._lost = exc
                    raise RanksLost(f"a context-parallel follower rank is gone during a call ({exc})") from exc
                raise

    @property
    def lost(self) -> BaseException | None:
        """The error that broke the ranks' link, or None while every follower answers."""
        return self._lost

    def close(self) -> None:
        """Tell the followers to return from `follow()`, and give the models their own forwards back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for model, inner in self._forwards:
                model.forward = inner
                if hasattr(model, SPLIT_PACKED):
                    delattr(model, SPLIT_PACKED)
            if self._lost is None:
                try:
                    _send(self._headers, (_STOP, -1), ((), {}), self._device)
                except RuntimeError as exc:  # NOTE: a follower already gone has nothing to stop
                    logger.warning("could not tell the context-parallel followers to stop: %s", exc)


def header_group() -> Any:
    """The gloo group call headers travel on (every rank creates it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=_IDLE_WAIT)


def follow(models: Sequence[torch.nn.Module], device: torch.device, headers: Any) -> int:
    """A follower's loop: make each call rank 0 relays, until rank 0 closes; returns the number of calls made.

    A call that raises here raises on rank 0 too (same inputs, same code): the follower goes on to the next.
    """
    from ..models import support_for

    forwards = [model.forward for model in models]
    calls = 0
    while True:
        (op, index), (args, kwargs) = _receive(headers, device)
        if op == _STOP:
            return calls
        calls += 1
        try:
            with torch.inference_mode():
                if op == _PACKED:
                    model = models[index]
                    run_split_packed(support_for(model).packing, model, *args)
                else:
                    forwards[index](*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 reports it to the request
            logger.debug("a relayed call raised on this follower (rank 0 raises it too): %s", exc)


def _send(headers, op: tuple[str, int], call: tuple[tuple, dict], device: torch.device) -> None:
    leaves, spec = pytree.tree_flatten(call)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    described = [_TensorSlot(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
                 for leaf in leaves]
    dist.broadcast_object_list([op, spec, described], src=0, group=headers)
    for tensor in tensors:
        dist.broadcast(tensor.detach().to(device).contiguous(), src=0)


def _receive(headers, device: torch.device) -> tuple[tuple[str, int], tuple[tuple, dict]]:
    message = [None, None, None]
    dist.broadcast_object_list(message, src=0, group=headers)
    op, spec, described = message
    leaves = []
    for leaf in described:
        if isinstance(leaf, _TensorSlot):
            leaf = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            dist.broadcast(leaf, src=0)
        leaves.append(leaf)
    return op, pytree.tree_unflatten(leaves, spec)


def _is_transport_error(exc: BaseException) -> bool:
    """A collective that failed because a peer is gone (gloo/NCCL), not a model error with the same type."""
    if isinstance(exc, dist.DistBackendError):
        return True
    text = str(exc).lower()
    return any(sign in text for sign in ("connection closed", "connection reset", "broken pipe", "timed out"))
