"""Checks every family runs in the caller's thread, before a request enters a batch."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import InvalidArgument


@dataclass(frozen=True)
class CallSize:
    """How much a call asks for: denoising steps, prompts, and images per prompt."""

    steps: int
    num_prompts: int
    per_prompt: int

    @property
    def num_images(self) -> int:
        return self.num_prompts * self.per_prompt


def check_call_size(args: dict[str, Any], custom_schedule: Sequence[float] | None = None) -> CallSize:
    """The checks every family shares: output type, steps (or a custom schedule's length), images per
    prompt and the length of a generator list."""
    args["output_type"] = check_output_type(args["output_type"])
    steps = check_num_inference_steps(args["num_inference_steps"], custom_schedule)
    per_prompt = check_num_images_per_prompt(args["num_images_per_prompt"])
    prompts = as_list(args["prompt"])
    num_prompts = len(prompts) if prompts is not None else args["prompt_embeds"].shape[0]
    check_generator(args["generator"], num_prompts * per_prompt)
    return CallSize(steps, num_prompts, per_prompt)


def check_unsupported(args: dict[str, Any], names: Sequence[str], family: str) -> None:
    given = [name for name in names if args.get(name) is not None]
    if given:
        raise ValueError(f"{given} are not supported by StepBatched's {family} program yet; "
                         "call the wrapped pipe directly")


def check_given_embeds_not_repeated(args: dict[str, Any], per_prompt: int, pipeline: str) -> None:
    """Flux and SD3 use given `prompt_embeds` as they are: they don't repeat them per image."""
    if args["prompt_embeds"] is not None and per_prompt > 1:
        raise ValueError(
            f"num_images_per_prompt={per_prompt} with prompt_embeds: {pipeline} does not repeat given "
            "embeddings; repeat prompt_embeds and pooled_prompt_embeds yourself and pass num_images_per_prompt=1"
        )


def check_num_inference_steps(num_inference_steps: Any, sigmas: Sequence[float] | None = None) -> int:
    """The number of denoising steps a call will run (diffusers uses len(sigmas) when they are given)."""
    if sigmas is not None:
        if len(sigmas) < 1:
            raise InvalidArgument("sigmas", f"sigmas={list(sigmas)} must hold at least one value")
        return len(sigmas)
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, numbers.Integral):
        raise InvalidArgument("num_inference_steps", f"num_inference_steps={num_inference_steps!r} must be an int >= 1")
    if num_inference_steps < 1:
        raise InvalidArgument("num_inference_steps", f"num_inference_steps={num_inference_steps} must be >= 1")
    return int(num_inference_steps)


def check_num_images_per_prompt(num_images_per_prompt: Any) -> int:
    if num_images_per_prompt is None:
        return 1
    if isinstance(num_images_per_prompt, bool) or not isinstance(num_images_per_prompt, numbers.Integral):
        raise InvalidArgument(
            "num_images_per_prompt",
            f"num_images_per_prompt={num_images_per_prompt!r} must be an int >= 1")
    if num_images_per_prompt < 1:
        raise InvalidArgument("num_images_per_prompt", f"num_images_per_prompt={num_images_per_prompt} must be >= 1")
    return int(num_images_per_prompt)


def check_generator(generator: Any, num_images: int) -> None:
    if isinstance(generator, list) and len(generator) != num_images:
        raise InvalidArgument(
            "generator",
            f"got a list of {len(generator)} generators for {num_images} images (prompts x num_images_per_prompt); "
            f"pass one generator or a list of {num_images}"
        )


def check_latent_patches(height: int, width: int, pipe: Any) -> None:
    """Flux and Qwen-Image round height and width down to a multiple of vae_scale_factor x 2 (2x2 latent
    patches); a side below that multiple has no patch at all, and the plain pipeline fails deep inside a model
    (a conv's or a reshape's RuntimeError), so the request would fail in the engine. Raised here instead."""
    multiple = pipe.vae_scale_factor * 2
    for name, value in (("height", height), ("width", width)):
        if int(value) < multiple:
            raise InvalidArgument(
                name, f"{name}={value} is below {type(pipe).__name__}'s smallest image side, {multiple} pixels "
                f"(vae_scale_factor {pipe.vae_scale_factor} x 2x2 latent patches); pass {name} >= {multiple}"
            )


def check_latents(latents: torch.Tensor | None, expected_shape: tuple[int, ...]) -> None:
    if latents is None:
        return
    if not isinstance(latents, torch.Tensor):
        raise InvalidArgument("latents", f"latents must be a torch.Tensor, got {type(latents).__name__}")
    if tuple(latents.shape) != tuple(expected_shape):
        raise InvalidArgument(
            "latents", f"latents have shape {tuple(latents.shape)} but this call needs {tuple(expected_shape)} "
            "(images, then the pipeline's latent layout for the requested height and width)"
        )
    if not torch.isfinite(latents).all():
        raise InvalidArgument("latents", "latents contain NaN or infinite values")


def check_output_type(output_type: Any, allowed: Sequence[str] = ("pil", "np", "pt", "latent")) -> Any:
    """The output type to use: as diffusers' image processors do, any other value (e.g. the legacy "numpy")
    means "np", with diffusers' own deprecation warning, here in the caller's thread."""
    if output_type in allowed:
        return output_type
    from diffusers.utils import deprecate

    deprecate("Unsupported output_type", "1.0.0", f"the output_type {output_type} is outdated and has been set to "
              "`np`. Please make sure to set it to one of these instead: `pil`, `np`, `pt`, `latent`",
              standard_warn=False)
    return "np"


def as_list(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)
