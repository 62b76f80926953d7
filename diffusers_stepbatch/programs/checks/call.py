"""Type and range checks on a bound call, for every family, in the caller's thread.

The pipelines' own `check_inputs` assume well-typed values; a string height, a NaN guidance scale or an int
`generator` would otherwise fail late, inside the engine, or not at all. These checks run before a family's
plan (and its `check_inputs`), and every error names the argument and what it should be.

>>> check_call_inputs(pipe, call_args, max_pixels=2**26, family_program=True)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import InvalidArgument, InvalidArgumentType

_PROMPTS = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")
_SCALES = ("guidance_scale", "true_cfg_scale", "guidance_rescale", "skip_layer_guidance_scale", "eta")
_EMBEDS = ("prompt_embeds", "negative_prompt_embeds")
_POOLED = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")
_IMAGES = ("image", "mask_image", "control_image", "ip_adapter_image", "last_image")


def check_call_inputs(pipe: Any, args: dict[str, Any], max_pixels: int | None, family_program: bool) -> None:
    """Raise TypeError/ValueError naming the argument for values no pipeline can run.

    `family_program`: the call runs one of our family programs (then the text embeddings' rank and width are
    checked against the denoiser too); the generic program leaves the rest to the pipeline.
    """
    check_image_size(args, max_pixels)
    for name in _PROMPTS:
        if name in args:
            check_prompt(name, args[name], allow_empty=name.startswith("negative"))
    for name in _SCALES:
        if args.get(name) is not None:
            check_finite_number(name, args[name])
    for name in _IMAGES:
        if args.get(name) is not None:
            check_image_input(name, args[name])
    if "generator" in args:
        check_generator_type(args["generator"])
    callback = args.get("callback_on_step_end")
    if callback is not None and not callable(callback):
        raise InvalidArgumentType(
            "callback_on_step_end",
            f"callback_on_step_end={callback!r} must be callable (pipe, step, timestep, kwargs) -> dict, "
            "a diffusers PipelineCallback or MultiPipelineCallbacks")
    if args.get("max_sequence_length") is not None:
        check_positive_int("max_sequence_length", args["max_sequence_length"])
    for name in ("sigmas", "timesteps"):
        if args.get(name) is not None:
            check_schedule(name, args[name])
    for name, value in args.items():
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise InvalidArgument(
                name,
                f"{name} is on the meta device (a tensor without data); pass a tensor with values")
    if args.get("latents") is not None and isinstance(args["latents"], torch.Tensor):
        if not args["latents"].is_floating_point():
            raise InvalidArgument("latents", f"latents have dtype {args['latents'].dtype}; pass floating-point latents")
    if family_program:
        check_text_embeddings(pipe, args)


def check_image_size(args: dict[str, Any], max_pixels: int | None) -> None:
    """`height`/`width`: positive integers, and at most `max_pixels` together."""
    for name in ("height", "width"):
        value = args.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidArgumentType(name, f"{name}={value!r} must be an int (pixels), got {type(value).__name__}")
        if not float(value).is_integer() or value <= 0:
            raise InvalidArgument(name, f"{name}={value!r} must be a positive whole number of pixels")
    height, width = args.get("height"), args.get("width")
    if max_pixels is not None and height is not None and width is not None and height * width > max_pixels:
        raise InvalidArgument(
            "height",
            f"height={height} x width={width} = {int(height * width)} pixels is more than this engine's limit of "
            f"{max_pixels} (SchedulerConfig(max_pixels=...)); ask for a smaller image or raise the limit"
        )


def check_prompt(name: str, value: Any, allow_empty: bool = False) -> None:
    """Lists of prompts: not empty, only str. (Other types: the pipeline's own check_inputs, in its words.)"""
    if not isinstance(value, list):
        return
    if not value and not allow_empty:
        raise InvalidArgument(name, f"{name}=[] is empty; pass at least one prompt")
    wrong = [entry for entry in value if not isinstance(entry, str)]
    if wrong:
        raise InvalidArgument(
            name,
            f"{name} must be a str or a list of str, but holds {wrong[0]!r} ({type(wrong[0]).__name__})")


def check_finite_number(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentType(name, f"{name}={value!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidArgument(name, f"{name}={value!r} must be a finite number")


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentType(name, f"{name}={value!r} must be an int, got {type(value).__name__}")
    if value < 1:
        raise InvalidArgument(name, f"{name}={value} must be >= 1")


def check_generator_type(generator: Any) -> None:
    generators = generator if isinstance(generator, list) else [generator]
    wrong = [g for g in generators if g is not None and not isinstance(g, torch.Generator)]
    if wrong:
        raise InvalidArgumentType("generator", f"generator={wrong[0]!r} must be a torch.Generator or a list of them "
                        "(e.g. torch.Generator().manual_seed(5))")


def check_schedule(name: str, value: Any) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)) and not hasattr(value,
                                                                                                          "__array__"):
        raise InvalidArgumentType(name, f"{name}={value!r} must be a list of numbers")
    for entry in list(value):
        if isinstance(entry, torch.Tensor) and entry.numel() == 1:
            entry = entry.item()
        if isinstance(entry, bool) or not isinstance(entry, numbers.Real) or not math.isfinite(entry):
            raise InvalidArgument(name, f"{name} must be a list of finite numbers, but holds {entry!r}")


def _text_width(pipe: Any) -> tuple[int | None, int | None]:
    """(token width, pooled width) the denoiser takes, where its config says."""
    for name in ("transformer", "unet"):
        model = getattr(pipe, name, None)
        config = getattr(model, "config", None)
        if config is None:
            continue
        width = config.get("joint_attention_dim") or config.get("cross_attention_dim")
        pooled = config.get("pooled_projection_dim")
        encoder_2 = getattr(pipe, "text_encoder_2", None)
        if pooled is None and name == "unet" and encoder_2 is not None:  # SDXL: the second encoder's projection
            pooled = getattr(encoder_2.config, "projection_dim", None)
        return (width if isinstance(width, int) else None), pooled
    return None, None


def check_text_embeddings(pipe: Any, args: dict[str, Any]) -> None:
    """Given embeddings: floating point, [batch, tokens, width] (pooled: [batch, width]) as the denoiser takes."""
    width, pooled_width = _text_width(pipe)
    for names, rank, expected in ((_EMBEDS, 3, width), (_POOLED, 2, pooled_width)):
        for name in names:
            value = args.get(name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidArgumentType(name, f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if not value.is_floating_point():
                raise InvalidArgument(name, f"{name} has dtype {value.dtype}; pass floating-point embeddings")
            if value.ndim != rank:
                layout = "[batch, tokens, width]" if rank == 3 else "[batch, width]"
                raise InvalidArgument(name, f"{name} has shape {tuple(value.shape)}; it must be {layout}")
            if expected is not None and value.shape[-1] != expected:
                raise InvalidArgument(name, f"{name} has width {value.shape[-1]} but the denoiser takes {expected} "
                                 f"(shape {tuple(value.shape)})")


def check_image_input(name: str, value: Any) -> None:
    """An image argument is a PIL image, an array or tensor, or (nested) lists of them: diffusers'
    `PipelineImageInput`, and lists of those for several adapters or ControlNets. Inside a list, None marks an
    image the pipeline fills in (VisualCloze's targets)."""
    from diffusers.image_processor import is_valid_image_imagelist

    def valid(entry: Any, nested: bool = False) -> bool:
        if isinstance(entry, (list, tuple)):
            return len(entry) > 0 and all(valid(item, nested=True) for item in entry)
        return (nested and entry is None) or is_valid_image_imagelist(entry)

    if not valid(value):
        raise InvalidArgumentType(
            name, f"{name} must be a PIL image, a numpy array, a torch tensor or a list of them, not "
                  f"{type(value).__name__}")
