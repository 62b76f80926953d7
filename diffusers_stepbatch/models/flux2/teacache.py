"""FLUX.2's TeaCache forward: `Flux2Transformer2DModel.forward` with one skip decision per request branch.

The signal is TeaCache's for FLUX.1, the first double block's modulated image input, with shift and scale from
FLUX.2's shared `double_stream_modulation_img` layer. A skipping row adds its residual of all blocks to its embedded
image tokens (an edit row's reference tokens included); the row loop is the shared `teacache_rows.dense_rows`.
klein KV's calls that read their cache skip the same way; its cache-filling first call always computes.

The rescale polynomial (highest power first) is the one NVIDIA TensorRT-LLM ships for FLUX.2 dev on this signal
(`FLUX2_TEACACHE_COEFFICIENTS["dev"]` in tensorrt_llm/_torch/visual_gen/models/flux/pipeline_flux2.py,
github.com/NVIDIA/TensorRT-LLM). Klein shares the class, not the weights: fit its polynomial with
`fit_coefficients(pipe, prompts, signal=signal_hook, ...)` (distilled klein's 4 steps are below `min_steps`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache, Flux2Modulation, Flux2Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import dense_rows
from ..packing.support import reproduces_call
from .kv_cache import cache_rows
from .kv_packing import KV_ARGUMENTS
from .packing import REPRODUCED_ARGUMENTS, text_image_rotary

FLUX2_COEFFICIENTS = (1.04582360e02, -6.87605554e00, -8.61659379e-02, 5.37600252e-02)


_CACHED_ARGUMENTS = REPRODUCED_ARGUMENTS | KV_ARGUMENTS


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `Flux2Transformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments this forward doesn't reproduce (klein KV's cache filling, ...)."""
    cached = arguments.get("kv_cache_mode") == "cached" and arguments.get("kv_cache") is not None
    reproduced = _CACHED_ARGUMENTS if cached else REPRODUCED_ARGUMENTS
    if not reproduces_call(arguments, reproduced, "joint_attention_kwargs") or \
            not len(transformer.transformer_blocks):
        return None
    ids = {name: arguments[name][0] if arguments[name].ndim == 3 else arguments[name]
           for name in ("txt_ids", "img_ids")}  # NOTE: the model reads a 3-D tensor's first row too
    output = flux2_teacache_forward(
        transformer, states, arguments["hidden_states"], arguments["encoder_hidden_states"], arguments["timestep"],
        ids["img_ids"], ids["txt_ids"], arguments.get("guidance"), arguments.get("joint_attention_kwargs"),
        kv_cache=arguments["kv_cache"] if cached else None)
    return (output,) if not arguments.get("return_dict", True) else Flux2Transformer2DModelOutput(sample=output)


def flux2_teacache_forward(
    transformer: Any,
    states: Sequence[TeaCacheState | None],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    guidance: torch.Tensor | None = None,
    joint_attention_kwargs: dict | None = None,
    kv_cache: Flux2KVCache | None = None,
) -> torch.Tensor:
    """`Flux2Transformer2DModel.forward` (return_dict=False, [0]) with per-row TeaCache decisions.

    `states[r]` is row r's state (rows of one request branch share one object) or None (always compute); the
    states change only after the forward succeeded, so a failed batch retried row by row stays correct.
    `kv_cache`: the rows' reference KV cache that klein KV reads after its first step.
    """
    return _forward(transformer, states, hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                    timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                    joint_attention_kwargs=joint_attention_kwargs, kv_cache=kv_cache)


def flux2_signal(block, hidden: torch.Tensor, mod_img: torch.Tensor) -> torch.Tensor:
    """The TeaCache signal: `block`'s modulated image input, [rows, tokens, dim], as the block computes it."""
    (shift_msa, scale_msa, _), _ = Flux2Modulation.split(mod_img, 2)
    return (1 + scale_msa) * block.norm1(hidden) + shift_msa


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for FLUX.2: records `flux2_signal` at the first double block."""
    def hook(block, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        record(flux2_signal(block, hidden, kwargs["temb_mod_img"]))

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, states, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance,
             joint_attention_kwargs, kv_cache=None):
    # NOTE: the embeddings as Flux2Transformer2DModel.forward makes them, op for op (tested)
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden_states.dtype) * 1000
    temb = transformer.time_guidance_embed(timestep, guidance)
    mods = (transformer.double_stream_modulation_img(temb), transformer.double_stream_modulation_txt(temb),
            transformer.single_stream_modulation(temb))
    hidden = transformer.x_embedder(hidden_states)
    encoder = transformer.context_embedder(encoder_hidden_states)
    rotary = text_image_rotary(transformer, txt_ids, img_ids)
    signal = flux2_signal(transformer.transformer_blocks[0], hidden, mods[0])

    out, commit = dense_rows(transformer, states, hidden, signal, functools.partial(
        _blocks, transformer, encoder=encoder, mods=mods, rotary=rotary, joint_attention_kwargs=joint_attention_kwargs,
        kv_cache=kv_cache))
    output = transformer.proj_out(transformer.norm_out(out, temb))
    commit()
    return output


def _blocks(transformer, hidden, rows, encoder, mods, rotary, joint_attention_kwargs, kv_cache=None):
    """The double then single blocks as the model runs them, on `rows` (None: all); returns the image tokens."""
    if rows is not None:
        encoder, mods = encoder[rows], tuple(mod[rows] for mod in mods)
        kv_cache = None if kv_cache is None else cache_rows(kv_cache, rows)
    mod_img, mod_txt, mod_single = mods
    text_tokens = encoder.shape[1]
    double, single = joint_attention_kwargs, joint_attention_kwargs
    if kv_cache is not None:  # NOTE: the model's kwargs for a call that reads its cache, a layer's cache each
        double = {**(joint_attention_kwargs or {}), "kv_cache_mode": "cached",
                  "num_ref_tokens": kv_cache.num_ref_tokens}
        single = {**double, "num_txt_tokens": text_tokens}
    for index, block in enumerate(transformer.transformer_blocks):
        kwargs = double if kv_cache is None else {**double, "kv_cache": kv_cache.get_double(index)}
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb_mod_img=mod_img,
                                temb_mod_txt=mod_txt, image_rotary_emb=rotary, joint_attention_kwargs=kwargs)
    joint = torch.cat([encoder, hidden], dim=1)
    for index, block in enumerate(transformer.single_transformer_blocks):
        kwargs = single if kv_cache is None else {**single, "kv_cache": kv_cache.get_single(index)}
        joint = block(hidden_states=joint, encoder_hidden_states=None, temb_mod=mod_single, image_rotary_emb=rotary,
                      joint_attention_kwargs=kwargs)
    return joint[:, text_tokens:]
