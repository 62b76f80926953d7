"""Step program for FluxPipeline (FLUX.1 dev and schnell): FluxPipeline.__call__ as a resumable generator.

It reuses the pipeline's own helpers (`check_inputs`, `encode_prompt`, `prepare_latents`, `_unpack_latents`,
`retrieve_timesteps`) and yields a work item wherever a model runs. Timestep and guidance are per-row
inputs, so requests at different steps and guidance scales share one transformer forward; true CFG adds
the negative rows to the same forward and its scale is applied per request after the split.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import FluxPipelineOutput, calculate_shift, retrieve_timesteps

from ...adapters.ip_adapter import (
    IPAdapterState,
    bind_scale_setter,
    flux_ip_image_embeds,
    ip_key_fields,
    plan_flux_ip_adapter,
)
from ...adapters.lora import lora_layers
from ...adapters.state import (
    AdapterState,
    request_adapters,
    text_lora_scale,
    without_lora_scale,
)
from ...buffers import stack_rows
from ...cache.prompt import cached_encode, encoder_namespace, encoders_are_deterministic
from ...decoders.vae import vae_decode_item
from ...engine.batch import Packable, WorkItem
from ...engine.split_reasons import named_key
from ...module_scan import execution_device
from ...models.packing.attention import check_can_run as check_packed_attention_runs
from ...models.row_kernels import row_kernels_of
from ...models.packing.support import extra_attention_kwargs, packing_refused
from ..cache_hooks import hooked_denoiser
from ..callbacks import run_step_callback
from ..fused_update import FusedEuler
from ..cfg import transformer_activation_bytes
from ..options import PlanContext, ProgramOptions
from ..pid.exit import PiDExit, pid_exit_decode, plan_main_size
from ..checks.program import ProgramChecks, check_program_call
from ..registry import PlannedRequest, register_program, request_pipeline
from ..request_state import begin_call
from .steps import denoising_steps
from ...models import support_for
from ...models.calls import freeze
from ...models.denoiser_calls import run_packed, run_rows
from ...cache.teacache import TeaCacheState
from ..checks.values import (
    as_list,
    check_latents,
    check_num_images_per_prompt,
)


@dataclass
class FluxCall:
    """One validated FluxPipeline call; names follow FluxPipeline.__call__."""

    args: dict[str, Any]
    height: int
    width: int
    num_inference_steps: int
    num_images: int  # prompts x num_images_per_prompt
    do_true_cfg: bool
    options: ProgramOptions
    teacache: list[TeaCacheState] | None  # one per CFG branch; None: every step runs the blocks
    pid: PiDExit | None = None  # PiD early exit (programs/pid/exit.py); None: VAE decode
    adapters: AdapterState | None = None  # this request's LoRA (adapters/state.py); None: the model has none
    ip: IPAdapterState | None = None  # this request's IP-Adapter (adapters/ip_adapter.py); None: no IP-Adapter


# NOTE: FluxPipeline reads no PipelineCallback's tensor inputs
_CHECKS = ProgramChecks(latent_patches=True, embeds_as_given="FluxPipeline", pipeline_callbacks=False)


@register_program(FluxPipeline, features=("teacache", "adapters"))
def plan_flux(pipe: FluxPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate a FluxPipeline call in the caller's thread and return its step program."""
    args, pid, height, width = plan_main_size(pipe, args, context)
    size = check_program_call(pipe, args, height, width, _CHECKS)
    steps, num_prompts, num_images = size.steps, size.num_prompts, size.num_images

    has_negative = args["negative_prompt"] is not None or (
        args["negative_prompt_embeds"] is not None and args["negative_pooled_prompt_embeds"] is not None
    )
    do_true_cfg = args["true_cfg_scale"] > 1 and has_negative
    if do_true_cfg:
        _check_negative(args, num_prompts)

    latent_h = 2 * (int(height) // (pipe.vae_scale_factor * 2))
    latent_w = 2 * (int(width) // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels
    check_latents(args["latents"], (num_images, (latent_h // 2) * (latent_w // 2), channels))

    _check_second_prompts(args, "prompt", "prompt_2")
    if do_true_cfg:
        _check_second_prompts(args, "negative_prompt", "negative_prompt_2")

    options = context.options
    # NOTE: "varlen" with a CPU or float32 model is refused here, in the caller, not in a packed call.
    check_packed_attention_runs(options.packed_attention, pipe.transformer)
    branches = 2 if do_true_cfg else 1
    teacache = None if options.teacache is None else options.teacache.states(
        pipe.transformer, support_for(pipe.transformer).teacache_coefficients, steps, branches)
    if teacache is not None and getattr(pipe.transformer, "_hf_hook", None) is not None:
        raise ValueError(
            "TeaCache calls the transformer's blocks directly, which bypasses the model offload hook on "
            "pipe.transformer; call pipe.to(device) instead of enable_model_cpu_offload(), or pass teacache=None"
        )
    adapters = request_adapters(pipe.transformer, context.adapters,
                                lora_scale=(args["joint_attention_kwargs"] or {}).get("scale"))
    ip = plan_flux_ip_adapter(pipe, args)
    if ip is not None and teacache is not None:
        raise ValueError("TeaCache runs the transformer's blocks itself, without the IP-Adapter's image tokens; "
                         "pass teacache=None with an IP-Adapter loaded")
    call = FluxCall(args, height, width, steps, num_images, do_true_cfg, options, teacache, pid, adapters, ip)
    rows = num_images * branches
    tokens = (latent_h // 2) * (latent_w // 2)
    program = flux_program(pipe, request_pipeline(pipe, context), call)
    return PlannedRequest(program=program, num_rows=rows, num_steps=steps, tokens_per_row=tokens,
                          starts_in_caller=True)


def _check_second_prompts(args: dict[str, Any], name: str, name_2: str) -> None:
    firsts, seconds = as_list(args[name]), as_list(args[name_2])
    if firsts is not None and seconds is not None and len(firsts) != len(seconds):
        raise ValueError(f"{name_2} has {len(seconds)} entries for {len(firsts)} {name}s; pass one per {name}")


def _check_negative(args: dict[str, Any], num_prompts: int) -> None:
    if args["prompt_embeds"] is not None and args["negative_prompt_embeds"] is not None:
        if args["prompt_embeds"].shape != args["negative_prompt_embeds"].shape:
            raise ValueError(  # NOTE: FluxPipeline's own wording (code may match on it)
                "`prompt_embeds` and `negative_prompt_embeds` must have the same shape when passed directly, but"
                f" got: `prompt_embeds` {args['prompt_embeds'].shape} != `negative_prompt_embeds`"
                f" {args['negative_prompt_embeds'].shape}."
            )
    negatives = as_list(args["negative_prompt"])
    if negatives is not None and len(negatives) != num_prompts:
        raise ValueError(
            f"negative_prompt has {len(negatives)} entries for {num_prompts} prompts; pass one per prompt"
        )


# names of the denoise key's fields shared with packed calls, for stats()["splits"]
_SHARED_FIELDS = ("pooled text width", "guidance embedding", "joint_attention_kwargs", "latent dtype", "text dtype",
                  "device")


def flux_program(pipe: FluxPipeline, view: FluxPipeline, call: FluxCall) -> Generator[WorkItem, Any, Any]:
    """`view` is the request's own view of `pipe` (made at submit, so it keeps the scheduler of that moment)."""
    args, options = call.args, call.options
    begin_call(view, args, ("guidance_scale",), joint_attention_kwargs=args["joint_attention_kwargs"] or {},
               current_timestep=None)
    device = execution_device(pipe)
    per_prompt = check_num_images_per_prompt(args["num_images_per_prompt"])
    lora_scale = view._joint_attention_kwargs.get("scale")
    # NOTE: the LoRA scale is in each row's adapter weights (call.adapters), not in the shared kwargs.
    attention_kwargs = without_lora_scale(view._joint_attention_kwargs)
    # Module scans before the first work item, so that they run in the caller's thread (`start_in_caller`).
    packing_reason = _packing_reason(pipe.transformer, attention_kwargs, call)
    hooked = hooked_denoiser(pipe.transformer, view)

    # 1. Text: positive and negative prompts of this request are encoded in one batched call (or cached).
    embeds, pooled = yield from _encode(pipe, args, call.do_true_cfg, per_prompt, device, lora_scale,
                                        options.prompt_cache)

    # 1b. Image prompts (IP-Adapter): positive and negative embeddings, images encoded in batched items.
    ip_embeds = None
    if call.ip is not None:
        bind_scale_setter(view, pipe, call.ip)
        ip_embeds = yield from flux_ip_image_embeds(pipe, view, call.ip, args, device, call.num_images,
                                                    call.height, call.width)

    # 2. Latents, this request's own scheduler and timesteps (as FluxPipeline.__call__ does).
    latents, image_ids = view.prepare_latents(
        call.num_images, pipe.transformer.config.in_channels // 4, call.height, call.width,
        embeds[0].dtype, device, args["generator"], args["latents"],
    )
    sigmas = args["sigmas"]
    if sigmas is None:
        sigmas = np.linspace(1.0, 1 / call.num_inference_steps, call.num_inference_steps)
    if getattr(view.scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    config = view.scheduler.config
    mu = calculate_shift(
        latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5), config.get("max_shift", 1.15),
    )
    timesteps, num_inference_steps = retrieve_timesteps(
        view.scheduler, call.num_inference_steps, device, sigmas=sigmas, mu=mu
    )
    view._num_timesteps = len(timesteps)
    guidance = None
    if pipe.transformer.config.guidance_embeds:
        guidance = torch.full([latents.shape[0]], args["guidance_scale"], device=device, dtype=torch.float32)

    text_dtype = pipe.text_encoder.dtype if pipe.text_encoder is not None else pipe.transformer.dtype
    text_ids = torch.zeros(embeds[0].shape[1], 3, device=device, dtype=text_dtype)
    denoise = functools.partial(_denoise, pipe.transformer, text_ids, image_ids, attention_kwargs, options.buffers)
    # NOTE: txt_ids/img_ids have no batch dim, so rows of one forward share image grid and text length.
    grid = (call.height // (pipe.vae_scale_factor * 2), call.width // (pipe.vae_scale_factor * 2))
    shared_key = (tuple(pooled[0].shape[1:]), guidance is not None, freeze(attention_kwargs),
                  latents.dtype, embeds[0].dtype, str(latents.device))
    key = named_key(program="flux", **{"image size": grid, "text length": tuple(embeds[0].shape[1:])},
                    **dict(zip(_SHARED_FIELDS, shared_key)))
    if ip_embeds is not None:  # rows of one forward share the IP processors and image-embedding shapes
        key += ip_key_fields(call.ip, [tuple(e.shape[1:]) for e in ip_embeds[0]])
    pack = _packable(packing_reason, pipe.transformer, attention_kwargs, shared_key, (text_ids, image_ids),
                     latents.shape[1] + embeds[0].shape[1], options.packed_attention)

    # 3. Denoising loop: one work item per step (two when the CFG policy splits the branches); the engine
    # batches it with other requests' items. Inputs are lists of row tensors: the batch is assembled once, in
    # `_denoise`, into pooled buffers when the engine has them. Row r = branch b, image j: b * images + j.
    callback = args["callback_on_step_end"]
    images, branches = latents.shape[0], 2 if call.do_true_cfg else 1
    text, text_pooled = (torch.cat(embeds), torch.cat(pooled)) if call.do_true_cfg else (embeds[0], pooled[0])
    scaled_timesteps = timesteps.to(latents.dtype) / 1000
    teacache = call.teacache or [None] * branches
    # NOTE: callbacks may keep the latents they are shown, so those requests don't ping-pong.
    workspace = options.buffers.workspace() if options.buffers is not None and callback is None else None
    heads = pipe.transformer.config.num_attention_heads
    branch_bytes = transformer_activation_bytes(images, latents.shape[1] + text.shape[1],
                                                heads * pipe.transformer.config.attention_head_dim, heads,
                                                latents.element_size())
    # NOTE: diffusers' cache hooks on the transformer: this request's forwards run alone, per branch, in its own
    # cache contexts (programs/cache_hooks.py).
    if hooked is not None:
        key = key + hooked.key_field
    view.scheduler.set_begin_index(0)
    # NOTE: the update after each forward (CFG combine + Euler step) runs batched with every other request's
    # update of the engine step where the scheduler allows it (programs/fused_update.py).
    fused = FusedEuler.for_scheduler(view.scheduler, latents, options.buffers, workspace)
    solo = row_kernels_of(pipe.transformer)
    # NOTE: up to PiD's early exit, whose decode is step 4
    for i, t in denoising_steps(view, timesteps, num_inference_steps, call.pid, call.teacache, current_timestep=True):
        together = not call.do_true_cfg or options.cfg_policy.batch_branches(device, branch_bytes)
        outputs = []
        if hooked is not None:
            yield from hooked.take_turn()
        for group in ([range(branches)] if together else [[0], [1]]):
            rows = [(b, j) for b in group for j in range(images)]
            inputs = {
                "hidden_states": [latents[j] for _, j in rows],
                "timestep": [scaled_timesteps[i]] * len(rows),
                "guidance": None if guidance is None else [guidance[j] for _, j in rows],
                "pooled_projections": [text_pooled[b * images + j] for b, j in rows],
                "encoder_hidden_states": [text[b * images + j] for b, j in rows],
                "teacache": [teacache[b] for b, _ in rows],
                "lora": [call.adapters] * len(rows),
                # per row: one image embedding per IP-Adapter, the negative ones on the true-CFG rows
                "ip_embeds": None if ip_embeds is None else [tuple(e[j] for e in ip_embeds[b]) for b, j in rows],
                "ip_scales": [None if call.ip is None else call.ip.row()] * len(rows),
            }
            run = denoise if hooked is None else hooked.run(denoise, [("cond", "uncond")[b] for b in group])
            outputs.append((yield WorkItem("denoise", key, inputs, run, rows=len(rows), step=i, pack=pack,
                                           row_kernels=solo)))
        noise_pred, uncond, scale = outputs[0], None, None
        if call.do_true_cfg:
            noise_pred, uncond = outputs if len(outputs) == 2 else noise_pred.chunk(2)
            scale = args["true_cfg_scale"]
        if fused is not None:
            latents = yield from fused.step(t, latents, noise_pred, uncond, scale)
        else:
            if uncond is not None:
                noise_pred = (workspace.guide(noise_pred, uncond, scale) if workspace
                              else uncond + scale * (noise_pred - uncond))
            if workspace is not None:
                latents = workspace.scheduler_step(view.scheduler, noise_pred, t, latents)
            else:
                latents = view.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if callback is not None:
            tensors = {"latents": latents, "prompt_embeds": embeds[0]}
            callback_kwargs = {name: tensors[name] for name in args["callback_on_step_end_tensor_inputs"]}
            outputs = run_step_callback(callback, view, i, t, callback_kwargs)
            latents = outputs.pop("latents", latents)
            if "prompt_embeds" in outputs:
                embeds[0] = outputs.pop("prompt_embeds")
                text = torch.cat(embeds) if call.do_true_cfg else embeds[0]
    view._current_timestep = None
    if hooked is not None:
        hooked.release()

    # 4. Decode (batched with other requests' decodes of the same size).
    if call.pid is not None:  # PiD early exit (programs/pid/exit.py): x_t and its sigma -> the requested size
        image = yield from pid_exit_decode(view, call.pid, args, latents, embeds[0], options.prompt_cache)
        return FluxPipelineOutput(images=image) if args["return_dict"] else (image,)
    if args["output_type"] == "latent":
        image = latents
    else:
        unpacked = view._unpack_latents(latents, call.height, call.width, view.vae_scale_factor)
        unpacked = unpacked / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = yield vae_decode_item(pipe.vae, unpacked)
        image = view.image_processor.postprocess(image, output_type=args["output_type"])
    return FluxPipelineOutput(images=image) if args["return_dict"] else (image,)


def _encode(pipe, args, do_true_cfg, per_prompt, device, lora_scale, cache):
    """Yield one encode item for the texts that need encoding; return ([embeds...], [pooled...]).

    Lists hold the positive branch, then the negative one when true CFG is on; rows are repeated for
    num_images_per_prompt as FluxPipeline.encode_prompt does. Texts are (prompt, prompt_2) pairs; with a
    prompt cache, cached pairs skip the text encoders.
    """
    branches = [("prompt", "prompt_2", "prompt_embeds", "pooled_prompt_embeds")]
    if do_true_cfg:
        branches.append(("negative_prompt", "negative_prompt_2", "negative_prompt_embeds",
                         "negative_pooled_prompt_embeds"))
    texts, sizes = [], []
    for prompt, prompt_2, _, _ in branches:
        if args[prompt] is None:
            sizes.append(0)
            continue
        prompts = as_list(args[prompt])
        texts += zip(prompts, _second_prompts(args[prompt_2], prompts))
        sizes.append(len(prompts))
    encoded_embeds = encoded_pooled = None
    if texts:
        max_sequence_length = args["max_sequence_length"]
        lora_scale, text_adapters = text_lora_scale([pipe.text_encoder, pipe.text_encoder_2], lora_scale)
        run = functools.partial(_encode_text, pipe, device, max_sequence_length, lora_scale)
        key = ("flux.encode", max_sequence_length, lora_scale, text_adapters, str(device))

        def make_item(pairs):
            inputs = {"prompt": [p for p, _ in pairs], "prompt_2": [p2 for _, p2 in pairs]}
            return WorkItem("encode", key, inputs, run, rows=len(pairs),
                            row_kernels=row_kernels_of(pipe.text_encoder, pipe.text_encoder_2))

        namespace = None
        encoders = [pipe.text_encoder, pipe.text_encoder_2]
        if not encoders_are_deterministic(encoders):
            cache = None  # NOTE: an encoder in training mode (dropout on) gives new embeddings every call
        if cache is not None:
            namespace = encoder_namespace(
                pipe, encoders, "flux", [pipe.tokenizer, pipe.tokenizer_2],
                execution_device=device, max_sequence_length=max_sequence_length, lora_scale=lora_scale,
            )
        encoded_embeds, encoded_pooled = yield from cached_encode(cache, namespace, texts, make_item)
    embeds, pooled, start = [], [], 0
    for (_, _, embeds_name, pooled_name), size in zip(branches, sizes):
        if size == 0:
            embeds.append(args[embeds_name].to(device))
            given_pooled = args[pooled_name].to(device)
            if given_pooled.shape[0] == 1 < embeds[-1].shape[0]:  # the transformer broadcasts one pooled row
                given_pooled = given_pooled.expand(embeds[-1].shape[0], -1)
            pooled.append(given_pooled)
            continue
        embeds.append(encoded_embeds[start:start + size].repeat_interleave(per_prompt, dim=0))
        pooled.append(encoded_pooled[start:start + size].repeat_interleave(per_prompt, dim=0))
        start += size
    return embeds, pooled


def _second_prompts(prompt_2, prompts):
    """The T5 prompts paired with `prompts`: FluxPipeline uses `prompt` where `prompt_2` is not given."""
    if prompt_2 is None:
        return prompts
    return as_list(prompt_2)


def _encode_text(pipe, device, max_sequence_length, lora_scale, prompt, prompt_2):
    embeds, pooled, _ = pipe.encode_prompt(
        prompt=prompt, prompt_2=prompt_2, device=device, num_images_per_prompt=1,
        max_sequence_length=max_sequence_length, lora_scale=lora_scale,
    )
    return embeds, pooled


def _packing_reason(transformer, joint_attention_kwargs, call) -> str | None:
    """Why this request's forwards can't pack with other sizes, or None."""
    return (support_for(transformer, through_compile=True).packing.unsupported(transformer)
            or extra_attention_kwargs(joint_attention_kwargs, "joint_attention_kwargs")
            or ("IP-Adapter image tokens are not wired into packed forwards yet" if call.ip is not None else None))


def _packable(reason, transformer, joint_attention_kwargs, shared_key, ids, tokens, method) -> Packable | None:
    """Rows of other image sizes and text lengths may share this request's forwards, unless `reason` forbids."""
    if packing_refused("FluxPipeline", reason):
        return None
    run = functools.partial(_packed_denoise, transformer, joint_attention_kwargs, method)
    return Packable(key=("flux.packed", method, *shared_key), run=run, context=ids, tokens=tokens)


def _packed_denoise(transformer, joint_attention_kwargs, packed_attention, shapes):
    calls = [_arguments(txt_ids, img_ids, joint_attention_kwargs, None, inputs)
             for (txt_ids, img_ids), inputs in shapes]
    # NOTE: per-row LoRA maps the packed streams (text, image, the single blocks' joint tokens) to rows
    outputs = run_packed(
        transformer, support_for(transformer, through_compile=True).packing, calls, packed_attention,
        [inputs["teacache"] for _, inputs in shapes],
        per_shape=lambda: [_call(transformer, txt_ids, img_ids, joint_attention_kwargs, None, **inputs)
                           for (txt_ids, img_ids), inputs in shapes],
        lora=[row for _, inputs in shapes for row in inputs["lora"]] if lora_layers(transformer) else None)
    return [output[0] for output in outputs]


def _denoise(transformer, txt_ids, img_ids, joint_attention_kwargs, buffers, **inputs):
    return _call(transformer, txt_ids, img_ids, joint_attention_kwargs, buffers, **inputs)[0]


def _call(transformer, txt_ids, img_ids, joint_attention_kwargs, buffers, teacache, lora, ip_embeds, ip_scales,
          **rows):
    """The transformer's output tuple for these rows, each with its request's TeaCache state, LoRA and IP scales."""
    arguments = _arguments(txt_ids, img_ids, joint_attention_kwargs, buffers, rows)
    if ip_embeds is not None:
        arguments["joint_attention_kwargs"] = dict(
            joint_attention_kwargs, ip_adapter_image_embeds=[torch.stack(embeds) for embeds in zip(*ip_embeds)])
    return run_rows(transformer, arguments, support=support_for(transformer, through_compile=True), lora=lora,
                    teacache=teacache, ip_scales=ip_scales)


def _arguments(txt_ids, img_ids, joint_attention_kwargs, buffers, rows) -> dict[str, Any]:
    """`FluxTransformer2DModel.forward`'s arguments for these rows (lists of row tensors), batched."""
    return {
        "hidden_states": stack_rows(buffers, "hidden_states", rows["hidden_states"]),
        "timestep": stack_rows(buffers, "timestep", rows["timestep"]),
        "guidance": stack_rows(buffers, "guidance", rows["guidance"]),
        "pooled_projections": stack_rows(buffers, "pooled_projections", rows["pooled_projections"]),
        "encoder_hidden_states": stack_rows(buffers, "encoder_hidden_states", rows["encoder_hidden_states"]),
        "txt_ids": txt_ids, "img_ids": img_ids, "joint_attention_kwargs": joint_attention_kwargs, "return_dict": False,
    }
