"""One FluxTransformer2DModel forward over rows of different image sizes and text lengths (packed tokens).

It drives the model's own submodules the way `FluxTransformer2DModel.forward` does, op for op, with three
differences that keep each row's result its own: tokens of all rows are packed without padding (see
`layout.py`), each row's AdaLN modulation (from its timestep, guidance and pooled text) reaches only its own
tokens, and attention runs inside each row with the row's own RoPE positions. TeaCache decisions stay per
request and CFG branch, as in `cache/teacache.py`, whose state holds layout-free [rows, tokens, dim] tensors
so a request may alternate between packed and ordinary calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.utils import apply_lora_scale

from ..cache.teacache import TeaCacheState, _row_groups
from .layout import PackedLayout, attend
from .support import unsupported_reason

TEXT, IMAGE = 0, 1


@dataclass
class FluxPart:
    """The rows of one shape: `FluxTransformer2DModel.forward`'s inputs for them (rows along dim 0)."""

    hidden_states: torch.Tensor  # [rows, image tokens, in_channels]
    encoder_hidden_states: torch.Tensor  # [rows, text tokens, joint_attention_dim]
    pooled_projections: torch.Tensor  # [rows, pooled dim]
    timestep: torch.Tensor  # [rows], t / 1000 as FluxPipeline passes it
    guidance: torch.Tensor | None  # [rows] or None
    txt_ids: torch.Tensor  # [text tokens, 3]
    img_ids: torch.Tensor  # [image tokens, 3]
    teacache: Sequence[TeaCacheState | None] | None = None  # per row


