"""Step program for StableDiffusionXLPipeline, and the UNet denoising loop it shares with Stable Diffusion 1.x/2.x.

A UNet takes a [B] timestep vector, so requests at different steps (and with different schedulers: each
request steps its own scheduler copy, DPM-Solver's `model_outputs` history included) share a forward.
Classic CFG puts the unconditional and conditional rows in the same forward; the guidance scale and
`guidance_rescale` are applied per request after the split. SDXL's pooled text embeddings and
`add_time_ids` are per-row inputs too.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, StableDiffusionXLPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_output import StableDiffusionXLPipelineOutput
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import rescale_noise_cfg, retrieve_timesteps

from ...adapters.ip_adapter import (
    IPAdapterState,
    bind_scale_setter,
    ip_image_embeds,
    ip_key_fields,
    plan_ip_adapter,
)
from ...adapters.ip_masks import batched_masks, mask_key, mask_rows, without_masks
from ...adapters.state import AdapterState, request_adapters, text_lora_scale, without_lora_scale
from ...decoders.vae import decode_alone_on_cpu, vae_decode_item
from ...engine.batch import WorkItem
from ...engine.split_reasons import named_key
from ...module_scan import execution_device
from ..callbacks import run_step_callback
from ..fused_update import FusedEuler
from ..pid.exit import PiDExit, pid_exit_decode, plan_main_size
from ..options import PlanContext
from ..checks.program import ProgramChecks, check_program_call
from ..registry import PlannedRequest, register_program, request_pipeline
from ..request_state import begin_call
from .steps import denoising_steps
from ...models.calls import freeze
from ...models.denoiser_calls import run_rows
from ...models.row_kernels import row_kernels_of
from ..checks.values import as_list, check_latents


@dataclass
class UNetCall:
    """One validated SD or SDXL call; names follow the pipelines' __call__."""

    args: dict[str, Any]
    height: int
    width: int
    num_inference_steps: int
    num_prompts: int
    num_images: int  # prompts x num_images_per_prompt
    do_cfg: bool
    pid: PiDExit | None = None  # PiD early exit (programs/pid/exit.py, SDXL only); None: VAE decode
    adapters: AdapterState | None = None  # this request's LoRA (adapters/state.py); None: the UNet has none
    ip: IPAdapterState | None = None  # this request's IP-Adapter (adapters/ip_adapter.py); None: no IP-Adapter


# names of the UNet inputs' (shape, dtype) fields in the denoise key, for stats()["splits"]
_UNET_FIELDS = ("latent size", "timestep dtype", "text length", "pooled text width", "SDXL time ids",
                "timestep_cond (guidance embedding)")


# SD and SDXL: a custom `timesteps` or `sigmas` schedule, SD-era callbacks refused
UNET_CHECKS = ProgramChecks(schedule=("timesteps", "sigmas"), legacy_callbacks=True)


