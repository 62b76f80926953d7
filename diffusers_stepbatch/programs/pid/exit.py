"""PiD early exit for step programs: stop the main model at step K and let PiD decode its x_t at full size.

With `StepBatched(pipe, decoder=..., pid_exit_step=K)` the main model runs K of its N steps (default N - 2) at
1/sr_scale of the requested size; PiD turns that x_t and its `scheduler.sigmas[K]` into the full-size image. A
program plans with `plan_pid_exit` (in the caller's thread), stops its loop at `pid.exit_step` and decodes with
`pid_exit_decode` in place of the VAE:

>>> pid = plan_pid_exit(pipe, args, context)                      # None when the engine has no PiD decoder
>>> image = yield from pid_exit_decode(view, pid, args, latents, prompt_embeds)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from ...cache.prompt import PromptCache, cached_encode
from ...decoders.pid.work import pid_decode_item, pid_text_item, pid_text_namespace
from ...decoders.registry import PiDDecoding
from ...engine.batch import WorkItem
from ..options import PlanContext
from .families import PiDFamily, pid_family, pid_pipelines
from ..checks.values import as_list, check_num_images_per_prompt, check_num_inference_steps


def check_pid_pipeline(pipe: Any, decoding: PiDDecoding) -> None:
    """At engine construction: the pipeline has an early-exit program and the decoder fits its latent space."""
    family = pid_family(pipe)
    if family is None:
        raise ValueError(f"PiD decoding is implemented for {pid_pipelines()}, not {type(pipe).__name__}")
    if family.check_scheduler is not None:
        family.check_scheduler(pipe)
    decoder = decoding.decoder
    channels = family.latent_channels(pipe)
    if decoder.lq_latent_channels != channels:
        raise ValueError(
            f"the PiD decoder reads {decoder.lq_latent_channels}-channel latents, {type(pipe).__name__}'s VAE has "
            f"{channels}; use a PiD checkpoint trained for this pipeline"
        )
    down = family.latent_down_factor(pipe)
    if decoder.latent_spatial_down_factor != down:
        raise ValueError(
            f"the PiD decoder's latent_spatial_down_factor={decoder.latent_spatial_down_factor} differs from the "
            f"pipeline's latent downsampling {down} (from its vae_scale_factor={pipe.vae_scale_factor}); use a PiD "
            "checkpoint trained for this pipeline"
        )
    if decoding.uses_pipeline_text and family.text_dim is None:
        raise ValueError(
            f"text_encoder='pipeline' is not supported for {type(pipe).__name__}: its prompt embeddings are not one "
            "[B, L, D] tensor; pass a caption encoder (the default PiDTextEncoder)"
        )
    if decoding.uses_pipeline_text:
        dim = family.text_dim(pipe)
        if decoding.txt_embed_dim != dim:
            raise ValueError(
                f"text_encoder='pipeline' gives {dim}-dim prompt embeddings but the PiD decoder expects "
                f"txt_embed_dim={decoding.txt_embed_dim}; pass its own text encoder"
            )


@dataclass(frozen=True)
class PiDExit:
    """One request's early exit: K, the output size, the size the main model runs at, its family's conventions."""

    decoding: PiDDecoding
    exit_step: int
    height: int
    width: int
    main_height: int
    main_width: int
    family: PiDFamily
    prompt_cache: PromptCache | None = None


def plan_main_size(pipe: Any, args: dict[str, Any], context: PlanContext
                   ) -> tuple[dict[str, Any], PiDExit | None, int, int]:
    """The dedicated programs' opening: (args, PiD early exit or None, height, width) of the main model's call,
    which with PiD runs at 1/sr_scale of the requested size; sizes default to the pipeline's sample size."""
    pid = plan_pid_exit(pipe, args, context)
    if pid is not None:
        args = {**args, "height": pid.main_height, "width": pid.main_width}
    default = pipe.default_sample_size * pipe.vae_scale_factor
    return args, pid, args["height"] or default, args["width"] or default


def plan_pid_exit(pipe: Any, args: dict[str, Any], context: PlanContext) -> PiDExit | None:
    """Validate a call for PiD early exit (in the caller's thread); None when the engine decodes with the VAE."""
    options = context.pid
    if options is None:
        return None
    family = pid_family(pipe)
    if family.check_scheduler is not None:
        family.check_scheduler(pipe)  # NOTE: again at submit: pipe.scheduler may have been swapped since
    decoder = options.decoding.decoder
    sr_scale = decoder.sr_scale
    main_multiple = family.size_multiple(pipe)
    multiple = math.lcm(sr_scale * main_multiple, decoder.patch_size)
    size = {}
    for name in ("height", "width"):
        value = args[name] or family.default_size(pipe)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
        if value % multiple:
            raise ValueError(
                f"{name}={value} must be divisible by {multiple} for PiD decoding: the main model runs at 1/"
                f"sr_scale={sr_scale} of it, in multiples of {main_multiple}, "
                f"and PiD's output is in {decoder.patch_size}-pixel patches"
            )
        size[name] = int(value)
    if args["output_type"] == "latent":
        raise ValueError("output_type='latent' skips decoding, but this engine decodes with PiD; use 'pil', 'np' or 'pt'")
    schedule = next((args[name] for name in ("timesteps", "sigmas") if args.get(name) is not None), None)
    steps = check_num_inference_steps(args["num_inference_steps"], schedule)
    exit_step = options.step_for(steps)
    if not options.decoding.uses_pipeline_text and args["prompt"] is None:
        raise ValueError("PiD's text encoder needs the caption: pass prompt=..., not only prompt_embeds")
    return PiDExit(options.decoding, exit_step, size["height"], size["width"],
                   size["height"] // sr_scale, size["width"] // sr_scale, family, context.options.prompt_cache)


def pid_exit_decode(
    view: Any,
    pid: PiDExit,
    args: dict[str, Any],
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    cache: PromptCache | None = None,
    *,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Generator[WorkItem, Any, Any]:
    """Decode the denoiser's latents after `pid.exit_step` steps with PiD; returns the postprocessed images.

    `view` is the request's pipeline view (its scheduler has run exactly K steps), `latents` the denoiser's own
    (packed for Flux and Qwen-Image), `prompt_embeds` the positive prompt embeddings, one row per image (used when
    the decoder reads the pipeline's text). `cache` defaults to the prompt cache the call was planned with;
    `finish` runs on the [-1, 1] images before postprocessing (SDXL's watermark).
    """
    lq_latent, sigma = pid.family.to_pid(view, latents, pid.exit_step, pid.main_height, pid.main_width)
    images = lq_latent.shape[0]
    cache = cache if cache is not None else pid.prompt_cache
    decoding = pid.decoding
    if decoding.uses_pipeline_text:
        text = prompt_embeds
    else:
        per_prompt = check_num_images_per_prompt(args["num_images_per_prompt"])
        prompts = as_list(args["prompt"])
        encoder = decoding.text_encoder
        (encoded,) = yield from cached_encode(
            cache, pid_text_namespace(encoder), prompts, lambda texts: pid_text_item(encoder, texts)
        )
        text = encoded.repeat_interleave(per_prompt, dim=0)
    # NOTE: each image draws PiD's noise from its own generator (or its request's one), continuing the stream the
    # latents came from, so the decode of a request does not depend on who shares the batch.
    generator = args["generator"]
    generators = list(generator) if isinstance(generator, list) else [generator] * images
    image = yield pid_decode_item(decoding, lq_latent, sigma, text, generators, height=pid.height, width=pid.width)
    if finish is not None:
        image = finish(image)
    return view.image_processor.postprocess(image, output_type=args["output_type"])
