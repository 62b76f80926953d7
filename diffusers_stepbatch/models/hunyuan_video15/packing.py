"""One HunyuanVideo15Transformer3DModel forward over rows of different frame counts and sizes (packed tokens).

It drives the model's own submodules the way `HunyuanVideo15Transformer3DModel.forward` does, op for op, with
three differences that keep each row's result its own: every row's video and text tokens are packed without
padding (see `layout.py`), each row's AdaLN modulation (`norm1` / `norm1_context` / `norm_out` of its timestep)
reaches only its own tokens, and the joint attention runs inside each row with the RoPE frequencies of the row's
own latent grid.

Text padding is dropped rather than masked: the model orders each row's valid tokens first (image, ByT5, the
refined MLLM text) and masks the rest out as attention keys with a boolean mask, so they never reach a kept token;
text tokens carry no RoPE. The text refiner (`context_embedder`) runs per call on the padded text with its mask,
as the model runs it. Whether a call is text-to-video (all image embeds zero) is decided per call, as the model
decides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.utils import apply_lora_scale

from ...adapters.lora import LoraLayout, lora_active, lora_layers, lora_layout, row_subset
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import commit_rows, computing_rows, decide_rows
from ..packing.attention import resolve
from ..packing.layout import PackedLayout, adaln_values, attend
from ..packing.support import reproduces_call, unsupported_reason

VIDEO, TEXT = 0, 1

# the forward's arguments a packed call reproduces; a call with any other argument set runs unpacked
_PACKED_ARGUMENTS = frozenset({
    "hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "timestep_r",
    "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds", "attention_kwargs", "return_dict"})


def hunyuan_video15_packing_unsupported(transformer) -> str | None:
    """Why `hunyuan_video15_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    # NOTE: the text refiner runs as the model runs it, whatever its attention processor
    return unsupported_reason(transformer, HunyuanVideo15AttnProcessor2_0, called_whole=("context_embedder",))


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `HunyuanVideo15Transformer3DModel.forward` to pack, tokens per row), or None."""
    if not reproduces_call(arguments, _PACKED_ARGUMENTS, "attention_kwargs"):
        return None
    hidden = arguments["hidden_states"]
    texts = [arguments.get(name) for name in ("encoder_hidden_states", "encoder_hidden_states_2", "image_embeds")]
    masks = [arguments.get(name) for name in ("encoder_attention_mask", "encoder_attention_mask_2")]
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 5 or any(t is None or t.ndim != 3 for t in texts):
        return None
    if any(m is None or m.shape != t.shape[:2] for m, t in zip(masks, texts)):
        return None
    timestep = arguments["timestep"]
    if not isinstance(timestep, torch.Tensor) or timestep.numel() != hidden.shape[0]:
        return None
    key = ((arguments.get("attention_kwargs") or {}).get("scale"), hidden.dtype, texts[0].dtype, str(hidden.device),
           arguments.get("return_dict", True), arguments.get("timestep_r") is None)
    return key, hidden.shape[2] * hidden.shape[3] * hidden.shape[4] + sum(t.shape[1] for t in texts)


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different sizes; each output as the model returns it."""
    outputs = hunyuan_video15_packed_forward(transformer, calls, calls[0].get("attention_kwargs"), packed_attention,
                                             teacache)
    return [(out,) if not call.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for call, out in zip(calls, outputs)]


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """Per token stream of `pack_calls`' forward (video tokens, kept text tokens, in packed order), each token's row
    (calls' rows in call order). Each call's embeddings run on its own rows (`lora_layout`)."""
    config = transformer.config
    lengths = []
    for call in calls:
        frames, height, width = call["hidden_states"].shape[2:]
        video = (frames // config.patch_size_t) * (height // config.patch_size) * (width // config.patch_size)
        image_embeds = call["image_embeds"]
        image = 0 if torch.all(image_embeds == 0) else image_embeds.shape[1]  # NOTE: as `_call_rows` keeps them
        kept = call["encoder_attention_mask"].bool().sum(1) + call["encoder_attention_mask_2"].bool().sum(1) + image
        lengths.extend((video, int(text)) for text in kept)
    return _token_streams(lengths, range(len(lengths)))


def _order(lengths: Sequence[tuple[int, int]]) -> list[int]:
    # NOTE: rows of equal token counts form one part of the layout, so they attend as one batch.
    return sorted(range(len(lengths)), key=lambda r: lengths[r])


def _token_streams(lengths: Sequence[tuple[int, int]], ids: Sequence[int]) -> list[torch.Tensor]:
    """Each packed video and text token's row (`ids[r]`: row r's number in the forward), rows in `_order`."""
    order = _order(lengths)
    ordered = torch.tensor([ids[r] for r in order])
    return [ordered.repeat_interleave(torch.tensor([lengths[r][stream] for r in order])) for stream in (VIDEO, TEXT)]


def _lengths(rows) -> list[tuple[int, int]]:
    return [(row.video.shape[0], row.text.shape[0]) for row in rows]


def _lora_layout(transformer, rows) -> LoraLayout | None:
    """Per-row values in `rows` order, token streams in packed order; None without per-row LoRA."""
    if not lora_active(transformer):
        return None
    ids = [row.index for row in rows]
    return LoraLayout(ids, _token_streams(_lengths(rows), ids))


def hunyuan_video15_packed_forward(transformer, calls: Sequence[dict], attention_kwargs: dict | None = None,
                                   packed_attention: str = "auto", teacache: Sequence | None = None
                                   ) -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every call (its arguments by name), as one packed call.

    `teacache[i]` holds call i's per-row TeaCache states or None (`models/hunyuan_video15/teacache.py`).

    >>> outputs = hunyuan_video15_packed_forward(pipe.transformer, [dict(hidden_states=x, timestep=t, ...), ...])
    """
    return _forward(transformer, calls, attention_kwargs=attention_kwargs, packed_attention=packed_attention,
                    teacache=teacache)


@dataclass
class _Row:
    call: int
    index: int  # its row in the forward: calls' rows in call order
    video: torch.Tensor  # [video tokens, inner_dim], patch-embedded
    text: torch.Tensor  # [kept text tokens, inner_dim]: valid image, ByT5 and refined MLLM tokens
    temb: torch.Tensor  # [inner_dim]
    rotary: tuple[torch.Tensor, torch.Tensor]  # per video token (cos, sin)


def _call_rows(transformer, index: int, call: dict, first: int) -> list[_Row]:
    """The model's embeddings of one call (`forward` up to the blocks), as rows with their text padding dropped;
    `first`: its first row's number in the forward."""
    hidden, timestep, mask = call["hidden_states"], call["timestep"], call["encoder_attention_mask"]
    rotary = transformer.rope(hidden)
    temb = transformer.time_embed(timestep, timestep_r=call.get("timestep_r"))
    video = transformer.x_embedder(hidden)
    text = transformer.context_embedder(call["encoder_hidden_states"], timestep, mask)
    text = text + transformer.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
    text_2 = transformer.context_embedder_2(call["encoder_hidden_states_2"])
    text_2 = text_2 + transformer.cond_type_embed(torch.ones_like(text_2[:, :, 0], dtype=torch.long))
    image_embeds = call["image_embeds"]
    image = transformer.image_embedder(image_embeds)
    is_t2v = torch.all(image_embeds == 0)  # NOTE: one decision for the call, as the model makes it
    if is_t2v:
        image = image * 0.0
    image = image + transformer.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
    mask, mask_2 = mask.bool(), call["encoder_attention_mask_2"].bool()
    rows = []
    for r in range(video.shape[0]):
        kept = [text_2[r][mask_2[r]], text[r][mask[r]]]
        if not is_t2v:
            kept.insert(0, image[r])
        rows.append(_Row(index, first + r, video[r], torch.cat(kept), temb[r], rotary))
    return rows


@apply_lora_scale("attention_kwargs")
def _forward(transformer, calls, attention_kwargs=None, packed_attention="auto", teacache=None):
    rows = []
    for index, call in enumerate(calls):
        first, count = len(rows), call["hidden_states"].shape[0]
        with row_subset(transformer, range(first, first + count)):  # NOTE: the call's embeddings, on its rows
            rows += _call_rows(transformer, index, call, first)
    method = resolve(packed_attention, rows[0].video.device, rows[0].video.dtype)
    split = not lora_layers(transformer)  # NOTE: as in models/qwenimage/packing.py
    states = [state for index, call in enumerate(calls)
              for state in (teacache[index] if teacache is not None and teacache[index] is not None
                            else [None] * call["hidden_states"].shape[0])]
    if all(state is None for state in states):
        videos = packed_blocks(transformer, rows, method, split)
    else:

        videos = teacache_blocks(transformer, rows, states, method, split)

    with lora_layout(transformer, _lora_layout(transformer, rows)):
        output = _output(transformer, rows, videos)
    return [_unpatchify(transformer, call["hidden_states"],
                        torch.stack([output[r] for r in range(len(rows)) if rows[r].call == index]))
            for index, call in enumerate(calls)]


def _output(transformer, rows, videos) -> list[torch.Tensor]:
    """The output layer over every row's video tokens (packed order, as the blocks' stream); one tensor per row."""
    order = _order(_lengths(rows))
    hidden = torch.cat([videos[r] for r in order])
    norm_out = transformer.norm_out
    emb = norm_out.linear(norm_out.silu(torch.stack([row.temb for row in rows])).to(hidden.dtype))
    emb = emb.index_select(0, torch.tensor(order, device=emb.device))
    tokens = torch.tensor([videos[r].shape[0] for r in order], device=hidden.device)
    scale, shift = (values.repeat_interleave(tokens, dim=0) for values in torch.chunk(emb, 2, dim=1))
    packed = transformer.proj_out(norm_out.norm(hidden) * (1 + scale) + shift).split(tokens.tolist())
    output = [None] * len(rows)
    for r, out in zip(order, packed):
        output[r] = out
    return output


def packed_blocks(transformer, rows: Sequence[_Row], method: str, split: bool) -> list[torch.Tensor]:
    """Every row's video tokens after the transformer blocks, [video tokens, inner_dim] per row."""
    with lora_layout(transformer, _lora_layout(transformer, rows)):
        return _packed_blocks(transformer, rows, method, split)


def _packed_blocks(transformer, rows, method, split):
    order = _order(_lengths(rows))
    ordered = [rows[r] for r in order]
    sizes: dict[tuple[int, int], int] = {}
    for row in ordered:
        shape = (row.video.shape[0], row.text.shape[0])
        sizes[shape] = sizes.get(shape, 0) + 1
    hidden = torch.cat([row.video for row in ordered])
    layout = PackedLayout(rows=list(sizes.values()), lengths=list(sizes), device=hidden.device)
    encoder = torch.cat([row.text for row in ordered])
    temb = torch.stack([row.temb for row in rows])  # NOTE: in `rows` order, as per-row LoRA numbers the rows
    packed = torch.tensor(order, device=temb.device)
    rotary = tuple(torch.cat([row.rotary[i] for row in ordered]) for i in range(2))

    for block in transformer.transformer_blocks:
        hidden, encoder = _block(block, layout, hidden, encoder, temb, packed, rotary, method, split)

    per_row, start = [None] * len(rows), 0
    for r in order:
        tokens = rows[r].video.shape[0]
        per_row[r] = hidden[start:start + tokens]
        start += tokens
    return per_row


def _unpatchify(transformer, hidden_states, output):
    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p = transformer.config.patch_size_t, transformer.config.patch_size
    output = output.reshape(batch_size, num_frames // p_t, height // p, width // p, -1, p_t, p, p)
    return output.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _block(block, layout, hidden, encoder, temb, packed, rotary, method, split):
    """`temb`: per row in `rows` order; `packed`: the rows in packed order."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_values(
        layout, VIDEO, block.norm1.linear(block.norm1.silu(temb)).index_select(0, packed), 6)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = adaln_values(
        layout, TEXT, block.norm1_context.linear(block.norm1_context.silu(temb)).index_select(0, packed), 6)
    norm_hidden = layout.modulate(VIDEO, block.norm1.norm(hidden), scale_msa, shift_msa)
    norm_encoder = layout.modulate(TEXT, block.norm1_context.norm(encoder), c_scale_msa, c_shift_msa)

    attn_out, context_out = _attention(block.attn, layout, norm_hidden, norm_encoder, rotary, method)
    hidden = layout.gated_add(VIDEO, hidden, gate_msa, attn_out)
    encoder = layout.gated_add(TEXT, encoder, c_gate_msa, context_out)

    norm_hidden = layout.modulate(VIDEO, block.norm2(hidden), scale_mlp, shift_mlp)
    norm_encoder = layout.modulate(TEXT, block.norm2_context(encoder), c_scale_mlp, c_shift_mlp)
    hidden = layout.gated_apply(VIDEO, hidden, gate_mlp, block.ff, norm_hidden, split)
    encoder = layout.gated_apply(TEXT, encoder, c_gate_mlp, block.ff_context, norm_encoder, split)
    return hidden, encoder


def _attention(attn, layout, hidden, encoder, rotary, method):
    """HunyuanVideo15AttnProcessor2_0 on packed tokens: joint attention over each row's video + kept text."""

    def heads(x):
        return x.unflatten(-1, (attn.heads, -1))

    def rope(x):  # NOTE: [tokens, heads, dim] as one sequence of a batch of one, frequencies per token
        return apply_rotary_emb(x.unsqueeze(0), rotary, sequence_dim=1).squeeze(0)

    query = rope(attn.norm_q(heads(attn.to_q(hidden))))
    key = rope(attn.norm_k(heads(attn.to_k(hidden))))
    value = heads(attn.to_v(hidden))
    encoder_query, encoder_key = heads(attn.add_q_proj(encoder)), heads(attn.add_k_proj(encoder))
    encoder_value = heads(attn.add_v_proj(encoder))
    if attn.norm_added_q is not None:
        encoder_query = attn.norm_added_q(encoder_query)
    if attn.norm_added_k is not None:
        encoder_key = attn.norm_added_k(encoder_key)

    processor = attn.processor

    def attention(q, k, v):
        return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     backend=processor._attention_backend, parallel_config=processor._parallel_config)

    video_out, text_out = attend(layout, [query, encoder_query], [key, encoder_key], [value, encoder_value],
                                 attention, method)
    video_out = attn.to_out[1](attn.to_out[0](video_out.to(query.dtype)))
    return video_out, attn.to_add_out(text_out.to(query.dtype))


def hunyuan_video15_signal(block, video: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The TeaCache signal: the first block's modulated video input ([rows, tokens, dim])."""
    shift_msa, scale_msa = block.norm1.linear(block.norm1.silu(temb)).chunk(6, dim=1)[:2]
    return block.norm1.norm(video) * (1 + scale_msa[:, None]) + shift_msa[:, None]


def teacache_blocks(transformer, rows: Sequence, states: Sequence[TeaCacheState | None], method: str,
                    split: bool) -> list[torch.Tensor]:
    """`packed_blocks` with per-state decisions (`states` per row): rows that skip add their cached residual;
    states change only after the blocks ran (a failed call retried per shape stays correct)."""
    first = transformer.transformer_blocks[0]

    def signal(group: range) -> torch.Tensor:
        videos = [rows[r].video for r in group]
        if all(video.shape == videos[0].shape for video in videos):
            with row_subset(transformer, [rows[r].index for r in group]):
                return hunyuan_video15_signal(first, torch.stack(videos), torch.stack([rows[r].temb for r in group]))
        own = []
        for r in group:
            with row_subset(transformer, [rows[r].index]):
                own.append(hunyuan_video15_signal(first, rows[r].video[None], rows[r].temb[None]))
        return torch.cat(own)

    decisions = decide_rows(states, signal)
    compute_rows = computing_rows(decisions)
    computed = (dict(zip(compute_rows, packed_blocks(transformer, [rows[r] for r in compute_rows], method, split)))
                if compute_rows else {})
    videos = []
    for decision in decisions:
        if decision.compute:
            videos.extend(computed[r] for r in decision.rows)
        else:
            cached = decision.state.residual.split([rows[r].video.shape[0] for r in decision.rows])
            videos.extend(rows[r].video + residual for r, residual in zip(decision.rows, cached))
    commit_rows(decisions, lambda decision: torch.cat([computed[r] - rows[r].video for r in decision.rows]))
    return videos
