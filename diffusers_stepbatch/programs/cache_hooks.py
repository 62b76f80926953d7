"""diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache, PyramidAttentionBroadcast, FasterCache) on a
denoiser that step programs share between requests.

Those hooks decide for a whole forward and keep their state either per `cache_context` name (a
`StateManager`: FirstBlockCache, TaylorSeer, MagCache) or on the hook itself (PyramidAttentionBroadcast,
FasterCache). So a hooked denoiser never mixes requests in one forward: each request's forwards run alone
(their own compatibility key), one CFG branch per forward as the pipelines run them, each branch inside its
own context name (one per request and branch). Hooks with state outside any context make requests take turns:
one request holds the denoiser from its first hooked forward to its last, then the hooks are reset, as
`DiffusionPipeline.maybe_free_model_hooks` does after a plain call. Our TeaCache (`cache/teacache.py`) is the
batched path: per row, in shared forwards.

>>> hooked = hooked_denoiser(pipe.transformer, view)       # None when the denoiser has no stateful hooks
>>> yield from hooked.take_turn()                          # waits while another request holds the denoiser
>>> noise = yield WorkItem("denoise", key + hooked.key_field, inputs, hooked.run(forward, ["cond", "uncond"]), rows)
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import NamedKey, named_key
from ..module_scan import diffusers_hooks, marked_modules
from .request_state import active_view, view_source

_ids = itertools.count()
# model -> (key, weakref) of the HookedDenoiser whose turn it is
_turns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stateful_hooks(model: torch.nn.Module) -> list[Any]:
    hooks = []
    for _, module in marked_modules(model):
        hooks += [hook for hook in diffusers_hooks(module).values() if getattr(hook, "_is_stateful", False)]
    return hooks


def _state_managers(hook: Any) -> list[Any]:
    from diffusers.hooks.hooks import StateManager

    return [value for value in vars(hook).values() if isinstance(value, StateManager)]


def hooked_denoiser(model: torch.nn.Module, view: Any) -> HookedDenoiser | None:
    """A request's handle on `model` when it carries stateful diffusers hooks; None otherwise."""
    hooks = _stateful_hooks(model)
    if not hooks:
        return None
    exclusive = any(not _state_managers(hook) for hook in hooks)
    return HookedDenoiser(model, view, exclusive)


class HookedDenoiser:
    """One request's forwards on a hooked denoiser: alone, per branch, inside the request's own contexts."""

    def __init__(self, model: torch.nn.Module, view: Any, exclusive: bool):
        self.model = model
        self.view = view
        self.exclusive = exclusive
        self.key = ("cache-hooks", next(_ids))  # compatibility-key part: this request's forwards run alone
        self.names: set[str] = set()
        # NOTE: released when the program finishes, and also when it is closed (aborted) and this is collected.
        self._release = weakref.finalize(self, _release, model, self.key, self.names, exclusive)

    @property
    def key_field(self) -> NamedKey:
        """The denoise key's part that keeps this request's forwards to itself (named for stats()["splits"])."""
        return named_key(**{"diffusers cache hooks: a hooked request's forwards run alone": self.key})

    def context_name(self, branch: str) -> str:
        return f"{branch}@stepbatch-{self.key[1]}"

    def take_turn(self) -> Generator[WorkItem, Any, None]:
        """With hooks whose state is not per context: wait (one idle item per engine step) for the denoiser."""
        if not self.exclusive:
            return
        while True:
            _, holder = _turns.get(self.model, (None, None))
            current = holder() if holder is not None else None
            if current is None or current is self:
                _turns[self.model] = (self.key, weakref.ref(self))
                return
            yield WorkItem("wait", named_key(program="cache-hooks.wait", turn=self.key), {}, _idle, rows=1)

    def run(self, forward: Callable[..., Any], branches: Sequence[str]) -> Callable[..., Any]:
        """A work item's `run`: the rows split into `branches` (equal parts, in order), one forward each."""
        names = [self.context_name(branch) for branch in branches]
        self.names.update(names)
        return _BranchRun(self.model, self.view, forward, names)

    def release(self) -> None:
        self._release()


class _BranchRun:
    __slots__ = ("forward", "model", "names", "view")

    def __init__(self, model, view, forward, names):
        self.model, self.view, self.forward, self.names = model, view, forward, names

    def __call__(self, **inputs: Any) -> torch.Tensor:
        rows = next(len(v) for v in inputs.values() if v is not None)
        per_branch = rows // len(self.names)
        outputs = []
        for b, name in enumerate(self.names):
            part = {k: None if v is None else v[b * per_branch:(b + 1) * per_branch] for k, v in inputs.items()}
            with _request_timestep(self.view), self.model.cache_context(name):
                outputs.append(self.forward(**part))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


@contextlib.contextmanager
def _request_timestep(view: Any) -> Iterator[None]:
    """Inside the forward, `sb.current_timestep` and the plain `pipe.current_timestep` are this request's
    (PyramidAttentionBroadcast and FasterCache read them through `current_timestep_callback`)."""
    pipe = view_source(view)
    missing = object()
    saved = pipe.__dict__.get("_current_timestep", missing) if pipe is not None else missing
    if pipe is not None:
        pipe.__dict__["_current_timestep"] = view.__dict__.get("_current_timestep")
    try:
        with active_view(view):
            yield
    finally:
        if pipe is not None:
            if saved is missing:
                pipe.__dict__.pop("_current_timestep", None)
            else:
                pipe.__dict__["_current_timestep"] = saved


def _idle() -> torch.Tensor:
    return torch.zeros(1)


def _release(model: torch.nn.Module, key: Any, names: set[str], exclusive: bool) -> None:
    """Drop this request's per-context hook state; after a turn, reset the hooks as a plain call's end does."""
    if exclusive:
        holder_key, holder = _turns.get(model, (None, None))
        if holder_key == key or holder is None or holder() is None:
            _turns.pop(model, None)
            model._reset_stateful_cache()
        return
    for hook in _stateful_hooks(model):
        for manager in _state_managers(hook):
            for name in names:
                state = manager._state_cache.pop(name, None)  # NOTE: diffusers has no per-name reset
                if state is not None:
                    state.reset()
