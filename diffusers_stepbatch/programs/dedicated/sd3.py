"""Step program for StableDiffusion3Pipeline (SD3, SD3.5): its __call__ as a resumable generator.

Classic CFG runs the unconditional and conditional rows in one transformer forward, and the guidance scale is
applied per request after the split, so requests with different scales share a forward. The timestep is a
per-row input (raw, 0..1000). Skip-layer guidance adds a third row group (the conditional rows again) whose
forward skips blocks; `skip_layers` applies to a whole forward, so each row carries its skip set and the
batched call runs one forward per distinct set: rows share a forward only with rows that skip the same layers.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    StableDiffusion3PipelineOutput,
    calculate_shift,
    retrieve_timesteps,
)

from ...adapters.ip_adapter import IPAdapterState, bind_scale_setter, ip_key_fields
from ...adapters.lora import lora_layers
from ...adapters.sd3_ip_adapter import plan_sd3_ip_adapter, sd3_ip_image_embeds
from ...adapters.state import (
    AdapterState,
    request_adapters,
    text_lora_scale,
    without_lora_scale,
)
from ...decoders.vae import vae_decode_item
from ...engine.batch import Packable, WorkItem
from ...engine.split_reasons import named_key
from ...module_scan import execution_device
from ...models.packing.attention import check_can_run as check_packed_attention_runs
from ...models.packing.support import extra_attention_kwargs, packing_refused
from ..callbacks import run_step_callback
from ..fused_update import FusedEuler
from ..options import PlanContext
from ..pid.exit import PiDExit, pid_exit_decode, plan_main_size
from ..checks.program import ProgramChecks, check_program_call
from ..registry import PlannedRequest, register_program, request_pipeline
from ..request_state import begin_call
from .steps import denoising_steps
from ...models import support_for
from ...models.calls import freeze
from ...models.denoiser_calls import run_packed, run_rows
from ...models.row_kernels import row_kernels_of
from ..checks.values import (
    check_latents,
    check_num_images_per_prompt,
)

# names of the denoise key's fields shared with packed calls, for stats()["splits"]
_SHARED_FIELDS = ("pooled text width", "joint_attention_kwargs", "latent dtype", "text dtype", "device")


@dataclass
class SD3Call:
    """One validated StableDiffusion3Pipeline call; names follow StableDiffusion3Pipeline.__call__."""

    args: dict[str, Any]
    height: int
    width: int
    num_inference_steps: int
    num_prompts: int
    num_images: int  # prompts x num_images_per_prompt
    do_cfg: bool
    pid: PiDExit | None = None  # PiD early exit (programs/pid/exit.py); None: VAE decode
    adapters: AdapterState | None = None  # this request's LoRA (adapters/state.py); None: the model has none
    ip: IPAdapterState | None = None  # this request's IP-Adapter (adapters/sd3_ip_adapter.py); None: none loaded
    packed_attention: str = "auto"  # the StepBatched option (models/packing/attention.py)


@register_program(StableDiffusion3Pipeline, features=("adapters",))
def plan_sd3(pipe: StableDiffusion3Pipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate a StableDiffusion3Pipeline call in the caller's thread and return its step program."""
    args, pid, height, width = plan_main_size(pipe, args, context)
    size = check_program_call(pipe, args, height, width, ProgramChecks(embeds_as_given="StableDiffusion3Pipeline"))
    steps, num_prompts, num_images = size.steps, size.num_prompts, size.num_images
    if args["prompt_embeds"] is None:
        for name in ("prompt_2", "prompt_3"):
            _texts(args[name] or args["prompt"], num_prompts, name)
    do_cfg = args["guidance_scale"] > 1
    if do_cfg and args["negative_prompt_embeds"] is None:
        negative = args["negative_prompt"] or ""
        for name in ("negative_prompt", "negative_prompt_2", "negative_prompt_3"):
            _texts(args[name] or negative, num_prompts, name, repeat_str=True)
    skip = args["skip_guidance_layers"]
    if skip is not None and not all(isinstance(layer, int) for layer in skip):
        raise ValueError(f"skip_guidance_layers={skip!r} must be a list of transformer block indices (ints)")
    channels = pipe.transformer.config.in_channels
    check_latents(args["latents"], (num_images, channels, int(height) // pipe.vae_scale_factor,
                                    int(width) // pipe.vae_scale_factor))
    adapters = request_adapters(pipe.transformer, context.adapters,
                                lora_scale=(args["joint_attention_kwargs"] or {}).get("scale"))
    call = SD3Call(args, height, width, steps, num_prompts, num_images, do_cfg, pid=pid, adapters=adapters,
                   ip=plan_sd3_ip_adapter(pipe, args, do_cfg),
                   packed_attention=context.options.packed_attention)
    # NOTE: "varlen" with a CPU or float32 model is refused here, in the caller, not in a packed call.
    check_packed_attention_runs(call.packed_attention, pipe.transformer)
    rows = num_images * ((3 if skip is not None else 2) if do_cfg else 1)
    patch = pipe.vae_scale_factor * pipe.transformer.config.patch_size
    tokens = (int(height) // patch) * (int(width) // patch)
    program = sd3_program(pipe, request_pipeline(pipe, context), call)
    return PlannedRequest(program=program, num_rows=rows, num_steps=steps,
                          tokens_per_row=tokens, starts_in_caller=True)


def _texts(value: str | list[str], count: int, name: str, repeat_str: bool = False) -> list[str]:
    """`value` as a list of `count` prompts; the pipeline repeats a str only for negative prompts."""
    texts = ([value] * (count if repeat_str else 1)) if isinstance(value, str) else list(value)
    if len(texts) != count:
        raise ValueError(f"{name} has {len(texts)} entries for {count} prompts; pass one per prompt")
    return texts


def sd3_program(pipe: StableDiffusion3Pipeline, view: StableDiffusion3Pipeline,
                call: SD3Call) -> Generator[WorkItem, Any, Any]:
    args = call.args
    begin_call(view, args, ("guidance_scale", "skip_layer_guidance_scale", "clip_skip", "joint_attention_kwargs"))
    device = execution_device(pipe)
    per_prompt = check_num_images_per_prompt(args["num_images_per_prompt"])
    lora_scale = (view._joint_attention_kwargs or {}).get("scale")
    # NOTE: the LoRA scale is in each row's adapter weights (call.adapters), not in the shared kwargs.
    jak = without_lora_scale(view._joint_attention_kwargs) or None
    # A module scan before the first work item, so that it runs in the caller's thread (`start_in_caller`).
    packing_reason = (("an IP-Adapter is loaded (its image tokens are not wired into packed forwards)"
                       if call.ip is not None else None)
                      or support_for(pipe.transformer, through_compile=True).packing.unsupported(pipe.transformer)
                      or extra_attention_kwargs(jak, "joint_attention_kwargs"))

    # 1. Text: [positive] or [positive, negative], repeated for num_images_per_prompt.
    embeds, pooled = yield from _encode(pipe, call, per_prompt, device, lora_scale)
    prompt_embeds, pooled_embeds = embeds[0], pooled[0]
    if call.do_cfg:
        prompt_embeds = torch.cat([embeds[1], embeds[0]], dim=0)
        pooled_embeds = torch.cat([pooled[1], pooled[0]], dim=0)

    # 1b. Image prompt (IP-Adapter): embeddings per row; the image is encoded in a batched work item.
    ip_embeds = None
    if call.ip is not None:
        bind_scale_setter(view, pipe, call.ip)
        ip_embeds = yield from sd3_ip_image_embeds(pipe, view, call.ip, args, device, call.num_images, call.do_cfg)

    # 2. Latents, this request's own scheduler and timesteps (as StableDiffusion3Pipeline.__call__ does).
    latents = view.prepare_latents(
        call.num_images, pipe.transformer.config.in_channels, call.height, call.width, prompt_embeds.dtype,
        device, args["generator"], args["latents"],
    )
    scheduler_kwargs, mu = {}, args["mu"]
    config = view.scheduler.config
    if config.get("use_dynamic_shifting", None) and mu is None:
        patch = pipe.transformer.config.patch_size
        mu = calculate_shift(
            (latents.shape[2] // patch) * (latents.shape[3] // patch), config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.16),
        )
    if mu is not None:
        scheduler_kwargs["mu"] = mu
    timesteps, num_inference_steps = retrieve_timesteps(
        view.scheduler, call.num_inference_steps, device, sigmas=args["sigmas"], **scheduler_kwargs
    )
    view._num_timesteps = len(timesteps)
    # NOTE: the pipeline lets the scheduler find its first step index from the first timestep, a device read;
    # index 0 is the same whenever the first sigma is not repeated (always, but for custom `sigmas` that say so).
    custom = args["sigmas"]
    if hasattr(view.scheduler, "set_begin_index") and (custom is None or list(custom).count(custom[0]) == 1):
        view.scheduler.set_begin_index(0)

    shared_key = (tuple(pooled_embeds.shape[1:]), freeze(jak), latents.dtype, prompt_embeds.dtype, str(latents.device))
    key = named_key(program="sd3", **{"latent size": tuple(latents.shape[1:]),
                                      "text length": tuple(prompt_embeds.shape[1:])},
                    **dict(zip(_SHARED_FIELDS, shared_key)))
    patch = pipe.transformer.config.patch_size
    tokens = (latents.shape[2] // patch) * (latents.shape[3] // patch) + prompt_embeds.shape[1]
    if ip_embeds is not None:  # rows of one forward share the IP processors and image-embedding shapes
        key += ip_key_fields(call.ip, [tuple(ip_embeds.shape[1:])])
    pack = _packable(packing_reason, pipe.transformer, jak, shared_key, tokens, call.packed_attention)
    skip_layers = args["skip_guidance_layers"]
    denoise = functools.partial(_denoise, pipe.transformer, jak)
    solo = row_kernels_of(pipe.transformer)

    # 3. Denoising loop: one work item per step; rows are [uncond, cond] under CFG, plus [cond, skipping
    # layers] while skip-layer guidance is active.
    callback = args["callback_on_step_end"]
    # NOTE: the CFG combine and Euler step run batched with the other requests' where the scheduler allows it.
    fused = FusedEuler.for_scheduler(view.scheduler, latents)
    for i, t in denoising_steps(view, timesteps, num_inference_steps, call.pid):  # up to PiD's exit (step 4)
        images = latents.shape[0]
        # NOTE: re-read every step, as the pipeline does: callbacks may change `_guidance_scale`.
        do_cfg = view.do_classifier_free_guidance
        start, stop = args["skip_layer_guidance_start"], args["skip_layer_guidance_stop"]
        skipping = (do_cfg and skip_layers is not None
                    and num_inference_steps * start < i < num_inference_steps * stop)
        hidden, text, text_pooled = [latents] * (2 if do_cfg else 1), [prompt_embeds], [pooled_embeds]
        skips = [None] * len(hidden) * images
        if skipping:  # the conditional rows again, with the pipeline's original (pre-callback) embeddings
            hidden, text, text_pooled = hidden + [latents], text + [embeds[0]], text_pooled + [pooled[0]]
            skips += [tuple(skip_layers)] * images
        inputs = {
            "hidden_states": torch.cat(hidden),
            "timestep": t.expand(len(skips)),
            "encoder_hidden_states": torch.cat(text),
            "pooled_projections": torch.cat(text_pooled),
            "skip_layers": skips,
            "lora": [call.adapters] * len(skips),
            **_ip_rows(call, ip_embeds, do_cfg, images, len(skips)),
        }
        output = yield WorkItem("denoise", key, inputs, denoise, rows=len(skips), step=i, pack=pack,
                                row_kernels=solo)
        noise_pred, noise_uncond, scale = output, None, None
        if do_cfg:
            noise_uncond, noise_pred = output[:images], output[images:2 * images]
            scale = view.guidance_scale
            if skipping:  # the skip-layer term: combined here, only the Euler step is shared
                noise_text, noise_skip = noise_pred, output[2 * images:]
                noise_pred = noise_uncond + scale * (noise_text - noise_uncond)
                noise_pred = noise_pred + (noise_text - noise_skip) * view._skip_layer_guidance_scale
                noise_uncond = scale = None
        if fused is not None:
            latents = yield from fused.step(t, latents, noise_pred, noise_uncond, scale)
        else:
            if noise_uncond is not None:
                noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
            latents = view.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if callback is not None:
            tensors = {"latents": latents, "prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled_embeds}
            callback_kwargs = {name: tensors[name] for name in args["callback_on_step_end_tensor_inputs"]}
            outputs = run_step_callback(callback, view, i, t, callback_kwargs)
            latents = outputs.pop("latents", latents)
            prompt_embeds = outputs.pop("prompt_embeds", prompt_embeds)
            pooled_embeds = outputs.pop("pooled_prompt_embeds", pooled_embeds)

    # 4. Decode (batched with other requests' decodes of the same size).
    if call.pid is not None:  # PiD early exit (programs/pid/exit.py): x_t and its sigma -> the requested size
        image = yield from pid_exit_decode(view, call.pid, args, latents, embeds[0])
        return StableDiffusion3PipelineOutput(images=image) if args["return_dict"] else (image,)
    if args["output_type"] == "latent":
        image = latents
    else:
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = yield vae_decode_item(pipe.vae, latents)
        image = view.image_processor.postprocess(image, output_type=args["output_type"])
    return StableDiffusion3PipelineOutput(images=image) if args["return_dict"] else (image,)


@dataclass
class _Branch:
    """One CFG branch of a request's text: prompts to encode (with their clip_skip) or given embeddings."""

    texts: tuple[list[str], list[str], list[str]] | None = None
    clip_skip: int | None = None
    embeds: torch.Tensor | None = None
    pooled: torch.Tensor | None = None


def _encode(pipe, call: SD3Call, per_prompt: int, device, lora_scale):
    """Yield encode items for the prompts that need encoding; return ([embeds...], [pooled...]).

    Lists hold the positive branch, then the negative one under CFG. The pipeline encodes negatives without
    clip_skip, so with clip_skip set the two branches are two encode items (each batches with other requests).
    """
    args, n = call.args, call.num_prompts
    lora_scale, text_adapters = text_lora_scale([pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3],
                                                lora_scale)
    if args["prompt_embeds"] is not None:
        branches = [_Branch(embeds=args["prompt_embeds"], pooled=args["pooled_prompt_embeds"])]
    else:
        texts = tuple(_texts(args[name] or args["prompt"], n, name) for name in ("prompt", "prompt_2", "prompt_3"))
        branches = [_Branch(texts, args["clip_skip"])]
    if call.do_cfg and args["negative_prompt_embeds"] is not None:
        branches.append(_Branch(embeds=args["negative_prompt_embeds"], pooled=args["negative_pooled_prompt_embeds"]))
    elif call.do_cfg:
        negative = args["negative_prompt"] or ""
        texts = tuple(_texts(args[name] or negative, n, name, repeat_str=True)
                      for name in ("negative_prompt", "negative_prompt_2", "negative_prompt_3"))
        branches.append(_Branch(texts, clip_skip=None))

    to_encode = [branch for branch in branches if branch.texts is not None]
    for clip_skip in dict.fromkeys(branch.clip_skip for branch in to_encode):
        group = [branch for branch in to_encode if branch.clip_skip == clip_skip]
        inputs = {name: sum((branch.texts[j] for branch in group), []) for j, name in
                  enumerate(("prompt", "prompt_2", "prompt_3"))}
        run = functools.partial(_encode_text, pipe, device, args["max_sequence_length"], clip_skip, lora_scale)
        key = ("sd3.encode", args["max_sequence_length"], clip_skip, lora_scale, text_adapters, str(device))
        out_embeds, out_pooled = yield WorkItem("encode", key, inputs, run, rows=len(inputs["prompt"]),
                                                row_kernels=row_kernels_of(pipe.text_encoder, pipe.text_encoder_2,
                                                                           pipe.text_encoder_3))
        start = 0
        for branch in group:
            end = start + len(branch.texts[0])
            branch.embeds = out_embeds[start:end].repeat_interleave(per_prompt, dim=0)
            branch.pooled = out_pooled[start:end].repeat_interleave(per_prompt, dim=0)
            start = end
    return [branch.embeds.to(device) for branch in branches], [branch.pooled.to(device) for branch in branches]


def _encode_text(pipe, device, max_sequence_length, clip_skip, lora_scale, prompt, prompt_2, prompt_3):
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompt, prompt_2=prompt_2, prompt_3=prompt_3, device=device, num_images_per_prompt=1,
        do_classifier_free_guidance=False, clip_skip=clip_skip, max_sequence_length=max_sequence_length,
        lora_scale=lora_scale,
    )
    return embeds, pooled


def _ip_rows(call: SD3Call, ip_embeds: torch.Tensor | None, do_cfg: bool, images: int, rows: int) -> dict[str, Any]:
    """Each row's IP-Adapter image embeddings and scales (None without an IP-Adapter)."""
    if ip_embeds is None:
        return {"ip_embeds": None, "ip_scales": [None] * rows}
    if call.do_cfg and not do_cfg:  # a CFG cutoff kept the conditional rows
        ip_embeds = ip_embeds[images:]
    if rows > ip_embeds.shape[0]:  # skip-layer rows (only without an image prompt: zero embeddings at scale 0)
        ip_embeds = torch.cat([ip_embeds, ip_embeds[-images:]])
    return {"ip_embeds": ip_embeds, "ip_scales": [call.ip.row()] * rows}


def _packable(reason, transformer, joint_attention_kwargs, shared_key, tokens,
              packed_attention) -> Packable | None:
    """Rows of other latent sizes and text lengths may share this request's forwards, unless `reason` forbids."""
    if packing_refused("StableDiffusion3Pipeline", reason):
        return None
    run = functools.partial(_packed_denoise, transformer, joint_attention_kwargs, packed_attention)
    return Packable(key=("sd3.packed", packed_attention, *shared_key), run=run, tokens=tokens)


def _packed_denoise(transformer, joint_attention_kwargs, packed_attention, shapes):
    """One packed forward per distinct skip set, each over that set's rows of every shape."""
    packing, per_row_lora = support_for(transformer, through_compile=True).packing, bool(lora_layers(transformer))
    outputs = [None] * len(shapes)
    for skip in dict.fromkeys(skip for _, inputs in shapes for skip in inputs["skip_layers"]):
        picked = []  # (shape, its rows in this skip set as a tensor and a list, those rows' inputs)
        for index, (_, inputs) in enumerate(shapes):
            rows = [r for r, row_skip in enumerate(inputs["skip_layers"]) if row_skip == skip]
            if rows:
                picked.append((index, torch.tensor(rows, device=inputs["hidden_states"].device), rows, inputs))
        parts = [_picked_rows(inputs, rows, numbers) for _, rows, numbers, inputs in picked]
        calls = [dict(hidden_states=part["hidden_states"], encoder_hidden_states=part["encoder_hidden_states"],
                      pooled_projections=part["pooled_projections"], timestep=part["timestep"],
                      joint_attention_kwargs=joint_attention_kwargs, skip_layers=None if skip is None else list(skip),
                      return_dict=False) for part in parts]
        # NOTE: per-row LoRA maps the packed streams (image, then text tokens) to rows
        results = run_packed(transformer, packing, calls, packed_attention, [None] * len(calls),
                             per_shape=lambda: [(_denoise(transformer, joint_attention_kwargs, **part),)
                                                for part in parts],
                             lora=[row for part in parts for row in part["lora"]] if per_row_lora else None)
        for (index, rows, _, inputs), (result, *_) in zip(picked, results):
            if outputs[index] is None:
                outputs[index] = result.new_empty((len(inputs["skip_layers"]), *result.shape[1:]))
            outputs[index].index_copy_(0, rows, result)
    return outputs


def _picked_rows(inputs: dict[str, Any], rows: torch.Tensor, numbers: list[int]) -> dict[str, Any]:
    """The denoise inputs of `rows` (rows of one skip set, in a call without IP-Adapter embeddings); `numbers`:
    the same rows as a list (reading them back from `rows` would be a host read on a GPU)."""
    picked = {name: inputs[name].index_select(0, rows)
              for name in ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")}
    return dict(picked, **{name: [inputs[name][r] for r in numbers] for name in ("skip_layers", "lora")})


def _denoise(transformer, joint_attention_kwargs, hidden_states, timestep, encoder_hidden_states, pooled_projections,
             skip_layers, lora, ip_embeds=None, ip_scales=None):
    """One forward per distinct skip set among the rows (`skip_layers` holds each row's set, None: no skipping)."""
    outputs = None
    for skip in dict.fromkeys(skip_layers):
        rows = [r for r, row_skip in enumerate(skip_layers) if row_skip == skip]
        whole = len(rows) == len(skip_layers)
        index = None if whole else torch.tensor(rows, device=hidden_states.device)
        pick = (lambda x: x) if whole else (lambda x: x.index_select(0, index))  # noqa: E731
        kwargs = joint_attention_kwargs
        if ip_embeds is not None:  # the transformer projects each row's embeddings at that row's timestep
            kwargs = dict(joint_attention_kwargs or {}, ip_adapter_image_embeds=pick(ip_embeds))
        arguments = dict(hidden_states=pick(hidden_states), timestep=pick(timestep),
                         encoder_hidden_states=pick(encoder_hidden_states), pooled_projections=pick(pooled_projections),
                         joint_attention_kwargs=kwargs, return_dict=False,
                         skip_layers=None if skip is None else list(skip))
        output = run_rows(transformer, arguments, lora=[lora[r] for r in rows],
                          ip_scales=[ip_scales[r] for r in rows] if ip_scales is not None else None)[0]
        if whole:
            return output
        if outputs is None:
            outputs = output.new_empty((len(skip_layers),) + tuple(output.shape[1:]))
        outputs.index_copy_(0, index, output)
    return outputs
