"""Qwen-Image 2.1's TeaCache forward: `QwenImage21Transformer2DModel.forward` with one skip decision per request
branch.

The signal is the first block's modulated input (`img_norm1(x) * (1 + scale)`) of the target image's tokens, the
same whether the call fills the KV cache, reads it or has none. A skipping row adds its cached residual of the
blocks. A call that fills a request's KV cache (its first step) always computes.

The rescale polynomial was fitted with `models/flux/teacache.py`'s `fit_coefficients` (signal `signal_hook`) on the
tiny test model (`testing_image_models.tiny_qwenimage21_pipeline()`, prompts "a red circle", "a blue square",
"a green cross", 64x64, 16 steps, degree 2): no Qwen-Image 2.1 weights were at hand, so fit the real model's
polynomial the same way before relying on the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    _qwenimage21_prefix_segments,
)
from diffusers.utils import apply_lora_scale

from ...cache.teacache import TeaCacheState, row_groups
from ..packing.support import reproduces_call
from .kv_cache import cache_rows

QWENIMAGE21_COEFFICIENTS = (2.30581477e01, -1.18756920e00, 6.04744574e-02)

_SLOT_TOKENS = 4  # latent tokens per image slot of the vision-language sequence (2x2)
_REPRODUCED = frozenset({"hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask",
                         "encoder_hidden_states_mask", "attention_kwargs", "kv_cache", "kv_cache_mode", "return_dict"})


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `QwenImage21Transformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments or attention processors this forward doesn't reproduce."""
    if not reproduces_call(arguments, _REPRODUCED, "attention_kwargs") or not all(
            type(block.attn.processor) is QwenImage21AttnProcessor for block in transformer.transformer_blocks):
        return None
    names = _REPRODUCED - {"return_dict"}
    output = _forward(transformer, states, **{name: arguments.get(name) for name in names})
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def block_signal(block, hidden_states: torch.Tensor, modulation: torch.Tensor,
                 target_token_mask: torch.Tensor | None) -> torch.Tensor:
    """The block's modulated attention input, [rows, tokens, dim]."""
    return block._modulate(block.img_norm1(hidden_states), modulation.chunk(2, dim=-1)[0], target_token_mask)[0]


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for Qwen-Image 2.1: records the first block's `block_signal` of the target
    image's tokens (with `causal_condition`, the tokens its modulation mask marks; else of every token)."""
    def hook(block, args, kwargs):
        mask = kwargs.get("target_token_mask")
        signal = block_signal(block, kwargs["hidden_states"], kwargs["modulation"], mask)
        record(signal if mask is None else signal[:, mask])

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


@apply_lora_scale("attention_kwargs")
def _forward(model, states, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
             encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None, kv_cache_mode=None):
    # NOTE: the steps before and after the blocks mirror QwenImage21Transformer2DModel.forward (with its
    # per-segment attention processors) call for call, so with every row computing the output is the model's own
    rows = hidden_states.shape[0]
    hidden_states = model.img_in(hidden_states)
    encoder_hidden_states = model.txt_in(encoder_hidden_states)
    repeats = torch.where(img_mask, _SLOT_TOKENS, 1)[0]
    image_pad_mask = torch.repeat_interleave(img_mask[0], repeats)
    target_tokens = math.prod(img_shapes[0][-1])
    joint = torch.cat([encoder_hidden_states, encoder_hidden_states.new_zeros(
        rows, target_tokens // _SLOT_TOKENS, encoder_hidden_states.shape[2])], dim=1)
    joint = joint.repeat_interleave(repeats, dim=1)
    joint[:, image_pad_mask] = hidden_states
    rotary_emb = model.pos_embed(img_shapes[0], image_pad_mask, device=hidden_states.device)
    image_ids, target_token_mask = model.build_token_metadata(image_pad_mask, img_shapes[0])

    timestep = timestep.to(hidden_states.dtype)
    modulation_mask = None
    if model.config.causal_condition:
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = target_token_mask
    temb = model.time_text_embed(timestep, hidden_states)
    modulation = model.modulation(temb)

    key_valid = None
    if encoder_hidden_states_mask is not None:
        key_valid = torch.ones(rows, image_pad_mask.shape[0], dtype=torch.bool, device=hidden_states.device)
        text_positions = (~image_pad_mask).nonzero(as_tuple=True)[0]
        vlm_text_positions = ~img_mask[0][: encoder_hidden_states_mask.shape[1]]
        key_valid[:, text_positions] = encoder_hidden_states_mask.bool()[:, vlm_text_positions]
    prefix_len = int((~target_token_mask).sum())

    target = target_token_mask  # NOTE: the signal's and the kept residual's tokens, whatever the mode
    if kv_cache_mode == "cached":
        joint, rotary_emb = joint[:, prefix_len:], rotary_emb[prefix_len:]
        modulation_mask, target = modulation_mask[prefix_len:], target[prefix_len:]
        attention_mask = None if key_valid is None else key_valid[:, None, None, :]
        segments, key_valid, write = None, None, None
    else:
        attention_mask, segments = None, _qwenimage21_prefix_segments(image_ids, prefix_len)
        write = slice(0, prefix_len) if kv_cache_mode == "extract" else None

    signal = block_signal(model.transformer_blocks[0], joint, modulation, modulation_mask)[:, target]
    decisions = []  # (state, start, end, compute, accumulated)
    for state, start, end in row_groups(states):
        # NOTE: a call that fills the KV cache computes: the cache is read by every later step
        compute, accumulated = (True, 0.0) if state is None or kv_cache_mode == "extract" else \
            state.decide(signal[start:end])
        decisions.append((state, start, end, compute, accumulated))
    computing = [row for _, start, end, compute, _ in decisions if compute for row in range(start, end)]

    out, residual = joint, None
    if computing:
        index = None if len(computing) == rows else torch.tensor(computing, device=joint.device)

        def pick(tensor):
            return tensor if tensor is None or index is None else tensor[index]

        shared_modulation = modulation if index is None else (
            torch.cat([modulation[index], modulation[-1:]]) if model.config.causal_condition else modulation[index])
        cache = cache_rows(kv_cache, computing, rows)
        computed = pick(joint)
        for layer, block in enumerate(model.transformer_blocks):
            computed = block(hidden_states=computed, modulation=shared_modulation, rotary_emb=rotary_emb,
                             attention_mask=pick(attention_mask), target_token_mask=modulation_mask,
                             layer_cache=None if cache is None else cache.get_layer(layer), kv_cache_mode=kv_cache_mode,
                             cache_write_slice=write, segments=segments, key_valid=pick(key_valid))
        if index is None:
            out, residual = computed, (computed - joint)[:, target]
        else:
            out, residual = joint.clone(), joint.new_zeros(rows, int(target.sum()), joint.shape[2])
            out[index], residual[index] = computed, (computed - joint[index])[:, target]
    if len(computing) < rows:
        out = out.clone() if out is joint else out
        for state, start, end, compute, _ in decisions:
            if not compute:  # NOTE: its text and condition tokens' outputs are not read (the pipeline slices)
                out[start:end, target] = joint[start:end, target] + state.residual

    output = model.proj_out(model.norm_out(out, temb, modulation_mask))
    for state, start, end, compute, accumulated in decisions:
        if state is not None:
            state.commit(signal[start:end], compute, accumulated, residual[start:end] if compute else None)
    return output
