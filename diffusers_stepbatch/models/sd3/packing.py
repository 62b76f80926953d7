"""One SD3Transformer2DModel forward over rows of different latent sizes and text lengths (packed tokens).

As `models/flux/packing.py` does for Flux: the model's own submodules, op for op as `SD3Transformer2DModel.forward`
and `JointTransformerBlock.forward` run them, over tokens packed without padding; each row's AdaLN modulation
reaches only its own tokens and attention (image tokens then text tokens, as `JointAttnProcessor2_0` orders
them; SD3.5's second, image-only attention too) stays inside each row. The patch embedding (a convolution
plus each size's crop of the positional table) and unpatchify run per size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...adapters.lora import lora_layers
from ..packing.attention import resolve
from ..packing.layout import PackedLayout, adaln_values, attend
from ..packing.support import unsupported_reason

IMAGE, TEXT = 0, 1


@dataclass
class SD3Part:
    """The rows of one shape: `SD3Transformer2DModel.forward`'s inputs for them (rows along dim 0)."""

    hidden_states: torch.Tensor  # [rows, channels, height, width] latents
    encoder_hidden_states: torch.Tensor  # [rows, text tokens, joint_attention_dim]
    pooled_projections: torch.Tensor  # [rows, pooled dim]
    timestep: torch.Tensor  # [rows], raw 0..1000


def sd3_packing_unsupported(transformer) -> str | None:
    """Why `sd3_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    reason = unsupported_reason(transformer, JointAttnProcessor2_0)
    if reason is None and any(block._chunk_size is not None for block in transformer.transformer_blocks):
        reason = "feed-forward chunking is enabled"
    return reason


def sd3_packed_forward(transformer, parts: Sequence[SD3Part], joint_attention_kwargs: dict | None = None,
                       skip_layers: Sequence[int] | None = None, packed_attention: str = "auto") -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part.

    `packed_attention` picks how attention stays inside each row (`models/packing/attention.py`).
    """
    return _forward(transformer, parts, joint_attention_kwargs=joint_attention_kwargs, skip_layers=skip_layers,
                    packed_attention=packed_attention)


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """`Packing.run`: one packed forward for calls of different latent sizes and text lengths (their arguments by
    name, all with the same `skip_layers` and attention kwargs); each call's output as the model returns it."""
    skips = {None if c.get("skip_layers") is None else tuple(c["skip_layers"]) for c in calls}
    if len(skips) > 1:
        raise ValueError(f"calls with skip_layers {sorted(skips, key=str)} can't share one packed forward; pack the "
                         "calls of each skip set apart")
    outputs = sd3_packed_forward(transformer, _parts(calls), calls[0].get("joint_attention_kwargs"),
                                 skip_layers=calls[0].get("skip_layers"), packed_attention=packed_attention)
    return [(out,) if not c.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for c, out in zip(calls, outputs)]


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor] | None:
    """`Packing.token_rows`: each token's row in the image and text streams of `pack_calls`' forward; None when
    the patch embedding holds LoRA layers (it runs per size, so its inputs map to no packed stream)."""
    layers = lora_layers(transformer)
    if any(layer in layers for layer in transformer.pos_embed.modules()):
        return None
    patch = transformer.config.patch_size
    return PackedLayout(rows=[c["hidden_states"].shape[0] for c in calls],
                        lengths=[((c["hidden_states"].shape[2] // patch) * (c["hidden_states"].shape[3] // patch),
                                  c["encoder_hidden_states"].shape[1]) for c in calls]).token_rows


def _parts(calls: Sequence[dict]) -> list[SD3Part]:
    return [SD3Part(c["hidden_states"], c["encoder_hidden_states"], c["pooled_projections"], c["timestep"])
            for c in calls]


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, parts, joint_attention_kwargs=None, skip_layers=None, packed_attention="auto"):
    embedded = [transformer.pos_embed(part.hidden_states).contiguous() for part in parts]
    layout = PackedLayout(
        rows=[e.shape[0] for e in embedded],
        lengths=[(e.shape[1], part.encoder_hidden_states.shape[1]) for e, part in zip(embedded, parts)],
        device=embedded[0].device,
    )
    hidden = layout.pack(IMAGE, embedded)
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    split = not lora_layers(transformer)  # NOTE: as in models/flux/packing.py: per-row LoRA maps inputs by token count
    temb = transformer.time_text_embed(torch.cat([p.timestep for p in parts]),
                                       torch.cat([p.pooled_projections for p in parts]))
    encoder = transformer.context_embedder(layout.pack(TEXT, [p.encoder_hidden_states for p in parts]))
    for index, block in enumerate(transformer.transformer_blocks):
        if skip_layers is None or index not in skip_layers:
            encoder, hidden = _block(block, layout, hidden, encoder, temb, method, split)

    norm_out = transformer.norm_out
    scale, shift = torch.chunk(norm_out.linear(norm_out.silu(temb).to(hidden.dtype)), 2, dim=1)
    scale1, shift = layout.row_values(IMAGE, torch.cat([1 + scale, shift], dim=1), 2)
    hidden = layout.modulate(IMAGE, norm_out.norm(hidden), scale1, shift)
    hidden = transformer.proj_out(hidden)
    return [_unpatchify(transformer, tokens, part.hidden_states.shape[-2:])
            for tokens, part in zip(layout.unpack(IMAGE, hidden), parts)]


