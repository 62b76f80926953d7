"""Which step program serves which pipeline: an explicit registry keyed on the pipeline class."""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from ..engine.batch import WorkItem
from .options import PlanContext
from .request_state import record_view


@dataclass
class PlannedRequest:
    """A validated call: its step program, rows (images x CFG branches), steps, image tokens per row, and
    whether its prologue may run in the caller's thread at submit (touching no engine state)."""

    program: Generator[WorkItem, Any, Any]
    num_rows: int
    num_steps: int
    tokens_per_row: int = 1
    starts_in_caller: bool = False


PlanFn = Callable[[Any, dict[str, Any], PlanContext], PlannedRequest]

_PROGRAMS: dict[type, PlanFn] = {}


_FEATURES: dict[type, frozenset[str]] = {}


def register_program(pipeline_class: type, features: tuple[str, ...] = ()) -> Callable[[PlanFn], PlanFn]:
    """Register `plan` for `pipeline_class` and its subclasses; `features` names the reducers it implements.

    >>> @register_program(FluxPipeline, features=("teacache",))
    ... def plan_flux(pipe, call_args, context): ...
    """

    def decorate(plan: PlanFn) -> PlanFn:
        _PROGRAMS[pipeline_class] = plan
        _FEATURES[pipeline_class] = frozenset(features)
        return plan

    return decorate


def check_feature(pipe: Any, feature: str, option: str) -> None:
    """Raise a ValueError naming `option` when the pipeline's step program doesn't implement `feature`."""
    plan = program_for(pipe)
    features = next((_FEATURES[cls] for cls, fn in _PROGRAMS.items() if fn is plan), frozenset())
    if feature not in features:
        supporting = [cls.__name__ for cls, names in _FEATURES.items() if feature in names and _own_call(cls)]
        raise ValueError(f"{option} is not supported for {type(pipe).__name__}; supported: {supporting} and the "
                         "pipelines the generic program serves")


def program_for(pipe: Any) -> PlanFn | None:
    """The plan of the pipeline's class or nearest registered base whose `__call__` the class keeps (the generic
    fallback, registered on DiffusionPipeline, has none and serves every class)."""
    pipeline_class = unhooked_class(pipe)
    call = _own_call(pipeline_class)
    for cls in pipeline_class.__mro__:
        if cls in _PROGRAMS and _own_call(cls) in (None, call):
            return _PROGRAMS[cls]
    return None


HOOK_MODE_ENGINE = "_stepbatch_engine"  # hook mode keeps the pipeline's engine in its instance dict


def unhooked_class(pipe: Any) -> type:
    """The pipeline's own class, also in hook mode (`enable_step_batching` swaps in a subclass)."""
    return getattr(type(pipe), "_stepbatch_original_class", type(pipe))


def _own_call(cls: type) -> Any:
    return next((vars(base)["__call__"] for base in cls.__mro__ if "__call__" in vars(base)), None)


def registered_pipelines() -> list[type]:
    return list(_PROGRAMS)


def _stateful_components(pipe: Any) -> list[tuple[str, Any]]:
    """Components that keep per-call state: schedulers (step index, timesteps) and guiders (step, momentum)."""
    from diffusers import SchedulerMixin
    from diffusers.guiders.guider_utils import BaseGuidance

    found = []
    for name in dict.fromkeys([*pipe.config.keys(), *getattr(pipe, "_optional_components", [])]):
        component = pipe.__dict__.get(name)
        if isinstance(component, (SchedulerMixin, BaseGuidance)):
            found.append((name, component))
    return found


def request_view(pipe: Any) -> Any:
    """A view of `pipe` for one request: its models shared, its schedulers, guiders and per-call state its own."""
    view = copy.copy(pipe)
    view.__class__ = unhooked_class(pipe)  # in hook mode, the view's own __call__ is the pipeline's
    # NOTE: a view holds no engine: a thread keeps its last call's view, which would keep a hook-mode engine alive
    view.__dict__.pop(HOOK_MODE_ENGINE, None)
    # NOTE: the instance dict directly: DiffusionPipeline.__setattr__ would re-register the config
    for name, component in _stateful_components(pipe):
        view.__dict__[name] = copy.deepcopy(component)
    return view


def request_pipeline(pipe: Any, context: PlanContext) -> Any:
    """The request's view of `pipe` (`request_view`), recorded in the planning context."""
    view = request_view(pipe)
    record_view(pipe, view)
    context.views.append(view)
    return view
