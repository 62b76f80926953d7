"""Step program for StableDiffusionPipeline (SD 1.x / 2.x): its __call__ as a resumable generator.

The denoising loop is the UNet loop SDXL uses (`sdxl.unet_denoise`): per-row timesteps, CFG rows in one
forward, guidance scale and `guidance_rescale` per request, each request stepping its own scheduler copy.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import torch
from diffusers import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_output import StableDiffusionPipelineOutput
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

from ...adapters.ip_adapter import bind_scale_setter, ip_image_embeds, plan_ip_adapter
from ...adapters.state import text_lora_scale
from ...engine.batch import WorkItem
from ...module_scan import execution_device
from ...models.row_kernels import row_kernels_of
from ..options import PlanContext
from ..checks.program import check_program_call
from ..registry import PlannedRequest, register_program, request_pipeline
from ..request_state import begin_call
from .sdxl import UNET_CHECKS, UNetCall, decode_item, unet_adapters, unet_denoise
from ..checks.values import as_list, check_latents


@register_program(StableDiffusionPipeline, features=("adapters",))
def plan_sd(pipe: StableDiffusionPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate a StableDiffusionPipeline call in the caller's thread and return its step program."""
    height, width = args["height"], args["width"]
    if not height or not width:
        size = pipe.unet.config.sample_size
        height, width = (size, size) if isinstance(size, int) else size[:2]
        height, width = height * pipe.vae_scale_factor, width * pipe.vae_scale_factor
    size = check_program_call(pipe, args, height, width, UNET_CHECKS)
    steps, num_prompts, num_images = size.steps, size.num_prompts, size.num_images
    do_cfg = args["guidance_scale"] > 1 and pipe.unet.config.time_cond_proj_dim is None
    negative = args["negative_prompt"]
    if do_cfg and args["negative_prompt_embeds"] is None and negative is not None:
        if args["prompt"] is not None and type(args["prompt"]) is not type(negative):
            raise ValueError(f"negative_prompt is a {type(negative).__name__} but prompt is a "
                             f"{type(args['prompt']).__name__}; pass both as lists or both as str")
        if len(as_list(negative)) != num_prompts:
            raise ValueError(f"negative_prompt has {len(as_list(negative))} entries for {num_prompts} prompts")
    check_latents(args["latents"], (num_images, pipe.unet.config.in_channels, int(height) // pipe.vae_scale_factor,
                                    int(width) // pipe.vae_scale_factor))
    call = UNetCall(args, height, width, steps, num_prompts, num_images, do_cfg,
                    adapters=unet_adapters(pipe, args, context), ip=plan_ip_adapter(pipe, args, do_cfg, num_images))
    rows = num_images * (2 if do_cfg else 1)
    tokens = (int(height) // pipe.vae_scale_factor) * (int(width) // pipe.vae_scale_factor)  # latent pixels
    program = sd_program(pipe, request_pipeline(pipe, context), call)
    return PlannedRequest(program=program, num_rows=rows, num_steps=steps,
                          tokens_per_row=tokens, starts_in_caller=True)


def sd_program(pipe: StableDiffusionPipeline, view: StableDiffusionPipeline,
               call: UNetCall) -> Generator[WorkItem, Any, Any]:
    args = call.args
    begin_call(view, args, ("guidance_scale", "guidance_rescale", "clip_skip", "cross_attention_kwargs"))
    device = execution_device(pipe)
    lora_scale = (args["cross_attention_kwargs"] or {}).get("scale")
    lora_scale, text_adapters = text_lora_scale([pipe.text_encoder], lora_scale)

    # 1. Text: the encoder runs in batched work items; the pipeline's own encode_prompt then repeats and
    # casts exactly as it does (it encodes nothing more).
    embeds, negative = args["prompt_embeds"], args["negative_prompt_embeds"]
    encoder = row_kernels_of(pipe.text_encoder)
    if embeds is None:
        texts = as_list(args["prompt"])
        key = ("sd.encode", args["clip_skip"], lora_scale, text_adapters, str(device))
        run = functools.partial(_encode_text, pipe, device, args["clip_skip"], lora_scale)
        embeds = yield WorkItem("encode", key, {"prompt": texts}, run, rows=len(texts), row_kernels=encoder)
    if call.do_cfg and negative is None:
        texts = as_list(args["negative_prompt"]) or [""] * call.num_prompts
        key = ("sd.encode.negative", embeds.shape[1], lora_scale, text_adapters, str(device))
        run = functools.partial(_encode_negative, pipe, device, embeds.shape[1], lora_scale)
        negative = yield WorkItem("encode", key, {"negative_prompt": texts}, run, rows=len(texts), row_kernels=encoder)
    embeds, negative = view.encode_prompt(None, device, call.num_images // call.num_prompts, call.do_cfg,
                                          prompt_embeds=embeds, negative_prompt_embeds=negative)

    # 2. This request's own scheduler and timesteps, and its latents (as the pipeline does).
    timesteps, _ = retrieve_timesteps(view.scheduler, args["num_inference_steps"], device, args["timesteps"],
                                      args["sigmas"])
    latents = view.prepare_latents(call.num_images, pipe.unet.config.in_channels, call.height, call.width,
                                   embeds.dtype, device, args["generator"], args["latents"])
    view._num_timesteps = len(timesteps)
    conditioning = {"prompt_embeds": torch.cat([negative, embeds]) if call.do_cfg else embeds,
                    "negative_prompt_embeds": negative}
    if call.ip is not None:
        bind_scale_setter(view, pipe, call.ip)
        conditioning["ip_image_embeds"] = yield from ip_image_embeds(pipe, view, call.ip, args, device,
                                                                     call.num_images, call.do_cfg)
    latents = yield from unet_denoise(view, pipe, call, latents, timesteps, conditioning)

    # 3. Decode (batched with other requests' decodes of the same size), then the safety checker if any.
    nsfw = None
    if args["output_type"] == "latent":
        image = latents
    else:
        image = yield decode_item(pipe.vae, latents / pipe.vae.config.scaling_factor, args["generator"])
        image, nsfw = view.run_safety_checker(image, device, embeds.dtype)
    denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
    image = view.image_processor.postprocess(image, output_type=args["output_type"], do_denormalize=denormalize)
    if not args["return_dict"]:
        return image, nsfw
    return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=nsfw)


def _encode_text(pipe, device, clip_skip, lora_scale, prompt):
    return pipe.encode_prompt(prompt, device, 1, False, lora_scale=lora_scale, clip_skip=clip_skip)[0]


def _encode_negative(pipe, device, length, lora_scale, negative_prompt):
    # NOTE: the pipeline's negative path, fed placeholder positives: it only reads their count and length.
    placeholder = torch.zeros(len(negative_prompt), length, 1, device=device)
    return pipe.encode_prompt(None, device, 1, True, negative_prompt=negative_prompt, prompt_embeds=placeholder,
                              lora_scale=lora_scale)[1]
