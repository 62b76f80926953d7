"""Qwen-Image 2.1's blocks over the tokens of one or more calls as one stream, for the packed and TeaCache forwards.

The blocks' norms, projections and MLPs run once over every call's tokens, each token modulated by its row's (or
its row's t=0) scales and gates; attention runs per call, as `QwenImage21AttnProcessor` runs it (the block-causal
prefix, its KV cache filled or read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

from .joint import JointCall


def run_blocks(model, calls: Sequence[JointCall]) -> list[torch.Tensor]:
    """The blocks' output of each call, [rows, tokens, dim]."""
    sizes = [call.joint.shape[0] * call.joint.shape[1] for call in calls]
    hidden = torch.cat([call.joint.flatten(0, 1) for call in calls])
    rotary = torch.cat([call.rotary_emb.repeat(call.joint.shape[0], 1) for call in calls])
    # NOTE: every block reads the same modulation; per token, its row's (or its t=0 row's) scales and gates
    scale1, gate1, scale2, gate2 = (torch.cat(parts) for parts in zip(*(
        [params.expand(*call.joint.shape[:2], -1).flatten(0, 1) for params in call.token_modulation()]
        for call in calls)))
    for layer, block in enumerate(model.transformer_blocks):
        attention = _attention(block.attn, block.img_norm1(hidden) * (1 + scale1), rotary, calls, sizes, layer)
        hidden = hidden + gate1.tanh() * attention
        hidden = hidden + gate2.tanh() * block.img_mlp(block.img_norm2(hidden) * (1 + scale2))
        if hidden.dtype == torch.float16:
            hidden = hidden.clip(-65504, 65504)
    return [part.unflatten(0, call.joint.shape[:2]) for part, call in zip(hidden.split(sizes), calls)]


def _attention(attn, hidden: torch.Tensor, rotary: torch.Tensor, calls: Sequence[JointCall], sizes: list[int],
               layer: int) -> torch.Tensor:
    """`QwenImage21AttnProcessor` over the stream's tokens: projections once, attention per call."""
    head_dim = attn.inner_dim // attn.heads
    query, key, value = (projection(hidden).unflatten(-1, (-1, head_dim))
                         for projection in (attn.to_q, attn.to_k, attn.to_v))
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    query = apply_rotary_emb_qwen(query[None], rotary, use_real=False)[0]
    key = apply_rotary_emb_qwen(key[None], rotary, use_real=False)[0]
    processor = attn.processor
    outputs = []
    for call, q, k, v in zip(calls, query.split(sizes), key.split(sizes), value.split(sizes)):
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
