"""Per-call pipeline state (`guidance_scale`, `current_timestep`, ...) kept on the request's view, not the pipeline.

>>> with active_view(view):
...     noise = transformer(...)             # sb.current_timestep is this request's timestep here
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

# NOTE: a view's pipeline, held weakly: a dropped pipeline (and in hook mode its engine) must not outlive its views.
_SOURCE = "_stepbatch_source"
# NOTE: a context variable: each generic-program call runs in a helper thread of its own
_active: contextvars.ContextVar[Any] = contextvars.ContextVar("stepbatch_active_view", default=None)


def begin_call(view: Any, args: dict[str, Any], names: tuple[str, ...] = (), **values: Any) -> None:
    """What a pipeline's `__call__` sets on itself first (`_<name>` of `names`' call arguments, then of `values`)."""
    for name in names:
        setattr(view, f"_{name}", args[name])
    for name, value in values.items():
        setattr(view, f"_{name}", value)
    view._interrupt = False


def record_view(pipe: Any, view: Any) -> None:
    view.__dict__[_SOURCE] = weakref.ref(pipe)


def view_source(view: Any) -> Any:
    """The pipeline a view was made from (None for anything else, or once that pipeline is gone)."""
    source = view.__dict__.get(_SOURCE)
    return source() if source is not None else None


@contextlib.contextmanager
def active_view(view: Any) -> Iterator[None]:
    token = _active.set(view)
    try:
        yield
    finally:
        _active.reset(token)


def active_view_of(pipe: Any) -> Any:
    """The view active here (a callback or a hooked forward running), if it was made from `pipe`."""
    view = _active.get()
    return view if view is not None and view_source(view) is pipe else None


def is_call_state(pipe: Any, view: Any, name: str) -> bool:
    """Per-call state: a family's property, or a value on the view the pipeline doesn't hold (PRX's num_timesteps)."""
    from diffusers import DiffusionPipeline

    if name.startswith(("__", "_stepbatch")):  # NOTE: our own bookkeeping on a view (its source, its device)
        return False
    own, shared = view.__dict__, pipe.__dict__
    view_only = name in own and (name not in shared or own[name] is not shared[name])
    if name.startswith("_"):
        return view_only
    if view_only and not callable(own[name]) and name not in getattr(pipe, "config", ()):
        return True
    attribute = inspect.getattr_static(type(view), name, None)
    return isinstance(attribute, property) and not hasattr(DiffusionPipeline, name)


def copy_call_state(pipe: Any, view: Any) -> None:
    """Leave a finished call's state (`_num_timesteps`, ...) on `pipe`, as a plain call does (hook mode)."""
    for name in list(view.__dict__):
        if is_call_state(pipe, view, name):
            pipe.__dict__[name] = view.__dict__[name]
