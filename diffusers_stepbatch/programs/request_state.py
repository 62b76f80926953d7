"""Per-call pipeline state (`guidance_scale`, `num_timesteps`, `current_timestep`, ...) seen from the wrapper.

diffusers keeps a call's state on the pipeline object; a step program keeps it on the request's own view
(`request_pipeline`). So that code written for the plain pipeline reads the same values through the wrapper:
- after `sb(...)` returns, the calling thread sees that call's view (`StepBatched` keeps it per thread);
- inside a step callback, and inside a forward that runs one request's rows (cache hooks read
  `pipe.current_timestep` there), the engine thread sees the view made active with `active_view(view)`.

>>> planned = plan(pipe, call_args, context)   # request_pipeline() puts the view it makes in context.views
>>> with active_view(context.views[0]):
...     noise = transformer(...)             # sb.current_timestep is this request's timestep here
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

# NOTE: on a view, a weak reference to the pipeline it was made from: a caller's thread keeps its last call's view
# (`sb.num_timesteps`, ...), and in hook mode the pipeline holds its engine, which must stop once it is dropped.
_SOURCE = "_stepbatch_source"
_active = threading.local()


def record_view(pipe: Any, view: Any) -> None:
    view.__dict__[_SOURCE] = weakref.ref(pipe)


def view_source(view: Any) -> Any:
    """The pipeline a view was made from (None for anything else, or once that pipeline is gone)."""
    source = view.__dict__.get(_SOURCE)
    return source() if source is not None else None


@contextlib.contextmanager
def active_view(view: Any) -> Iterator[None]:
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(view)
    try:
        yield
    finally:
        stack.pop()


def active_view_of(pipe: Any) -> Any:
    """The view active in this thread (a callback or a hooked forward running), if it was made from `pipe`."""
    stack = getattr(_active, "stack", None)
    if stack and view_source(stack[-1]) is pipe:
        return stack[-1]
    return None


def is_call_state(pipe: Any, view: Any, name: str) -> bool:
    """Whether `name` is per-call state to read from a request's view rather than from the pipeline.

    That is a property the pipeline's family defines (`guidance_scale`, `do_classifier_free_guidance`, ...;
    not DiffusionPipeline's own `device`, `components`, ...), or a private attribute the call set on its view.
    """
    from diffusers import DiffusionPipeline

    if name.startswith("__") or name == _SOURCE:
        return False
    if name.startswith("_"):
        own, shared = view.__dict__, pipe.__dict__
        return name in own and (name not in shared or own[name] is not shared[name])
    attribute = inspect.getattr_static(type(view), name, None)
    return isinstance(attribute, property) and not hasattr(DiffusionPipeline, name)


def copy_call_state(pipe: Any, view: Any) -> None:
    """Leave a finished call's private state (`_guidance_scale`, `_num_timesteps`, ...) on `pipe`, as a plain call
    does (hook mode: code that holds only the pipeline reads `pipe.num_timesteps` after its call)."""
    for name in list(view.__dict__):
        if name.startswith("_") and is_call_state(pipe, view, name):
            pipe.__dict__[name] = view.__dict__[name]