@register_program(StableDiffusionXLPipeline, features=("adapters",))
def plan_sdxl(pipe: StableDiffusionXLPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate a StableDiffusionXLPipeline call in the caller's thread and return its step program."""
    args, pid, height, width = plan_main_size(pipe, args, context)
    if pid is not None and args["denoising_end"] is not None:
        raise ValueError(f"denoising_end={args['denoising_end']!r} hands the latent to a refiner; with a PiD "
                         "decoder use pid_exit_step to choose where the main model stops")
    size = check_program_call(pipe, args, height, width, UNET_CHECKS)
    steps, num_prompts, num_images = size.steps, size.num_prompts, size.num_images
    if args["prompt_embeds"] is None and args["prompt_2"] is not None:
        if len(as_list(args["prompt_2"])) != num_prompts:
            raise ValueError(f"prompt_2 has {len(as_list(args['prompt_2']))} entries for {num_prompts} prompts")
    do_cfg = args["guidance_scale"] > 1 and pipe.unet.config.time_cond_proj_dim is None
    if do_cfg and _negatives_to_encode(pipe, args):
        for name in ("negative_prompt", "negative_prompt_2"):
            count = len(_negative_texts(args, name, num_prompts))
            if count != num_prompts:
                raise ValueError(f"{name} has {count} entries for {num_prompts} prompts; pass one per prompt")
    projection_dim = (pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None
                      else int(args["pooled_prompt_embeds"].shape[-1]))
    for prefix in ("", "negative_"):  # raises ValueError when the UNet expects other added time embeddings
        original, target = args[f"{prefix}original_size"], args[f"{prefix}target_size"]
        if prefix == "" or (original is not None and target is not None):
            pipe._get_add_time_ids(original or (height, width), args[f"{prefix}crops_coords_top_left"],
                                   target or (height, width), dtype=torch.float32,
                                   text_encoder_projection_dim=projection_dim)
    check_latents(args["latents"], (num_images, pipe.unet.config.in_channels, int(height) // pipe.vae_scale_factor,
                                    int(width) // pipe.vae_scale_factor))
    call = UNetCall(args, height, width, steps, num_prompts, num_images, do_cfg, pid=pid,
                    adapters=unet_adapters(pipe, args, context), ip=plan_ip_adapter(pipe, args, do_cfg, num_images))
    rows = num_images * (2 if do_cfg else 1)
    program = sdxl_program(pipe, request_pipeline(pipe, context), call, projection_dim)
    tokens = (int(height) // pipe.vae_scale_factor) * (int(width) // pipe.vae_scale_factor)  # latent pixels
    return PlannedRequest(program=program, num_rows=rows, num_steps=steps, tokens_per_row=tokens,
                          starts_in_caller=True)


def unet_adapters(pipe, args: dict[str, Any], context: PlanContext) -> AdapterState | None:
    """The request's UNet LoRA: `adapters=` or the pipeline's active adapters, times its LoRA scale."""
    return request_adapters(pipe.unet, context.adapters, lora_scale=(args["cross_attention_kwargs"] or {}).get("scale"))


def _negatives_to_encode(pipe, args) -> bool:
    zero_out = args["negative_prompt"] is None and pipe.config.force_zeros_for_empty_prompt
    return args["negative_prompt_embeds"] is None and not zero_out


def _negative_texts(args, name: str, count: int) -> list[str]:
    """The negative prompts SDXL encodes: `negative_prompt or ""`, `negative_prompt_2 or negative_prompt`."""
    value = args[name] or args["negative_prompt"] or ""
    return [value] * count if isinstance(value, str) else list(value)


def sdxl_program(pipe: StableDiffusionXLPipeline, view: StableDiffusionXLPipeline, call: UNetCall,
                 projection_dim: int) -> Generator[WorkItem, Any, Any]:
    args = call.args
    begin_call(view, args, ("guidance_scale", "guidance_rescale", "clip_skip", "cross_attention_kwargs",
                            "denoising_end"))
    device = execution_device(pipe)
    lora_scale, text_adapters = text_lora_scale([pipe.text_encoder, pipe.text_encoder_2],
                                                (args["cross_attention_kwargs"] or {}).get("scale"))

    # 1. Text: the encoders run in batched work items; the pipeline's own encode_prompt then repeats, zeroes
    # and casts exactly as it does (it encodes nothing more: every text already has its embeddings).
    given = {name: args[name] for name in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                           "negative_pooled_prompt_embeds")}
    encoders = row_kernels_of(pipe.text_encoder, pipe.text_encoder_2)
    if given["prompt_embeds"] is None:
        texts = as_list(args["prompt"])
        run = functools.partial(_encode_text, pipe, device, args["clip_skip"], lora_scale)
        inputs = {"prompt": texts, "prompt_2": as_list(args["prompt_2"] or args["prompt"])}
        key = ("sdxl.encode", args["clip_skip"], lora_scale, text_adapters, str(device))
        given["prompt_embeds"], given["pooled_prompt_embeds"] = yield WorkItem("encode", key, inputs, run,
                                                                              rows=len(texts), row_kernels=encoders)
    if call.do_cfg and _negatives_to_encode(pipe, args):
        length = given["prompt_embeds"].shape[1]
        run = functools.partial(_encode_negative, pipe, device, length, lora_scale)
        inputs = {name: _negative_texts(args, name, call.num_prompts) for name in ("negative_prompt",
                                                                                   "negative_prompt_2")}
        key = ("sdxl.encode.negative", length, lora_scale, text_adapters, str(device))
        negative = yield WorkItem("encode", key, inputs, run, rows=call.num_prompts, row_kernels=encoders)
        given["negative_prompt_embeds"], given["negative_pooled_prompt_embeds"] = negative
    embeds, negative_embeds, pooled, negative_pooled = view.encode_prompt(
        prompt=None, device=device, num_images_per_prompt=call.num_images // call.num_prompts,
        do_classifier_free_guidance=call.do_cfg, negative_prompt=args["negative_prompt"], **given,
    )

    # 2. Timesteps (this request's own scheduler), latents, and SDXL's added conditioning.
    timesteps, num_inference_steps = retrieve_timesteps(view.scheduler, args["num_inference_steps"], device,
                                                        args["timesteps"], args["sigmas"])
    latents = view.prepare_latents(call.num_images, pipe.unet.config.in_channels, call.height, call.width,
                                   embeds.dtype, device, args["generator"], args["latents"])
    size = (call.height, call.width)
    add_time_ids = view._get_add_time_ids(args["original_size"] or size, args["crops_coords_top_left"],
                                          args["target_size"] or size, dtype=embeds.dtype,
                                          text_encoder_projection_dim=projection_dim)
    negative_time_ids = add_time_ids
    if args["negative_original_size"] is not None and args["negative_target_size"] is not None:
        negative_time_ids = view._get_add_time_ids(args["negative_original_size"],
                                                   args["negative_crops_coords_top_left"],
                                                   args["negative_target_size"], dtype=embeds.dtype,
                                                   text_encoder_projection_dim=projection_dim)
    if call.do_cfg:
        embeds = torch.cat([negative_embeds, embeds], dim=0)
        pooled = torch.cat([negative_pooled, pooled], dim=0)
        add_time_ids = torch.cat([negative_time_ids, add_time_ids], dim=0)
    # NOTE: as the pipeline does: [neg, pos] time ids repeated per image (not per branch).
    add_time_ids = add_time_ids.to(device).repeat(call.num_images, 1)
    end = args["denoising_end"]
    if end is not None and isinstance(end, float) and 0 < end < 1:
        train_steps = view.scheduler.config.num_train_timesteps
        cutoff = int(round(train_steps - end * train_steps))
        num_inference_steps = len([t for t in timesteps if t >= cutoff])
        timesteps = timesteps[:num_inference_steps]
    view._num_timesteps = len(timesteps)

    conditioning = {"prompt_embeds": embeds.to(device), "add_text_embeds": pooled.to(device),
                    "add_time_ids": add_time_ids}
    if call.ip is not None:
        bind_scale_setter(view, pipe, call.ip)
        conditioning["ip_image_embeds"] = yield from ip_image_embeds(pipe, view, call.ip, args, device,
                                                                     call.num_images, call.do_cfg)
    if call.pid is not None:  # PiD early exit: the loop runs the first K timesteps only
        timesteps = timesteps[:call.pid.exit_step]
    latents = yield from unet_denoise(view, pipe, call, latents, timesteps, conditioning)

    # 3. Decode (batched with other requests' decodes of the same size).
    if call.pid is not None:  # PiD early exit (programs/pid/exit.py): x_t and its sigma -> the requested size
        positive = conditioning["prompt_embeds"][-call.num_images:]  # rows are [negative, positive] under CFG
        watermark = None if view.watermark is None else view.watermark.apply_watermark
        image = yield from pid_exit_decode(view, call.pid, args, latents, positive, finish=watermark)
        return StableDiffusionXLPipelineOutput(images=image) if args["return_dict"] else (image,)
    if args["output_type"] == "latent":
        return StableDiffusionXLPipelineOutput(images=latents) if args["return_dict"] else (latents,)
    vae = pipe.vae
    if getattr(vae.config, "latents_mean", None) is not None and getattr(vae.config, "latents_std", None) is not None:
        mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
        latents = latents * std / vae.config.scaling_factor + mean
    else:
        latents = latents / vae.config.scaling_factor
    if vae.dtype == torch.float16 and vae.config.force_upcast:
        key = ("sdxl.decode.upcast", tuple(latents.shape[1:]), str(latents.device)) + decode_alone_on_cpu(latents)
        image = yield WorkItem("decode", key, {"latents": latents}, functools.partial(_decode_upcast, view),
                               rows=latents.shape[0])
    else:
        image = yield decode_item(vae, latents, None)  # NOTE: StableDiffusionXLPipeline decodes without generator
    if view.watermark is not None:
        image = view.watermark.apply_watermark(image)
    image = view.image_processor.postprocess(image, output_type=args["output_type"])
    return StableDiffusionXLPipelineOutput(images=image) if args["return_dict"] else (image,)


def _encode_text(pipe, device, clip_skip, lora_scale, prompt, prompt_2):
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=prompt_2, device=device,
                                              num_images_per_prompt=1, do_classifier_free_guidance=False,
                                              lora_scale=lora_scale, clip_skip=clip_skip)
    return embeds, pooled


def _encode_negative(pipe, device, length, lora_scale, negative_prompt, negative_prompt_2):
    # NOTE: the pipeline's negative path, fed placeholder positives: it only reads their count and length.
    placeholder = torch.zeros(len(negative_prompt), length, 1, device=device)
    _, negative, _, negative_pooled = pipe.encode_prompt(
        prompt=None, device=device, num_images_per_prompt=1, do_classifier_free_guidance=True,
        negative_prompt=negative_prompt, negative_prompt_2=negative_prompt_2, prompt_embeds=placeholder,
        pooled_prompt_embeds=placeholder[:, 0], lora_scale=lora_scale,
    )
    return negative, negative_pooled


def _decode_upcast(view, latents):
    # NOTE: the pipeline upcasts the fp16 VAE for the decode and casts it back; run it as one call.
    view.upcast_vae()
    try:
        latents = latents.to(next(iter(view.vae.post_quant_conv.parameters())).dtype)
        return view.vae.decode(latents, return_dict=False)[0]
    finally:
        view.vae.to(dtype=torch.float16)


def decode_item(vae, latents: torch.Tensor, generator) -> WorkItem:
    """A batched AutoencoderKL decode; other VAEs (which may sample with `generator`) decode per request.

    `generator`: what the pipeline passes to `vae.decode` (SD passes the call's; SDXL passes none).
    """
    if isinstance(vae, AutoencoderKL):  # NOTE: SDXL's pipeline moves the latents to the VAE's device first (SD's
        return vae_decode_item(vae, latents, to_vae_placement=True)  # does not; both programs keep the move)
    key = ("vae.decode.own", id(latents))
    run = functools.partial(_decode_with_generator, vae, generator)
    return WorkItem("decode", key, {"latents": latents}, run, rows=latents.shape[0])


def _decode_with_generator(vae, generator, latents):
    if generator is None:
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return vae.decode(latents.to(vae.dtype), return_dict=False, generator=generator)[0]


def unet_denoise(view, pipe, call: UNetCall, latents: torch.Tensor, timesteps: torch.Tensor,
                 conditioning: dict[str, torch.Tensor]) -> Generator[WorkItem, Any, torch.Tensor]:
    """The SD/SDXL denoising loop: one work item per step; returns the final latents.

    `conditioning` holds the CFG-concatenated `prompt_embeds` (and SDXL's `add_text_embeds`, `add_time_ids`);
    step callbacks may replace any of them, as in the pipelines.
    """
    args = call.args
    extra_step_kwargs = view.prepare_extra_step_kwargs(args["generator"], args["eta"])
    timestep_cond = None
    if pipe.unet.config.time_cond_proj_dim is not None:
        scale = torch.tensor(args["guidance_scale"] - 1).repeat(call.num_images)
        timestep_cond = view.get_guidance_scale_embedding(scale, embedding_dim=pipe.unet.config.time_cond_proj_dim)
        timestep_cond = timestep_cond.to(device=latents.device, dtype=latents.dtype)
    # NOTE: the LoRA scale is in each row's adapter weights (call.adapters), not in the shared kwargs.
    # NOTE: IP-Adapter masks are per-row inputs too (adapters/ip_masks.py).
    cross_attention_kwargs = without_masks(without_lora_scale(args["cross_attention_kwargs"])) or None
    masks = None if call.ip is None else call.ip.masks
    run = functools.partial(_denoise, pipe.unet, cross_attention_kwargs)
    solo = row_kernels_of(pipe.unet)
    if hasattr(view.scheduler, "set_begin_index"):
        view.scheduler.set_begin_index(0)
    callback = args["callback_on_step_end"]
    # NOTE: the CFG combine and Euler step run batched with the other requests' where the scheduler allows it.
    fused = FusedEuler.for_scheduler(view.scheduler, latents)
    for i, t in denoising_steps(view, timesteps, len(timesteps)):
        # NOTE: as the pipelines do, guidance is re-read every step: callbacks may change `_guidance_scale`
        # (diffusers' CFG-cutoff callbacks set it to 0 and keep only the conditional rows).
        do_cfg = view.do_classifier_free_guidance
        branches = 2 if do_cfg else 1
        model_input = torch.cat([latents] * branches) if branches > 1 else latents
        if hasattr(view.scheduler, "scale_model_input"):
            model_input = view.scheduler.scale_model_input(model_input, t)
        # NOTE: the UNet embeds timesteps as float32 either way; int timesteps (DPM) batch with float ones.
        timestep = t.to(model_input.device).float().expand(model_input.shape[0])
        inputs = {
            "sample": model_input,
            "timestep": timestep,
            "encoder_hidden_states": conditioning["prompt_embeds"],
            "text_embeds": conditioning.get("add_text_embeds"),
            "time_ids": conditioning.get("add_time_ids"),
            "timestep_cond": None if timestep_cond is None else timestep_cond.repeat(branches, 1),
        }
        shapes = [None if v is None else (tuple(v.shape[1:]), v.dtype) for v in inputs.values()]
        key = named_key(program="unet", **dict(zip(_UNET_FIELDS, shapes)),
                        cross_attention_kwargs=freeze(cross_attention_kwargs), device=str(model_input.device))
        inputs["lora"] = [call.adapters] * model_input.shape[0]
        image_embeds = conditioning.get("ip_image_embeds")
        if image_embeds is not None and not do_cfg and call.do_cfg:  # a CFG cutoff kept the conditional rows
            image_embeds = [e[e.shape[0] // 2:] for e in image_embeds]
        if image_embeds is not None:  # per row: a tuple with one tensor per IP-Adapter
            key += ip_key_fields(call.ip, [tuple(e.shape[1:]) for e in image_embeds])
            key += named_key(**{"ip_adapter: masks (shapes, or none)": mask_key(masks)})
        inputs["image_embeds"] = (None if image_embeds is None else
                                  [tuple(e[r] for e in image_embeds) for r in range(model_input.shape[0])])
        inputs["ip_scales"] = [None if call.ip is None else call.ip.row()] * model_input.shape[0]
        first_row = model_input.shape[0] if call.do_cfg and not do_cfg else 0  # a CFG cutoff: conditional half
        inputs["ip_masks"] = mask_rows(masks, model_input.shape[0], first_row)
        noise_pred = yield WorkItem("denoise", key, inputs, run, rows=model_input.shape[0], step=i,
                                    row_kernels=solo)
        noise_uncond = scale = None
        if do_cfg:
            noise_uncond, noise_pred = noise_pred.chunk(2)
            scale = view.guidance_scale
            if view.guidance_rescale > 0.0 or fused is None:  # combined here; the Euler step may be shared
                noise_text = noise_pred
                noise_pred = noise_uncond + scale * (noise_text - noise_uncond)
                if view.guidance_rescale > 0.0:
                    noise_pred = rescale_noise_cfg(noise_pred, noise_text, guidance_rescale=view.guidance_rescale)
                noise_uncond = scale = None
        if fused is not None:
            latents = yield from fused.step(t, latents, noise_pred, noise_uncond, scale)
        else:
            latents = view.scheduler.step(noise_pred, t, latents, **extra_step_kwargs, return_dict=False)[0]
        if callback is not None:
            tensors = {"latents": latents, **conditioning}
            callback_kwargs = {name: tensors[name] for name in args["callback_on_step_end_tensor_inputs"]}
            outputs = run_step_callback(callback, view, i, t, callback_kwargs)
            latents = outputs.pop("latents", latents)
            conditioning.update({name: value for name, value in outputs.items() if name in conditioning})
    return latents


def _denoise(unet, cross_attention_kwargs, sample, timestep, encoder_hidden_states, text_embeds, time_ids,
             timestep_cond, lora, image_embeds, ip_scales, ip_masks):
    added = None if text_embeds is None else {"text_embeds": text_embeds, "time_ids": time_ids}
    if image_embeds is not None:
        added = dict(added or {}, image_embeds=[torch.stack(rows) for rows in zip(*image_embeds)])
    masks = batched_masks(ip_masks)
    if masks is not None:
        cross_attention_kwargs = dict(cross_attention_kwargs or {}, ip_adapter_masks=masks)
    arguments = dict(sample=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                     timestep_cond=timestep_cond, cross_attention_kwargs=cross_attention_kwargs,
                     added_cond_kwargs=added, return_dict=False)
    return run_rows(unet, arguments, lora=lora, ip_scales=ip_scales)[0]
