"""The one entry point of every program's call checks, in the caller's thread before the request is planned.

>>> size = check_program_call(pipe, args, height, width, ProgramChecks(latent_patches=True))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from ..registry import unhooked_class
from .generic_call import check_generic_call, parameters_after_self
from .pipeline import run_check_inputs
from .values import CallSize, check_call_size, check_given_embeds_not_repeated, check_latent_patches


@dataclass(frozen=True)
class ProgramChecks:
    """What a dedicated program's pipeline asks of every call, beyond the program's own rules."""

    schedule: tuple[str, ...] = ("sigmas",)  # custom-schedule arguments giving the steps, the first one given
    latent_patches: bool = False  # height and width fill whole 2x2 latent patches (FLUX.1, Qwen-Image)
    embeds_as_given: str | None = None  # the pipeline (named) uses given prompt embeddings as they are
    legacy_callbacks: bool = False  # SD-era `callback` / `callback_steps` (extra kwargs) are refused
    pipeline_callbacks: bool = True  # a PipelineCallback's tensor inputs stand for the call's


def check_program_call(pipe: Any, args: dict[str, Any], height: int | None = None, width: int | None = None,
                       checks: ProgramChecks | None = None) -> CallSize | None:
    """A dedicated program's (`checks`): the pipeline's `check_inputs` at the main model's size, then the call's
    size, returned. The generic program's (no `checks`): `check_generic_call`."""
    if checks is None:
        check_generic_call(pipe, args)
        return None
    if checks.pipeline_callbacks and isinstance(args["callback_on_step_end"],
                                                (PipelineCallback, MultiPipelineCallbacks)):
        args["callback_on_step_end_tensor_inputs"] = args["callback_on_step_end"].tensor_inputs
    if checks.latent_patches:
        check_latent_patches(height, width, pipe)
    check_inputs_by_name(pipe, {**args, "height": height, "width": width})
    if checks.legacy_callbacks:
        legacy = sorted(option for option in (args.get("kwargs") or {}) if option in ("callback", "callback_steps"))
        if legacy:
            raise ValueError(f"{legacy} are deprecated and not supported by StepBatched; use callback_on_step_end")
    size = check_call_size(args, next((args[name] for name in checks.schedule if args[name] is not None), None))
    if checks.embeds_as_given is not None:
        check_given_embeds_not_repeated(args, size.per_prompt, checks.embeds_as_given)
    return size


def check_inputs_by_name(pipe: Any, args: dict[str, Any]) -> None:
    """The pipeline's `check_inputs`, each parameter the call argument of its name (None for a required one the
    call lacks: SD-era `callback_steps`)."""
    # NOTE: the class's parameters: an instance may wrap the method in a function of (*args, **kwargs)
    parameters = parameters_after_self(unhooked_class(pipe).check_inputs)
    run_check_inputs(pipe, **{parameter.name: args.get(parameter.name) for parameter in parameters
                              if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
                              and (parameter.name in args or parameter.default is parameter.empty)})