def flux_packing_unsupported(transformer) -> str | None:
    """Why `flux_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    return unsupported_reason(transformer, FluxAttnProcessor)


def flux_packed_forward(transformer, parts: Sequence[FluxPart],
                        joint_attention_kwargs: dict | None = None) -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part."""
    return _forward(transformer, parts, joint_attention_kwargs=joint_attention_kwargs)


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, parts, joint_attention_kwargs=None):
    first = parts[0]
    layout = PackedLayout(
        rows=[p.hidden_states.shape[0] for p in parts],
        lengths=[(p.encoder_hidden_states.shape[1], p.hidden_states.shape[1]) for p in parts],
        device=first.hidden_states.device,
    )
    hidden = transformer.x_embedder(layout.pack(IMAGE, [p.hidden_states for p in parts]))
    timestep = torch.cat([p.timestep for p in parts]).to(hidden.dtype) * 1000
    pooled = torch.cat([p.pooled_projections for p in parts])
    if first.guidance is not None:
        guidance = torch.cat([p.guidance for p in parts]).to(hidden.dtype) * 1000
        temb = transformer.time_text_embed(timestep, guidance, pooled)
    else:
        temb = transformer.time_text_embed(timestep, pooled)
    encoder = transformer.context_embedder(layout.pack(TEXT, [p.encoder_hidden_states for p in parts]))
    rotary = _packed_rotary(transformer, layout, parts)

    states = [s for p in parts for s in (p.teacache or [None] * p.hidden_states.shape[0])]
    if all(state is None for state in states):
        out = _blocks(transformer, layout, hidden, encoder, temb, rotary)
    else:
        out = _teacache_blocks(transformer, layout, states, hidden, encoder, temb, rotary)

    norm_out = transformer.norm_out
    emb = norm_out.linear(norm_out.silu(temb).to(out.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    out = norm_out.norm(out) * layout.per_token(IMAGE, 1 + scale) + layout.per_token(IMAGE, shift)
    return layout.unpack(IMAGE, transformer.proj_out(out))


def _packed_rotary(transformer, layout, parts):
    """Per-stream (cos, sin) for every packed token: each part's own positions, repeated for its rows."""
    per_stream = [([], []) for _ in range(2)]
    for part_rows, part in zip(layout.rows, parts):
        cos, sin = transformer.pos_embed(torch.cat((part.txt_ids, part.img_ids), dim=0))
        text_len = part.txt_ids.shape[0]
        for stream, window in ((TEXT, slice(0, text_len)), (IMAGE, slice(text_len, None))):
            per_stream[stream][0].append(cos[window].repeat(part_rows, 1))
            per_stream[stream][1].append(sin[window].repeat(part_rows, 1))
    return [(torch.cat(cos), torch.cat(sin)) for cos, sin in per_stream]


def _rope(x: torch.Tensor, rotary) -> torch.Tensor:
    # NOTE: [tokens, heads, dim] seen as one sequence of `tokens` with per-token (cos, sin).
    return apply_rotary_emb(x.unsqueeze(0), rotary, sequence_dim=1).squeeze(0)


def _attention_fn(attn):
    processor = attn.processor

    def attention(query, key, value):
        return dispatch_attention_fn(query, key, value, attn_mask=None, backend=processor._attention_backend,
                                     parallel_config=processor._parallel_config)

    return attention


def _heads(attn, x):
    return x.unflatten(-1, (-1, attn.head_dim))


def _modulation(norm, temb, token_rows, chunks):
    """An AdaLN-Zero layer's shift / scale / gate chunks, computed per row and repeated for the row's tokens."""
    return norm.linear(norm.silu(temb)).index_select(0, token_rows).chunk(chunks, dim=1)


def _double_block(block, layout, hidden, encoder, temb, rotary):
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _modulation(
        block.norm1, temb, layout.token_rows[IMAGE], 6)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(
        block.norm1_context, temb, layout.token_rows[TEXT], 6)
    norm_hidden = block.norm1.norm(hidden) * (1 + scale_msa) + shift_msa
    norm_encoder = block.norm1_context.norm(encoder) * (1 + c_scale_msa) + c_shift_msa

    attn = block.attn
    query, key, value = (attn.norm_q(_heads(attn, attn.to_q(norm_hidden))),
                         attn.norm_k(_heads(attn, attn.to_k(norm_hidden))), _heads(attn, attn.to_v(norm_hidden)))
    e_query, e_key, e_value = (attn.norm_added_q(_heads(attn, attn.add_q_proj(norm_encoder))),
                               attn.norm_added_k(_heads(attn, attn.add_k_proj(norm_encoder))),
                               _heads(attn, attn.add_v_proj(norm_encoder)))
    text_out, image_out = attend(
        layout,
        [_rope(e_query, rotary[TEXT]), _rope(query, rotary[IMAGE])],
        [_rope(e_key, rotary[TEXT]), _rope(key, rotary[IMAGE])],
        [e_value, value], _attention_fn(attn),
    )
    attn_output = attn.to_out[1](attn.to_out[0](image_out.to(query.dtype)))
    context_attn_output = attn.to_add_out(text_out.to(query.dtype))

    hidden = hidden + gate_msa * attn_output
    norm_hidden = block.norm2(hidden) * (1 + scale_mlp) + shift_mlp
    hidden = hidden + gate_mlp * block.ff(norm_hidden)

    encoder = encoder + c_gate_msa * context_attn_output
    norm_encoder = block.norm2_context(encoder) * (1 + c_scale_mlp) + c_shift_mlp
    encoder = encoder + c_gate_mlp * block.ff_context(norm_encoder)
    if encoder.dtype == torch.float16:
        encoder = encoder.clip(-65504, 65504)
    return encoder, hidden


def _single_block(block, layout, joint_rows, joint, temb, rotary):
    """`joint` is [text tokens of all rows; image tokens of all rows], as FluxSingleTransformerBlock sees it."""
    shift, scale, gate = _modulation(block.norm, temb, joint_rows, 3)
    norm = block.norm.norm(joint) * (1 + scale) + shift
    mlp = block.act_mlp(block.proj_mlp(norm))
    attn = block.attn
    query = _rope(attn.norm_q(_heads(attn, attn.to_q(norm))), rotary)
    key = _rope(attn.norm_k(_heads(attn, attn.to_k(norm))), rotary)
    value = _heads(attn, attn.to_v(norm))
    text_tokens = layout.tokens(TEXT)
    streams = lambda x: [x[:text_tokens], x[text_tokens:]]  # noqa: E731
    text_out, image_out = attend(layout, streams(query), streams(key), streams(value), _attention_fn(attn))
    attn_output = torch.cat([text_out, image_out]).to(query.dtype)
    joint = joint + gate * block.proj_out(torch.cat([attn_output, mlp], dim=1))
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint


def _blocks(transformer, layout, hidden, encoder, temb, rotary):
    for block in transformer.transformer_blocks:
        encoder, hidden = _double_block(block, layout, hidden, encoder, temb, rotary)
    if len(transformer.single_transformer_blocks):
        joint = torch.cat([encoder, hidden])
        joint_rotary = tuple(torch.cat([rotary[TEXT][i], rotary[IMAGE][i]]) for i in range(2))
        joint_rows = torch.cat(layout.token_rows)
        for block in transformer.single_transformer_blocks:
            joint = _single_block(block, layout, joint_rows, joint, temb, joint_rotary)
        hidden = joint[layout.tokens(TEXT):]
    return hidden


def _teacache_blocks(transformer, layout, states, hidden, encoder, temb, rotary):
    """`_blocks` with per-state TeaCache decisions: skipping rows add their cached residual instead."""
    norm1 = transformer.transformer_blocks[0].norm1
    shift, scale = _modulation(norm1, temb, layout.token_rows[IMAGE], 6)[:2]
    signal = norm1.norm(hidden) * (1 + scale) + shift

    decisions = []  # (state, rows, token slice, own signal, compute, accumulated)
    for state, start, end in _row_groups(states):
        part, inner = layout.part_of_row(start)
        tokens = layout.row_tokens(IMAGE, part, inner, inner + end - start)
        own = signal[tokens].unflatten(0, (end - start, -1))
        compute, accumulated = (True, 0.0) if state is None else state.decide(own)
        decisions.append((state, range(start, end), tokens, own, compute, accumulated))
    compute_rows = [r for _, rows, _, _, compute, _ in decisions if compute for r in rows]

    out = torch.empty_like(hidden)
    residual = None
    if compute_rows:
        sub_layout, (text_index, image_index) = layout.select_rows(compute_rows)
        sub_rotary = [tuple(t.index_select(0, index) for t in rotary[k]) for k, index in ((TEXT, text_index),
                                                                                          (IMAGE, image_index))]
        sub_hidden = hidden.index_select(0, image_index)
        sub_out = _blocks(transformer, sub_layout, sub_hidden, encoder.index_select(0, text_index),
                          temb.index_select(0, torch.tensor(compute_rows, device=temb.device)), sub_rotary)
        out[image_index] = sub_out
        residual = torch.empty_like(hidden)
        residual[image_index] = sub_out - sub_hidden
    for state, rows, tokens, _, compute, _ in decisions:
        if not compute:
            out[tokens] = hidden[tokens] + state.residual.flatten(0, 1)
    for state, rows, tokens, own, compute, accumulated in decisions:
        if state is not None:
            own_residual = residual[tokens].unflatten(0, (len(rows), -1)).clone() if compute else None
            state.commit(own.clone(), compute, accumulated, own_residual)
    return out
