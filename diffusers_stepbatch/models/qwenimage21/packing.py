"""Qwen-Image 2.1 calls of other layouts (sizes, prompt token counts, condition images) as one packed call.

Each call keeps its own joint sequence, positions and modulation rows; the blocks' norms, projections and MLPs run
once over every call's tokens, and attention runs per call, as the model's per-segment processor runs it (the
block-causal prefix, its KV cache filled or read). Calls that fill their KV cache, read it or have none pack
together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    _select_modulation_rows,
    apply_rotary_emb_qwen,
)
from diffusers.utils import apply_lora_scale

from ..packing.support import unsupported_reason
from .joint import REPRODUCED, SLOT_TOKENS, JointCall, joint_call, reproduced
from .teacache import teacache_call


def qwenimage21_packing_unsupported(transformer) -> str | None:
    """Why the packed forward can't stand in for this transformer's forward, or None when it can."""
    return unsupported_reason(transformer, QwenImage21AttnProcessor)


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls to pack, tokens per row), or None."""
    if not reproduced(arguments):
        return None
    hidden, mask, timestep = arguments["hidden_states"], arguments.get("img_mask"), arguments.get("timestep")
    if not (isinstance(mask, torch.Tensor) and isinstance(timestep, torch.Tensor) and timestep.ndim == 1
            and timestep.shape[0] == hidden.shape[0]):
        return None
    tokens = hidden.shape[1] if arguments.get("kv_cache_mode") == "cached" else \
        int(torch.where(mask[0], SLOT_TOKENS, 1).sum())
    scale = (arguments.get("attention_kwargs") or {}).get("scale")
    return (scale, hidden.dtype, str(hidden.device), arguments.get("return_dict", True)), tokens


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of several layouts; each call's output as the model would return it."""
    if any(state is not None for states in teacache for state in states or ()):
        # NOTE: TeaCache decides per call here: each call runs its own TeaCache forward
        outputs = [teacache_call(transformer, states or [None] * call["hidden_states"].shape[0], call)
                   for call, states in zip(calls, teacache)]
        return [output if output is not None else transformer(**call) for output, call in zip(outputs, calls)]
    arguments = [{name: call.get(name) for name in REPRODUCED - {"return_dict"}} for call in calls]
    outputs = _forward(transformer, arguments, attention_kwargs=calls[0].get("attention_kwargs"))
    return [(out,) if not call.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for call, out in zip(calls, outputs)]


@apply_lora_scale("attention_kwargs")
def _forward(model, arguments: Sequence[dict], attention_kwargs=None) -> list[torch.Tensor]:
    joints = [joint_call(model, **call) for call in arguments]
    sizes = [call.joint.shape[0] * call.joint.shape[1] for call in joints]
    hidden = torch.cat([call.joint.flatten(0, 1) for call in joints])
    rotary = torch.cat([call.rotary_emb.repeat(call.joint.shape[0], 1) for call in joints])
    # NOTE: every block reads the same modulation; per token, its row's (or the t=0 row's) scales and gates
    scale1, gate1, scale2, gate2 = (torch.cat(parts) for parts in zip(*(_token_modulation(call) for call in joints)))
    for layer, block in enumerate(model.transformer_blocks):
        attention = _attention(block.attn, block.img_norm1(hidden) * (1 + scale1), rotary, joints, sizes, layer)
        hidden = hidden + gate1.tanh() * attention
        hidden = hidden + gate2.tanh() * block.img_mlp(block.img_norm2(hidden) * (1 + scale2))
        if hidden.dtype == torch.float16:
            hidden = hidden.clip(-65504, 65504)
    return [model.proj_out(model.norm_out(part.unflatten(0, call.joint.shape[:2]), call.temb, call.modulation_mask))
            for part, call in zip(hidden.split(sizes), joints)]


def _token_modulation(call: JointCall) -> list[torch.Tensor]:
    """The call's (scale, gate) of the attention and of the MLP, per token: [rows * tokens, dim] each."""
    parts = []
    for half in call.modulation.chunk(2, dim=-1):
        for params in half.chunk(2, dim=-1):
            per_token = _select_modulation_rows(params, call.modulation_mask)
            parts.append(per_token.expand(call.joint.shape[0], call.joint.shape[1], -1).flatten(0, 1))
    return parts


def _attention(attn, hidden: torch.Tensor, rotary: torch.Tensor, joints: list[JointCall], sizes: list[int],
               layer: int) -> torch.Tensor:
    """`QwenImage21AttnProcessor` over packed tokens: projections once, attention per call."""
    head_dim = attn.inner_dim // attn.heads
    query, key, value = (projection(hidden).unflatten(-1, (-1, head_dim))
                         for projection in (attn.to_q, attn.to_k, attn.to_v))
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    query = apply_rotary_emb_qwen(query[None], rotary, use_real=False)[0]
    key = apply_rotary_emb_qwen(key[None], rotary, use_real=False)[0]
    processor = attn.processor
    outputs = []
    for call, q, k, v in zip(joints, query.split(sizes), key.split(sizes), value.split(sizes)):
        q, k, v = (t.unflatten(0, call.joint.shape[:2]) for t in (q, k, v))
        cache = None if call.kv_cache is None or call.kv_cache_mode is None else call.kv_cache.get_layer(layer)
        if cache is not None and call.write is not None:
            cache.store(k[:, call.write].clone(), v[:, call.write].clone())
        elif cache is not None:
            cached_k, cached_v = cache.get()
            k, v = torch.cat([cached_k, k], dim=1), torch.cat([cached_v, v], dim=1)
        if call.segments is None:
            out = dispatch_attention_fn(q, k, v, attn_mask=call.attention_mask, dropout_p=0.0,
                                        backend=processor._attention_backend,
                                        parallel_config=processor._parallel_config)
        else:
            out = _prefill(q, k, v, call, processor)
        outputs.append(out[:, :q.shape[1]].flatten(2, 3).type_as(q).flatten(0, 1))
    return attn.to_out[1](attn.to_out[0](torch.cat(outputs)))


def _prefill(query, key, value, call: JointCall, processor) -> torch.Tensor:
    """The processor's prefill: each prefix segment attends to the keys before its end (text causally), the target
    image to every key; padded text keys dropped."""
    prefix_len = call.segments[-1][1] if call.segments else 0
    outputs = []
    for start, end, is_text in call.segments:
        mask = None
        if is_text:
            length = end - start
            mask = torch.cat([torch.ones(length, start, dtype=torch.bool, device=query.device),
                              torch.tril(torch.ones(length, length, dtype=torch.bool, device=query.device))],
                             dim=1)[None, None]
        if call.key_valid is not None:
            valid = call.key_valid[:, None, None, :end]
            mask = valid if mask is None else mask & valid
        outputs.append(dispatch_attention_fn(query[:, start:end], key[:, :end], value[:, :end], attn_mask=mask,
                                             dropout_p=0.0, backend=None, parallel_config=processor._parallel_config))
    valid = None if call.key_valid is None else call.key_valid[:, None, None, :]
    outputs.append(dispatch_attention_fn(query[:, prefix_len:], key, value, attn_mask=valid, dropout_p=0.0,
                                         backend=None, parallel_config=processor._parallel_config))
    return torch.cat(outputs, dim=1)
