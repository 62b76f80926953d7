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
    """A validated call, ready for the engine: its step program (not started) and its size.

    Args:
        program: the generator that yields work items and returns the pipeline output.
        num_rows: the most rows it adds to one batch (images x CFG branches).
        num_steps: denoising steps it will run.
        tokens_per_row: image tokens per row, the size a row's per-step cost scales with (for scheduling).
        starts_in_caller: whether the program's prologue (up to its first work item) may run in the caller's
            thread at submit; it must then touch no state of the engine thread.
    """

    program: Generator[WorkItem, Any, Any]
    num_rows: int
    num_steps: int
    tokens_per_row: int = 1
    starts_in_caller: bool = False


# plan(pipe, call_args, context) validates a call in the caller's thread and returns its PlannedRequest.
PlanFn = Callable[[Any, dict[str, Any], PlanContext], PlannedRequest]

_PROGRAMS: dict[type, PlanFn] = {}


_FEATURES: dict[type, frozenset[str]] = {}


def register_program(pipeline_class: type, features: tuple[str, ...] = ()) -> Callable[[PlanFn], PlanFn]:
    """Register `plan` as the step program of `pipeline_class` (and of its subclasses).

    `features` names the optional reducers the program implements (e.g. "teacache"); asking for one that a
    family's program lacks is an error, not a silent no-op.

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
    """The plan function registered for the pipeline's class or its nearest registered base class.

    A family's program mirrors its class's `__call__`, so it serves a subclass only if the subclass keeps that
    `__call__`; one registered on a base without `__call__` (DiffusionPipeline: the generic fallback) serves all.
    """
    pipeline_class = unhooked_class(pipe)
    call = _own_call(pipeline_class)
    for cls in pipeline_class.__mro__:
        if cls in _PROGRAMS and _own_call(cls) in (None, call):
            return _PROGRAMS[cls]
    return None


# NOTE: where hook mode (`enable_step_batching`) keeps the pipeline's engine, in its instance dict.
HOOK_MODE_ENGINE = "_stepbatch_engine"


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

    names = getattr(pipe, "_optional_components", [])  # NOTE: and every registered component, below
    found = []
    for name in dict.fromkeys([*pipe.config.keys(), *names]):
        component = pipe.__dict__.get(name)
        if isinstance(component, (SchedulerMixin, BaseGuidance)):
            found.append((name, component))
    return found


def request_view(pipe: Any) -> Any:
    """A view of `pipe` for one request: its models shared, its schedulers, guiders and per-call state its own."""
    view = copy.copy(pipe)
    view.__class__ = unhooked_class(pipe)  # in hook mode, the view's own __call__ is the pipeline's
    # NOTE: and it holds no engine: a caller's thread keeps its last call's view (`sb.num_timesteps`, ...), which
    # would keep a dropped hook-mode pipeline's engine and wrapper alive.
    view.__dict__.pop(HOOK_MODE_ENGINE, None)
    # NOTE: write the instance dict directly: DiffusionPipeline.__setattr__ would re-register the config.
    for name, component in _stateful_components(pipe):
        view.__dict__[name] = copy.deepcopy(component)
    return view


def request_pipeline(pipe: Any, context: PlanContext) -> Any:
    """The request's view of `pipe` (`request_view`), recorded in the planning context.

    diffusers keeps per-call state on the pipeline (`_guidance_scale`, `_interrupt`, `_current_timestep`,
    `_joint_attention_kwargs`) and schedulers and guiders are stateful (`_step_index`, momentum), so concurrent
    requests each need their own.
    """
    view = request_view(pipe)
    record_view(pipe, view)
    context.views.append(view)
    return view
