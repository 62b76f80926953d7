"""The checks of a call that the generic program runs, in the caller's thread: the shared value checks, the
pipeline's own `check_inputs` where its arguments are plain call arguments, and its input images' check."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from ..registry import unhooked_class
from .pipeline import (
    arguments_set_before_check,
    check_logs_muted,
    checks_input_images,
    renamed_check_arguments,
    run_check_inputs,
)
from .values import as_list, check_generator, check_num_images_per_prompt, check_num_inference_steps

logger = logging.getLogger(__name__)


def check_generic_call(pipe: Any, args: dict[str, Any]) -> None:
    """The shared checks, the pipeline's own `check_inputs` where its arguments are plain call arguments, and its
    image processor's check of each input image where its `__call__` runs one."""
    if isinstance(args.get("callback_on_step_end"), (PipelineCallback, MultiPipelineCallbacks)):
        args = {**args, "callback_on_step_end_tensor_inputs": args["callback_on_step_end"].tensor_inputs}
    num_steps(args)
    per_prompt = check_num_images_per_prompt(args.get("num_images_per_prompt"))
    if isinstance(args.get("prompt"), (str, list)):
        check_generator(args.get("generator"), len(as_list(args["prompt"])) * per_prompt)
    _check_inputs(pipe, args)
    if args.get("image") is not None and checks_input_images(unhooked_class(pipe)):
        # NOTE: after `check_inputs`, as `__call__` runs them; it checks each input image only once queued
        for image in args["image"] if isinstance(args["image"], list) else [args["image"]]:
            pipe.image_processor.check_image_input(image)


def _check_inputs(pipe, args: dict[str, Any]) -> None:
    """The pipeline's own `check_inputs` where its arguments are plain call arguments."""
    check = getattr(pipe, "check_inputs", None)
    if check is None or args.get("use_resolution_binning"):  # binning changes height and width before the check
        return
    values = {}
    parameters = parameters_after_self(check.__func__) if inspect.ismethod(check) else tuple(
        inspect.signature(check).parameters.values())
    renamed = renamed_check_arguments(unhooked_class(pipe))  # e.g. the check's `image` is the call's control image
    wrapped, assigned = arguments_set_before_check(unhooked_class(pipe))
    for parameter in parameters:
        name = parameter.name
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        source = renamed.get(name, name)  # the call argument __call__ passes as this check parameter
        if name in ("height", "width") and args.get(name) is None and source in assigned:
            return  # the pipeline derives a default size first; it checks again itself
        if source in args:
            single = wrapped.get(source)  # `if isinstance(image, PIL.Image.Image): image = [image]` before the check
            values[name] = [args[source]] if single is not None and isinstance(args[source], single) else args[source]
        elif name == "callback_steps":  # NOTE: SD-era checks still require it; their __call__ passes None
            values[name] = None
        elif parameter.default is parameter.empty:
            return  # an argument __call__ computes: leave the check to the pipeline
    if "control_guidance_start" in values and "control_guidance_end" in values:
        values.update(_aligned_control_guidance(pipe, values["control_guidance_start"], values["control_guidance_end"]))
    try:
        with check_logs_muted(pipe):  # the request's own __call__ checks again, and logs then
            run_check_inputs(pipe, **values)
    except ValueError:
        with contextlib.suppress(Exception):  # its __call__ won't run: what the failing check logs, logged once
            pipe.check_inputs(**values)
        raise
    except Exception as exc:  # our mapping doesn't fit this pipeline; its own __call__ still checks
        logger.debug("skipped %s.check_inputs in the caller: %r", type(pipe).__name__, exc)


def _aligned_control_guidance(pipe, start: Any, end: Any) -> dict[str, Any]:
    """The ControlNet guidance window as ControlNet pipelines' `__call__` hands it to their check: a scalar repeated
    to the other's length, or both once per ControlNet."""
    if not isinstance(start, list) and isinstance(end, list):
        start = len(end) * [start]
    elif not isinstance(end, list) and isinstance(start, list):
        end = len(start) * [end]
    elif not isinstance(start, list):
        controlnet = getattr(pipe, "controlnet", None)
        controlnet = getattr(controlnet, "_orig_mod", controlnet)  # a compiled model
        nets = getattr(controlnet, "nets", None)
        count = len(nets) if isinstance(nets, (list, torch.nn.ModuleList)) else 1
        start, end = count * [start], count * [end]
    return {"control_guidance_start": start, "control_guidance_end": end}


def num_steps(args: dict[str, Any]) -> int:
    """The call's denoising steps, checked (1 where it names none)."""
    for name in ("timesteps", "sigmas"):
        if args.get(name) is not None:
            return check_num_inference_steps(None, args[name])
    if args.get("num_inference_steps") is None:
        return 1
    return check_num_inference_steps(args["num_inference_steps"])


@functools.cache
def parameters_after_self(function) -> tuple[inspect.Parameter, ...]:
    """A method's parameters without `self`, read once per function (`__call__`, `check_inputs`)."""
    return tuple(inspect.signature(function).parameters.values())[1:]
