"""Step program for QwenImagePipeline: its __call__ as a resumable generator.

Prompt embeddings of any length share a forward: every row brings its own embedding (a list entry), and the
batched forward pads them to the batch's longest with `encoder_hidden_states_mask` (padded text tokens are
masked out, and text RoPE positions don't depend on the padded length). RoPE takes `img_shapes[0]` for the
whole batch, so the image grid is part of the key; requests of other grids share a packed call instead
(`models/qwenimage/packing.py`: tokens of every row without padding, attention inside each row). True CFG adds the
negative rows to the same forward; its scale and norm rescaling are applied per request after the split. TeaCache
is the model layer's (`models/qwenimage/teacache.py`), one state per request and branch, in merged and packed calls.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from ...adapters.lora import lora_layers
from ...adapters.state import (
    AdapterState,
    request_adapters,
    text_encoder_state,
    without_lora_scale,
)
from ...cache.teacache import TeaCacheState
from ...decoders.vae import vae_decode_item
from ...engine.batch import Packable, WorkItem
from ...engine.split_reasons import named_key
from ...module_scan import execution_device
from ...models.packing.attention import check_can_run as check_packed_attention_runs
from ...models.packing.support import extra_attention_kwargs, packing_refused
from ..cache_hooks import hooked_denoiser
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
    as_list,
    check_latents,
    check_num_images_per_prompt,
)


# names of the denoise key's fields shared with packed calls, for stats()["splits"]
_SHARED_FIELDS = ("latent token width", "text width", "guidance embedding", "attention_kwargs", "latent dtype",
                  "text dtype", "device")


@dataclass
class QwenImageCall:
    """One validated QwenImagePipeline call; names follow QwenImagePipeline.__call__."""

    args: dict[str, Any]
    height: int
    width: int
    num_inference_steps: int
    num_images: int  # prompts x num_images_per_prompt
    do_true_cfg: bool
    pid: PiDExit | None = None  # PiD early exit (programs/pid/exit.py); None: VAE decode
    adapters: AdapterState | None = None  # this request's LoRA (adapters/state.py); None: the model has none
    packed_attention: str = "auto"  # the StepBatched option (models/packing/attention.py)
    teacache: list[TeaCacheState] | None = None  # one per CFG branch; None: every step runs the blocks


@register_program(QwenImagePipeline, features=("adapters", "teacache"))
def plan_qwenimage(pipe: QwenImagePipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate a QwenImagePipeline call in the caller's thread and return its step program."""
    args, pid, height, width = plan_main_size(pipe, args, context)
    size = check_program_call(pipe, args, height, width, ProgramChecks(latent_patches=True))
    steps, num_prompts, num_images = size.steps, size.num_prompts, size.num_images
    if pipe.transformer.config.guidance_embeds and args["guidance_scale"] is None:
        raise ValueError("guidance_scale is required for a guidance-distilled Qwen-Image transformer")
    has_negative = args["negative_prompt"] is not None or args["negative_prompt_embeds"] is not None
    _log_ignored_guidance(pipe, args, has_negative)
    do_true_cfg = args["true_cfg_scale"] > 1 and has_negative
    if do_true_cfg:
        negatives = as_list(args["negative_prompt"])
        count = len(negatives) if negatives is not None else args["negative_prompt_embeds"].shape[0]
        if count != num_prompts:
            raise ValueError(f"negative_prompt has {count} entries for {num_prompts} prompts; pass one per prompt")
    latent_h = 2 * (int(height) // (pipe.vae_scale_factor * 2))
    latent_w = 2 * (int(width) // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels
    check_latents(args["latents"], (num_images, (latent_h // 2) * (latent_w // 2), channels))
    adapters = request_adapters(pipe.transformer, context.adapters,
                                lora_scale=(args["attention_kwargs"] or {}).get("scale"))
    options = context.options
    teacache = None if options.teacache is None else options.teacache.states(
        pipe.transformer, support_for(pipe.transformer).teacache_coefficients, steps, 2 if do_true_cfg else 1)
    if teacache is not None and getattr(pipe.transformer, "_hf_hook", None) is not None:
        raise ValueError(
            "TeaCache calls the transformer's blocks directly, which bypasses the model offload hook on "
            "pipe.transformer; call pipe.to(device) instead of enable_model_cpu_offload(), or pass teacache=None"
        )
    call = QwenImageCall(args, height, width, steps, num_images, do_true_cfg, pid=pid, adapters=adapters,
                         packed_attention=options.packed_attention, teacache=teacache)
    # NOTE: "varlen" with a CPU or float32 model is refused here, in the caller, not in a packed call.
    check_packed_attention_runs(call.packed_attention, pipe.transformer)
    rows = num_images * (2 if do_true_cfg else 1)
    program = qwenimage_program(pipe, request_pipeline(pipe, context), call)
    tokens = (latent_h // 2) * (latent_w // 2)
    return PlannedRequest(program=program, num_rows=rows, num_steps=steps, tokens_per_row=tokens,
                          starts_in_caller=True)


def _log_ignored_guidance(pipe: QwenImagePipeline, args: dict[str, Any], has_negative: bool) -> None:
    """The warnings QwenImagePipeline.__call__ logs for guidance arguments it ignores, on its logger."""
    logger, scale = pipeline_qwenimage.logger, args["true_cfg_scale"]
    if scale > 1 and not has_negative:
        logger.warning(f"true_cfg_scale is passed as {scale}, but classifier-free guidance is not enabled since no "
                       "negative_prompt is provided.")
    elif scale <= 1 and has_negative:
        logger.warning(" negative_prompt is passed but classifier-free guidance is not enabled since "
                       "true_cfg_scale <= 1")
    if not pipe.transformer.config.guidance_embeds and args["guidance_scale"] is not None:
        logger.warning(f"guidance_scale is passed as {args['guidance_scale']}, but ignored since the model is not "
                       "guidance-distilled.")


def qwenimage_program(pipe: QwenImagePipeline, view: QwenImagePipeline,
                      call: QwenImageCall) -> Generator[WorkItem, Any, Any]:
    args = call.args
    begin_call(view, args, ("guidance_scale",), attention_kwargs=args["attention_kwargs"] or {}, current_timestep=None)
    device = execution_device(pipe)
    per_prompt = check_num_images_per_prompt(args["num_images_per_prompt"])
    # NOTE: the LoRA scale is in each row's adapter weights (call.adapters), not in the shared kwargs.
    attention_kwargs = without_lora_scale(view._attention_kwargs)
    # Module scans before the first work item, so that they run in the caller's thread (`start_in_caller`).
    packing_reason = (support_for(pipe.transformer, through_compile=True).packing.unsupported(pipe.transformer)
                      or extra_attention_kwargs(attention_kwargs, "attention_kwargs"))
    hooked = hooked_denoiser(pipe.transformer, view)

    # 1. Text: [positive] or [positive, negative] as (embeds, mask-or-None), as QwenImagePipeline.encode_prompt.
    texts = [("prompt", "prompt_embeds", "prompt_embeds_mask")]
    if call.do_true_cfg:
        texts.append(("negative_prompt", "negative_prompt_embeds", "negative_prompt_embeds_mask"))
    encoded = yield from _encode(pipe, args, texts, device)
    branches = []
    for (_, embeds_name, mask_name), (embeds, mask) in zip(texts, encoded):
        if embeds is None:
            embeds, mask = args[embeds_name], args[mask_name]
        branches.append(view.encode_prompt(None, device=device, num_images_per_prompt=per_prompt,
                                           prompt_embeds=embeds, prompt_embeds_mask=mask,
                                           max_sequence_length=args["max_sequence_length"]))

    # 2. Latents, this request's own scheduler and timesteps (as QwenImagePipeline.__call__ does).
    latents = view.prepare_latents(
        call.num_images, pipe.transformer.config.in_channels // 4, call.height, call.width, branches[0][0].dtype,
        device, args["generator"], args["latents"],
    )
    grid = (1, call.height // pipe.vae_scale_factor // 2, call.width // pipe.vae_scale_factor // 2)
    sigmas = args["sigmas"]
    if sigmas is None:
        sigmas = np.linspace(1.0, 1 / call.num_inference_steps, call.num_inference_steps)
    config = view.scheduler.config
    mu = calculate_shift(
        latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5), config.get("max_shift", 1.15),
    )
    timesteps, num_inference_steps = retrieve_timesteps(view.scheduler, call.num_inference_steps, device,
                                                        sigmas=sigmas, mu=mu)
    view._num_timesteps = len(timesteps)
    guidance = None
    if pipe.transformer.config.guidance_embeds:
        guidance = torch.full([latents.shape[0]], args["guidance_scale"], device=device, dtype=torch.float32)

    denoise = functools.partial(_denoise, pipe.transformer, grid, attention_kwargs)
    solo = row_kernels_of(pipe.transformer)
    shared_key = (tuple(latents.shape[2:]), branches[0][0].shape[-1], guidance is not None,
                  freeze(attention_kwargs), latents.dtype, branches[0][0].dtype, str(latents.device))
    key = named_key(program="qwenimage", **{"image size": grid}, **dict(zip(_SHARED_FIELDS, shared_key)))
    longest_text = max(embeds.shape[1] for embeds, _ in branches)
    pack = _packable(packing_reason, pipe.transformer, attention_kwargs, shared_key, grid,
                     latents.shape[1] + longest_text, call.packed_attention)

    # 3. Denoising loop: one work item per step; rows are [images] or [images, negative images]. With diffusers'
    # cache hooks on the transformer, this request's forwards run alone, one per branch, in its own contexts.
    if hooked is not None:
        key = key + hooked.key_field
        denoise = hooked.run(denoise, ["cond", "uncond"][:len(branches)])
    view.scheduler.set_begin_index(0)
    callback = args["callback_on_step_end"]
    # NOTE: the Euler step runs batched with the other requests' steps where the scheduler allows it.
    fused = FusedEuler.for_scheduler(view.scheduler, latents)
    # NOTE: up to PiD's early exit, whose decode is step 4
    for i, t in denoising_steps(view, timesteps, num_inference_steps, call.pid, call.teacache, current_timestep=True):
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        images = latents.shape[0]
        inputs = {
            "hidden_states": torch.cat([latents] * len(branches)),
            "timestep": torch.cat([timestep / 1000] * len(branches)),
            "guidance": None if guidance is None else torch.cat([guidance] * len(branches)),
            "text": [embeds[j] for embeds, _ in branches for j in range(images)],
            "text_mask": [None if mask is None else mask[j] for _, mask in branches for j in range(images)],
            "lora": [call.adapters] * (len(branches) * images),
            "teacache": [state for state in call.teacache or [None] * len(branches) for _ in range(images)],
        }
        if hooked is not None:
            yield from hooked.take_turn()
        noise_pred = yield WorkItem("denoise", key, inputs, denoise, rows=len(branches) * images, step=i,
                                    pack=pack, row_kernels=solo)
        if call.do_true_cfg:
            noise_pred, negative_pred = noise_pred.chunk(2)
            combined = negative_pred + args["true_cfg_scale"] * (noise_pred - negative_pred)
            cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
            noise_norm = torch.norm(combined, dim=-1, keepdim=True)
            noise_pred = combined * (cond_norm / noise_norm)
        if fused is not None:  # the Euler step, shared with the other requests of this engine step
            latents = yield from fused.step(t, latents, noise_pred)
        else:
            latents = view.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if callback is not None:
            tensors = {"latents": latents, "prompt_embeds": branches[0][0]}
            callback_kwargs = {name: tensors[name] for name in args["callback_on_step_end_tensor_inputs"]}
            outputs = run_step_callback(callback, view, i, t, callback_kwargs)
            latents = outputs.pop("latents", latents)
            branches[0] = (outputs.pop("prompt_embeds", branches[0][0]), branches[0][1])
    view._current_timestep = None
    if hooked is not None:
        hooked.release()

    # 4. Decode (batched with other requests' decodes of the same size).
    if call.pid is not None:  # PiD early exit (programs/pid/exit.py): x_t and its sigma -> the requested size
        image = yield from pid_exit_decode(view, call.pid, args, latents, branches[0][0])
        return QwenImagePipelineOutput(images=image) if args["return_dict"] else (image,)
    if args["output_type"] == "latent":
        image = latents
    else:
        vae = pipe.vae
        latents = view._unpack_latents(latents, call.height, call.width, view.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = yield vae_decode_item(vae, latents / inv_std + mean)
        image = view.image_processor.postprocess(image[:, :, 0], output_type=args["output_type"])
    return QwenImagePipelineOutput(images=image) if args["return_dict"] else (image,)


def _encode(pipe, args, texts, device):
    """Yield one encode item for the prompts of all branches; return [(embeds, mask) or (None, None)] per branch.

    Each branch's rows come back as the pipeline pads them when it encodes that branch alone: zero-padded to
    the branch's own longest prompt, with its mask.
    """
    prompts, sizes = [], []
    for prompt_name, _, _ in texts:
        branch = as_list(args[prompt_name]) or []
        prompts += branch
        sizes.append(len(branch))
    if not prompts:
        return [(None, None)] * len(texts)
    run = functools.partial(_encode_text, pipe, device)
    key = ("qwenimage.encode", text_encoder_state([pipe.text_encoder]), str(device))
    embeds, mask = yield WorkItem("encode", key, {"prompt": prompts}, run, rows=len(prompts),
                                  row_kernels=row_kernels_of(pipe.text_encoder))
    encoded, start = [], 0
    for size in sizes:
        if size == 0:
            encoded.append((None, None))
            continue
        branch_mask = mask[start:start + size]
        length = int(branch_mask.sum(dim=1).max())
        encoded.append((embeds[start:start + size, :length], branch_mask[:, :length]))
        start += size
    return encoded


def _encode_text(pipe, device, prompt):
    return pipe._get_qwen_prompt_embeds(prompt, device)


def _packable(reason, transformer, attention_kwargs, shared_key, grid, tokens, packed_attention) -> Packable | None:
    """Rows of other image grids (and text lengths) may share this request's forwards, unless `reason` forbids."""
    if packing_refused("QwenImagePipeline", reason):
        return None
    run = functools.partial(_packed_denoise, transformer, attention_kwargs, packed_attention)
    return Packable(key=("qwenimage.packed", packed_attention, *shared_key), run=run, context=grid, tokens=tokens)


def _packed_denoise(transformer, attention_kwargs, packed_attention, shapes):
    """One packed forward for several grids' batches; text padding is dropped per row, not masked."""
    # NOTE: each row's text as its own entry of its own length (the packed forward takes them so)
    calls = [dict(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"],
                  encoder_hidden_states=inputs["text"], encoder_hidden_states_mask=inputs["text_mask"],
                  img_shapes=[[grid]], attention_kwargs=attention_kwargs, return_dict=False)
             for grid, inputs in shapes]
    outputs = run_packed(
        transformer, support_for(transformer, through_compile=True).packing, calls, packed_attention,
        [inputs["teacache"] for _, inputs in shapes],
        per_shape=lambda: [_call(transformer, grid, attention_kwargs, **inputs) for grid, inputs in shapes],
        lora=[row for _, inputs in shapes for row in inputs["lora"]] if lora_layers(transformer) else None)
    return [output[0] for output in outputs]


def _denoise(transformer, grid, attention_kwargs, **inputs):
    return _call(transformer, grid, attention_kwargs, **inputs)[0]


def _call(transformer, grid, attention_kwargs, hidden_states, timestep, guidance, text, text_mask, lora, teacache):
    """One forward over rows whose prompt embeddings may differ in length: pad to the longest and mask."""
    lengths = [row.shape[0] for row in text]
    longest = max(lengths)
    masks = [torch.ones(n, dtype=torch.long, device=row.device) if m is None else m.long()
             for n, row, m in zip(lengths, text, text_mask)]
    if all(n == longest for n in lengths) and all(m is None for m in text_mask):
        embeds, mask = torch.stack(text), None
    else:
        embeds = torch.stack([torch.nn.functional.pad(row, (0, 0, 0, longest - row.shape[0])) for row in text])
        mask = torch.stack([torch.nn.functional.pad(m, (0, longest - m.shape[0])) for m in masks])
    arguments = dict(hidden_states=hidden_states, timestep=timestep, guidance=guidance, encoder_hidden_states_mask=mask,
                     encoder_hidden_states=embeds, img_shapes=[[grid]] * hidden_states.shape[0],
                     attention_kwargs=attention_kwargs, return_dict=False)
    # NOTE: where TeaCache can't reproduce the call (a config or processor it doesn't know), it computes
    return run_rows(transformer, arguments, support=support_for(transformer, through_compile=True), lora=lora,
                    teacache=teacache)
