"""Fallback step program for any DiffusionPipeline without a family program.

Each request runs the pipeline's own `__call__`, unchanged, in a helper thread, on a per-request view of the
pipeline (shared models, its own scheduler copy and per-call state). On that view the denoisers, text encoders
and VAE are proxies (`proxies.py`): their calls become work items (`work_items.py`) that the engine merges across
requests through the model layer. Control passes between the engine thread and the call strictly in turn
(`turns.py`).

A whole pipeline call runs alone when its denoiser can't be found, carries diffusers hooks (their state is
per model, not per request) or is driven by PAG (its attention processors are set for a whole call).
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import torch
from diffusers import DiffusionPipeline

from ...engine.batch import WorkItem
from ...engine.split_reasons import named_key
from ...models.merge_checks import log_once
from ...models.packing.support import splits_sequence
from ...module_scan import diffusers_hooks, execution_device, marked_modules
from ..checks.generic_call import num_steps, parameters_after_self
from ..checks.program import check_program_call
from ..checks.values import as_list, check_num_images_per_prompt
from ..options import PlanContext
from ..pid.generic import plan_generic_pid_exit
from ..registry import PlannedRequest, register_program, request_pipeline, unhooked_class
from ..request_state import active_view
from ...adapters.state import NOT_GIVEN
from .proxies import DENOISER_NAMES, denoiser_names, plan_proxies
from .turns import generic_program
from .work_items import HOLDERS, Holder


@register_program(DiffusionPipeline, features=("adapters", "teacache"))
def plan_generic(pipe: DiffusionPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate what can be validated in the caller's thread and return the fallback step program."""
    pid = plan_generic_pid_exit(pipe, args, context)  # PiD early exit (pid/generic.py); None: VAE decode
    if pid is not None:
        args = pid.call_args  # at 1/sr_scale, stopped after step K, latent output
    check_program_call(pipe, args)
    positional, keywords = _call_arguments(pipe, args)
    steps = num_steps(args)
    prompts = as_list(args["prompt"]) if isinstance(args.get("prompt"), (str, list)) else None
    images = (len(prompts) if prompts else 1) * check_num_images_per_prompt(args.get("num_images_per_prompt"))
    denoisers = denoiser_names(pipe)
    branches = _guidance_branches(args, [getattr(pipe, name) for name in denoisers])
    reason = _unbatchable_reason(pipe, denoisers, args)
    if reason is not None:
        for option, given in (("adapters=", context.adapters is not NOT_GIVEN),
                              ("teacache=", context.options.teacache is not None)):
            if given:
                raise ValueError(f"{option} is not supported for {type(pipe).__name__} here: its calls run whole "
                                 f"({reason})")
        log_once(type(pipe).__name__, f"whole calls, unbatched: {reason}")
        program = _whole_call_program(request_pipeline(pipe, context), positional, keywords, reason)
    else:
        proxies = plan_proxies(pipe, args, context, denoisers)
        view = request_pipeline(pipe, context)
        _fix_view_lookups(view, pipe)
        program = generic_program(view, positional, keywords, proxies)
    if pid is not None:
        program = pid.decoded(program)
    return PlannedRequest(program=program, num_rows=images * branches, num_steps=steps,
                          tokens_per_row=_latent_tokens(pipe, args))


