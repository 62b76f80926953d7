"""One FluxTransformer2DModel forward over rows of different image sizes and text lengths (packed tokens).

It drives the model's own submodules the way `FluxTransformer2DModel.forward` does, op for op, with three
differences that keep each row's result its own: tokens of all rows are packed without padding (see
`packing/layout.py`), each row's AdaLN modulation (from its timestep, guidance and pooled text) reaches only its own
tokens, and attention runs inside each row with the row's own RoPE positions. TeaCache decisions stay per
request and CFG branch, as in `models/flux/teacache.py`, whose state holds layout-free [rows, tokens, dim] tensors
so a request may alternate between packed and ordinary calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.utils import apply_lora_scale

from ...adapters.lora import lora_layers
from ...cache.teacache import TeaCacheState
from ..packing.attention import resolve
from ..packing.joint import (IMAGE, TEXT, attention_fn, double_block, joint_stream_layout, joint_stream_rotary,
                             parts_layout, per_head, rope, stream_rotary, teacache_blocks, token_streams)
from ..packing.layout import adaln_values, attend
from ..packing.rotary_memo import remembered
from ..packing.support import reproduces_call, unsupported_reason



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


def flux_packed_forward(transformer, parts: Sequence[FluxPart], joint_attention_kwargs: dict | None = None,
                        packed_attention: str = "auto") -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part.

    `packed_attention` picks how attention stays inside each row (`models/packing/attention.py`).
    """
    return _forward(transformer, parts, joint_attention_kwargs=joint_attention_kwargs,
                    packed_attention=packed_attention)


