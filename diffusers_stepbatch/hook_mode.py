"""Hook mode: make `pipe(...)` itself step-batched, in place, for code that only holds the pipeline.

The pipeline's class becomes a same-named subclass whose `__call__` (looked up on the type) submits to a
`StepBatched` engine, so `isinstance` holds; `disable_step_batching` puts the original class back.

>>> engine = enable_step_batching(pipe, max_batch_size=8)
>>> image = pipe("a cat").images[0]          # batched with whatever else calls pipe(...) meanwhile
>>> disable_step_batching(pipe)               # pipe is exactly the plain pipeline again
"""

from __future__ import annotations

import functools
from typing import Any

from .programs.registry import HOOK_MODE_ENGINE
from .programs.request_state import active_view_of, copy_call_state
from .signature import signed, wrapper_signature

_ENGINE = HOOK_MODE_ENGINE  # in the pipeline's instance dict while hook mode is on


def enable_step_batching(pipe: Any, **options: Any) -> Any:
    """Serve `pipe(...)` through a StepBatched engine built with `options`; returns that `StepBatched`."""
    from .wrapper import StepBatched

    if is_step_batching(pipe):
        raise ValueError(f"step batching is already enabled on this {type(pipe).__name__}; "
                         "call disable_step_batching(pipe) first")
    engine = StepBatched(pipe, **options)
    # NOTE: the instance dict directly: DiffusionPipeline.__setattr__ would register it as a config entry.
    pipe.__dict__[_ENGINE] = engine
    pipe.__class__ = _hooked_class(type(pipe))
    return engine


def disable_step_batching(pipe: Any, cancel_pending: bool = False) -> None:
    """Restore the plain pipeline and close the engine; calls in flight finish first unless `cancel_pending`."""
    if not is_step_batching(pipe):
        raise ValueError(f"step batching is not enabled on this {type(pipe).__name__}")
    engine = pipe.__dict__.pop(_ENGINE)
    pipe.__class__ = type(pipe)._stepbatch_original_class
    engine.close(cancel_pending=cancel_pending)


def is_step_batching(pipe: Any) -> bool:
    return _ENGINE in getattr(pipe, "__dict__", {}) and hasattr(type(pipe), "_stepbatch_original_class")


@functools.cache
def _hooked_class(pipeline_class: type) -> type:
    def __call__(self, *args, **kwargs):
        engine = self.__dict__[_ENGINE]
        try:
            return engine(*args, **kwargs)
        finally:  # as a plain call leaves it: `pipe.num_timesteps`, `pipe.guidance_scale`, ... of this call
            view = getattr(engine._calls, "view", None)
            if view is not None:
                copy_call_state(self, view)

    namespace = {
        **_call_state_properties(pipeline_class),
        "__call__": signed(__call__, wrapper_signature(pipeline_class.__call__), pipeline_class.__call__.__doc__),
        "_stepbatch_original_class": pipeline_class,
        "__module__": pipeline_class.__module__, "__qualname__": pipeline_class.__qualname__,
        "__doc__": pipeline_class.__doc__,
    }
    return type(pipeline_class.__name__, (pipeline_class,), namespace)


def _call_state_properties(pipeline_class: type) -> dict[str, property]:
    """The family's per-call properties (`current_timestep`, `guidance_scale`, ...), read from the request's view
    while one runs in this thread (a step callback, or a forward of its rows: cache hooks read
    `pipe.current_timestep` there), else from the pipeline as before."""
    from diffusers import DiffusionPipeline

    def state_property(name: str, original: property) -> property:
        def get(self):
            view = active_view_of(self)
            return getattr(view, name) if view is not None else original.__get__(self, type(self))

        return property(get, original.fset, original.fdel, original.__doc__)

    properties = {}
    for klass in reversed(pipeline_class.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, property) and not hasattr(DiffusionPipeline, name):
                properties[name] = state_property(name, value)
    return properties