def _unpatchify(transformer, tokens, size):
    patch, channels = transformer.config.patch_size, transformer.out_channels
    height, width = size[0] // patch, size[1] // patch
    tokens = tokens.reshape(tokens.shape[0], height, width, patch, patch, channels)
    tokens = torch.einsum("nhwpqc->nchpwq", tokens)
    return tokens.reshape(tokens.shape[0], channels, height * patch, width * patch)


def _sdpa(query, key, value):
    # NOTE: [rows, sequence, heads, dim] in and out; SDPA wants heads before the sequence.
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2)


def _qkv(attn, x, q, k, v, norm_q, norm_k):
    heads = attn.heads
    query, key, value = (proj(x).unflatten(-1, (heads, -1)) for proj in (q, k, v))
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value


def _image_only(layout: PackedLayout) -> PackedLayout:
    # NOTE: one per packed call (its blocks share it, and with flex attention its block mask).
    if "_image_only" not in layout.__dict__:
        layout.__dict__["_image_only"] = PackedLayout(layout.rows, [(lengths[IMAGE],) for lengths in layout.lengths],
                                                      device=layout.token_rows[0].device)
    return layout.__dict__["_image_only"]


def _block(block, layout, hidden, encoder, temb, method, split):
    norm1 = block.norm1
    emb = norm1.linear(norm1.silu(temb))
    normed = norm1.norm(hidden)
    if block.use_dual_attention:
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = adaln_values(layout, IMAGE, emb, 9)
        norm_hidden2 = layout.modulate(IMAGE, normed, scale_msa2, shift_msa2)
    else:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_values(layout, IMAGE, emb, 6)
    norm_hidden = layout.modulate(IMAGE, normed, scale_msa, shift_msa)

    context = block.norm1_context
    if block.context_pre_only:
        scale, shift = torch.chunk(context.linear(context.silu(temb).to(encoder.dtype)), 2, dim=1)
        scale1, shift = layout.row_values(TEXT, torch.cat([1 + scale, shift], dim=1), 2)
        norm_encoder = layout.modulate(TEXT, context.norm(encoder), scale1, shift)
    else:
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = adaln_values(
            layout, TEXT, context.linear(context.silu(temb)), 6)
        norm_encoder = layout.modulate(TEXT, context.norm(encoder), c_scale_msa, c_shift_msa)

    attn = block.attn
    query, key, value = _qkv(attn, norm_hidden, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
    e_query, e_key, e_value = _qkv(attn, norm_encoder, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                   attn.norm_added_q, attn.norm_added_k)
    image_out, text_out = attend(layout, [query, e_query], [key, e_key], [value, e_value], _sdpa, method)
    attn_output = attn.to_out[1](attn.to_out[0](image_out.to(query.dtype)))
    hidden = layout.gated_add(IMAGE, hidden, gate_msa, attn_output)

    if block.use_dual_attention:
        attn2 = block.attn2
        query2, key2, value2 = _qkv(attn2, norm_hidden2, attn2.to_q, attn2.to_k, attn2.to_v, attn2.norm_q,
                                    attn2.norm_k)
        image_only = _image_only(layout)
        (out2,) = attend(image_only, [query2], [key2], [value2], _sdpa, method)
        hidden = layout.gated_add(IMAGE, hidden, gate_msa2, attn2.to_out[1](attn2.to_out[0](out2.to(query2.dtype))))

    norm_hidden = layout.modulate(IMAGE, block.norm2(hidden), scale_mlp, shift_mlp)
    hidden = layout.gated_apply(IMAGE, hidden, gate_mlp, block.ff, norm_hidden, split)

    if block.context_pre_only:
        return None, hidden
    encoder = layout.gated_add(TEXT, encoder, c_gate_msa, attn.to_add_out(text_out.to(query.dtype)))
    norm_encoder = layout.modulate(TEXT, block.norm2_context(encoder), c_scale_mlp, c_shift_mlp)
    encoder = layout.gated_apply(TEXT, encoder, c_gate_mlp, block.ff_context, norm_encoder, split)
    return encoder, hidden