def _latent_tokens(pipe, args: dict[str, Any]) -> int:
    """Latent pixels (times latent frames for a video) of one row, as far as the call says; 1 when unknown (the
    pipeline derives its default size itself)."""
    scale = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if not isinstance(scale, int) or not all(isinstance(args.get(name), int) for name in ("height", "width")):
        return 1
    tokens = (args["height"] // scale) * (args["width"] // scale)
    frames, temporal = args.get("num_frames"), getattr(pipe, "vae_scale_factor_temporal", None)
    if isinstance(frames, int) and isinstance(temporal, int) and frames > 0:
        tokens *= (frames - 1) // temporal + 1
    return tokens


def _fix_view_lookups(view, pipe) -> None:
    """The view answers two of diffusers' lookups as a plain call would find them, without their cost per call:
    `_execution_device` with the device found at submit (diffusers walks every module of every model for it), and
    `_get_signature_keys` from its first answer per class (an `inspect.signature` of `__init__` each time, e.g. for
    `components` at the end of every call)."""
    view.__class__ = _view_class(type(view))
    try:
        view.__dict__[_DEVICE] = execution_device(pipe)
    except Exception:  # NOTE: a pipeline that can't answer at submit: its call asks (and fails) as it would plainly
        pass


_DEVICE = "_stepbatch_execution_device"


@functools.cache
def _view_class(cls: type) -> type:
    def fixed_device(self):
        device = self.__dict__.get(_DEVICE)
        return device if device is not None else super(view_class, self)._execution_device

    def signature_keys(_, obj) -> tuple[list[str], list[str]]:
        owner = obj if isinstance(obj, type) else type(obj)
        expected, optional = _signature_keys(cls, owner, tuple(getattr(cls, "_optional_components", ())))
        return list(expected), list(optional)

    view_class = type(cls.__name__, (cls,), {
        "_execution_device": property(fixed_device, doc="The execution device found at submit."),
        "_get_signature_keys": classmethod(signature_keys),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return view_class


@functools.cache
def _signature_keys(cls: type, owner: type, optional_components: tuple) -> tuple[list[str], list[str]]:
    return cls._get_signature_keys(owner)  # NOTE: `optional_components` is in the cache key: the answer reads it


def _guidance_branches(args: dict[str, Any], denoisers: list) -> int:
    """Rows per image: 2 under classifier-free guidance, as far as the call's arguments tell (an estimate)."""
    def above_one(name: str) -> bool:
        return isinstance(args.get(name), (int, float)) and args[name] > 1

    distilled = any(getattr(getattr(model, "config", None), "guidance_embeds", False) for model in denoisers)
    negative = any(args.get(name) is not None for name in ("negative_prompt", "negative_prompt_embeds"))
    # NOTE: a guidance-distilled model takes guidance_scale as an input, not as a second branch (FLUX.1 dev);
    # true CFG needs a negative prompt (FLUX.1, Qwen-Image)
    return 2 if (above_one("guidance_scale") and not distilled) or (above_one("true_cfg_scale") and negative) else 1


def _call_arguments(pipe, args: dict[str, Any]) -> tuple[list, dict]:
    """The bound call arguments (as the wrapper binds them) back into positional and keyword arguments."""
    positional, keywords = [], {}
    for parameter in parameters_after_self(unhooked_class(pipe).__call__):
        if parameter.name not in args:
            continue
        value = args[parameter.name]
        if parameter.kind == parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif parameter.kind == parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif parameter.kind == parameter.VAR_KEYWORD:
            keywords.update(value)
        else:
            keywords[parameter.name] = value
    return positional, keywords


def _unbatchable_reason(pipe, denoisers: list[str], args: dict[str, Any]) -> str | None:
    if not denoisers:
        return f"no denoiser found among {list(DENOISER_NAMES)}"
    if _uses_pag(pipe, args):
        # NOTE: PAG swaps the shared denoiser's attention processors for the length of one call, and they split
        # the batch into positional chunks (uncond / cond / perturbed): no other call may run meanwhile.
        return "perturbed-attention guidance sets attention processors on the shared denoiser for its whole call"
    for name in denoisers:
        for _, module in marked_modules(getattr(pipe, name)):
            hooks = [hook for hook in diffusers_hooks(module) if not splits_sequence(hook)]
            if hooks:
                return f"pipe.{name} has diffusers hooks ({list(hooks)}), whose state is not per request"
    return None


def _uses_pag(pipe, args: dict[str, Any]) -> bool:
    from diffusers.pipelines.pag.pag_utils import PAGMixin

    scale = args.get("pag_scale")
    return isinstance(pipe, PAGMixin) and isinstance(scale, (int, float)) and scale > 0


# ------------------------------------------------------------------------------------------ whole-call fallback
def _whole_call_program(view, positional: list, keywords: dict, reason: str) -> Generator[WorkItem, Any, Any]:
    holder = Holder()
    run = functools.partial(_run_whole_call, view, positional, keywords)
    key = named_key(program="generic.call", **{f"generic program: {reason}": id(holder)})
    yield WorkItem("call", key, {HOLDERS: [holder]}, run, rows=1)
    return holder.output


def _run_whole_call(view, positional, keywords, _holders):
    with active_view(view):  # hooks and callbacks reading `sb.current_timestep` see this request's state
        _holders[0].output = view(*positional, **keywords)
    return torch.zeros(1)