# the forward's arguments that the packed and TeaCache forwards reproduce; a call with any other set runs as is
REPRODUCED_ARGUMENTS = frozenset({"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                                  "guidance", "txt_ids", "img_ids", "joint_attention_kwargs", "return_dict"})


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `FluxTransformer2DModel.forward` to pack, tokens per row), or None."""
    if not reproduces_call(arguments, REPRODUCED_ARGUMENTS, "joint_attention_kwargs"):
        return None
    attention_kwargs = arguments.get("joint_attention_kwargs") or {}
    hidden, text = arguments["hidden_states"], arguments["encoder_hidden_states"]
    key = (arguments.get("guidance") is None, attention_kwargs.get("scale"),
           tuple(arguments["pooled_projections"].shape[1:]), hidden.dtype, text.dtype, str(hidden.device),
           arguments.get("return_dict", True))
    return key, hidden.shape[1] + text.shape[1]


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different sizes; each call's output as the model would return it."""
    parts = _parts(calls, teacache)
    outputs = flux_packed_forward(transformer, parts, calls[0].get("joint_attention_kwargs"), packed_attention)
    return [(out,) if not c.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for c, out in zip(calls, outputs)]


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """`Packing.token_rows`: each token's row in the text, image (Kontext's reference tokens included) and joint
    streams of `pack_calls`' forward; its other LoRA layer inputs (the time, guidance and pooled-text embedding,
    the modulation layers) hold rows on dim 0, in call order."""
    return flux_token_streams(_parts(calls, [None] * len(calls)))


def _parts(calls: Sequence[dict], teacache: Sequence) -> list[FluxPart]:
    def ids(tensor):
        return tensor[0] if tensor.ndim == 3 else tensor  # NOTE: the model reads a 3-D tensor's first row too

    return [FluxPart(hidden_states=c["hidden_states"], encoder_hidden_states=c["encoder_hidden_states"],
                     pooled_projections=c["pooled_projections"], timestep=c["timestep"], guidance=c.get("guidance"),
                     txt_ids=ids(c["txt_ids"]), img_ids=ids(c["img_ids"]), teacache=states)
            for c, states in zip(calls, teacache)]


def flux_token_streams(parts: Sequence[FluxPart]) -> list[torch.Tensor]:
    """The row of every token in each packed stream the forward runs layers on: text, image, and the single
    blocks' joint stream (each row's text then image tokens). Per-row LoRA maps layer inputs to rows with it."""
    return token_streams(parts)


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, parts, joint_attention_kwargs=None, packed_attention="auto"):
    first = parts[0]
    layout = parts_layout(parts)
    hidden = transformer.x_embedder(layout.pack(IMAGE, [p.hidden_states for p in parts]))
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    timestep = torch.cat([p.timestep for p in parts]).to(hidden.dtype) * 1000
    pooled = torch.cat([p.pooled_projections for p in parts])
    if first.guidance is not None:
        guidance = torch.cat([p.guidance for p in parts]).to(hidden.dtype) * 1000
        temb = transformer.time_text_embed(timestep, guidance, pooled)
    else:
        temb = transformer.time_text_embed(timestep, pooled)
    encoder = transformer.context_embedder(layout.pack(TEXT, [p.encoder_hidden_states for p in parts]))
    rotary = _part_rotary(transformer, parts)

    states = [s for p in parts for s in (p.teacache or [None] * p.hidden_states.shape[0])]
    if all(state is None for state in states):
        out = _blocks(transformer, layout, hidden, encoder, temb, rotary, method)
    else:
        out = _teacache_blocks(transformer, layout, states, hidden, encoder, temb, rotary, method)

    norm_out = transformer.norm_out
    emb = norm_out.linear(norm_out.silu(temb).to(out.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    scale1, shift = layout.row_values(IMAGE, torch.cat([1 + scale, shift], dim=1), 2)
    out = layout.modulate(IMAGE, norm_out.norm(out), scale1, shift)
    return layout.unpack(IMAGE, transformer.proj_out(out))


def _part_rotary(transformer, parts):
    """Per part, the model's (cos, sin) of its text then image positions (one row's worth)."""
    return [text_image_rotary(transformer, part.txt_ids, part.img_ids) for part in parts]


def text_image_rotary(transformer, txt_ids: torch.Tensor, img_ids: torch.Tensor):
    """The model's (cos, sin) of the text then image positions, once per ids tensors (`rotary_memo.py`)."""
    return remembered(transformer.pos_embed, (txt_ids, img_ids),
                      lambda: transformer.pos_embed(torch.cat((txt_ids, img_ids), dim=0)))


def _modulation(layout, stream, norm, temb, chunks):
    """An AdaLN-Zero layer's (shift, 1 + scale, gate) chunks per row, as `stream`'s tokens see them."""
    return adaln_values(layout, stream, norm.linear(norm.silu(temb)), chunks)


def _double_block(block, layout, hidden, encoder, temb, rotary, method, split):
    image_mods = _modulation(layout, IMAGE, block.norm1, temb, 6)
    text_mods = _modulation(layout, TEXT, block.norm1_context, temb, 6)
    return double_block(block, layout, hidden, encoder, (block.norm1.norm, block.norm1_context.norm),
                        image_mods, text_mods, rotary, method, split)


def _single_block(block, joint_layout, joint, temb, rotary, method, split, mixed):
    """`joint` holds each row's text then image tokens (`joint_stream_layout`), as FluxSingleTransformerBlock sees it.

    `mixed` is a [tokens, attention dim + mlp dim] workspace for the model's torch.cat([attn_output, mlp]).
    """
    shift, scale, gate = _modulation(joint_layout, 0, block.norm, temb, 3)
    norm = joint_layout.modulate(0, block.norm.norm(joint), scale, shift)
    attn = block.attn
    inner = attn.heads * attn.head_dim
    # NOTE: one workspace for all single blocks, written in place of the cat: with long rows a fresh
    # [tokens, attention + mlp dim] tensor per block is fresh memory pages per block.
    joint_layout.apply_into(0, lambda x: block.act_mlp(block.proj_mlp(x)), norm, mixed[:, inner:], split)
    query = rope(attn.norm_q(per_head(attn, attn.to_q(norm))), rotary)
    key = rope(attn.norm_k(per_head(attn, attn.to_k(norm))), rotary)
    value = per_head(attn, attn.to_v(norm))
    attend(joint_layout, [query], [key], [value], attention_fn(attn), method, out=[mixed[:, :inner]])
    joint = joint_layout.gated_add(0, joint, gate, block.proj_out(mixed))
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint


def _blocks(transformer, layout, hidden, encoder, temb, part_rotary, method):
    rotary = stream_rotary(layout, part_rotary)
    # NOTE: MLPs may run per part (temporaries of one part's size) unless per-row LoRA maps their inputs to
    # rows by token count, which a part's slice would not match.
    split = not lora_layers(transformer)
    for block in transformer.transformer_blocks:
        encoder, hidden = _double_block(block, layout, hidden, encoder, temb, rotary, method, split)
    if len(transformer.single_transformer_blocks):
        joint_layout = joint_stream_layout(layout)
        joint = hidden.new_empty(joint_layout.tokens(0), hidden.shape[1])
        joint_parts = joint_layout.unpack(0, joint)
        for joint_part, text, image in zip(joint_parts, layout.unpack(TEXT, encoder), layout.unpack(IMAGE, hidden)):
            joint_part[:, :text.shape[1]] = text
            joint_part[:, text.shape[1]:] = image
        joint_rotary = joint_stream_rotary(layout, part_rotary)
        first = transformer.single_transformer_blocks[0]
        mixed = joint.new_empty(joint.shape[0], first.proj_out.in_features)
        for block in transformer.single_transformer_blocks:
            joint = _single_block(block, joint_layout, joint, temb, joint_rotary, method, split, mixed)
        hidden = layout.pack(IMAGE, [part[:, text_len:] for part, (text_len, _) in
                                     zip(joint_layout.unpack(0, joint), layout.lengths)])
    return hidden


def _teacache_blocks(transformer, layout, states, hidden, encoder, temb, part_rotary, method):
    """`_blocks` with per-state TeaCache decisions: skipping rows add their cached residual instead."""
    norm1 = transformer.transformer_blocks[0].norm1
    # NOTE: the signal op for op as TeaCache computes it on an ordinary call (mul, then add), so a request's
    # decisions don't depend on whether its step ran packed.
    shift, scale = norm1.linear(norm1.silu(temb)).index_select(0, layout.token_rows[IMAGE]).chunk(6, dim=1)[:2]
    signal = norm1.norm(hidden) * (1 + scale) + shift

    def run(sub_layout, sub_hidden, sub_encoder, rows, parts):
        return _blocks(transformer, sub_layout, sub_hidden, sub_encoder, temb.index_select(0, rows),
                       [part_rotary[part] for part in parts], method)

    return teacache_blocks(layout, states, hidden, encoder, signal, run)
