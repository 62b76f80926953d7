"""What FLUX.1's and FLUX.2's packed forwards share: layouts of the TEXT and IMAGE streams (and of the single
blocks' joint stream), per-token RoPE of packed parts, the attention call of their processors."""

from __future__ import annotations

import functools
import threading

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb

from ...cache.teacache_rows import decide_packed, settle_packed
from .layout import PackedLayout, attend

TEXT, IMAGE = 0, 1


def parts_layout(parts) -> PackedLayout:
    """The TEXT and IMAGE layout of packed parts (each with `[rows, tokens, dim]` `encoder_hidden_states` and
    `hidden_states`)."""
    return cached_layout(tuple(p.hidden_states.shape[0] for p in parts),
                         tuple((p.encoder_hidden_states.shape[1], p.hidden_states.shape[1]) for p in parts),
                         parts[0].hidden_states.device)


def token_streams(parts) -> list[torch.Tensor]:
    """The row of every token in each packed stream a FLUX.1 / FLUX.2 packed forward runs layers on: text, image
    (reference-image tokens included), and the single blocks' joint stream (each row's text then image tokens);
    rows numbered across the parts in order. Per-row LoRA maps layer inputs to rows with it."""
    layout = parts_layout(parts)
    return [*layout.token_rows, joint_stream_layout(layout).token_rows[0]]


def joint_stream_layout(layout: PackedLayout) -> PackedLayout:
    # NOTE: the single blocks' one stream: a row's text and image tokens side by side, as the model's
    # torch.cat([encoder, hidden], dim=1) has them, so attention reads each part as a view.
    return cached_layout(tuple(layout.rows), tuple((text + image,) for text, image in layout.lengths),
                          layout.token_rows[0].device)


@functools.lru_cache(maxsize=64)
def cached_layout(rows: tuple, lengths: tuple, device: torch.device) -> PackedLayout:
    # NOTE: the same few shapes recur step after step; building a layout is ~30 small kernels (aranges, repeats).
    return PackedLayout(rows, lengths, device=device)


def _same_as_last_call(fn):
    """Memo of the last call of `fn(layout, part_rotary)`: the same requests usually pack again at the next
    step, with the same (cached, `_rotary`) part embeddings. The memo holds those, so their ids stay theirs."""
    last: list = [None]
    lock = threading.Lock()

    @functools.wraps(fn)
    def memoized(layout, part_rotary):
        key = (tuple(layout.rows), tuple(layout.lengths), tuple(map(id, part_rotary)))
        with lock:
            entry = last[0]
        if entry is not None and entry[0] == key:
            return entry[2]
        result = fn(layout, part_rotary)
        with lock:
            last[0] = (key, list(part_rotary), result)
        return result

    return memoized


@_same_as_last_call
def stream_rotary(layout, part_rotary):
    """Per stream (text, image), (cos, sin) for every packed token: each part's positions, repeated per row."""
    per_stream = [([], []) for _ in range(2)]
    for part_rows, (text_len, _), (cos, sin) in zip(layout.rows, layout.lengths, part_rotary):
        for stream, window in ((TEXT, slice(0, text_len)), (IMAGE, slice(text_len, None))):
            per_stream[stream][0].append(cos[window].repeat(part_rows, 1))
            per_stream[stream][1].append(sin[window].repeat(part_rows, 1))
    return [(torch.cat(cos), torch.cat(sin)) for cos, sin in per_stream]


@_same_as_last_call
def joint_stream_rotary(layout, part_rotary):
    """(cos, sin) for every token of the joint stream (`joint_stream_layout`)."""
    return tuple(torch.cat([pair[i].repeat(part_rows, 1) for part_rows, pair in zip(layout.rows, part_rotary)])
                 for i in range(2))


def rope(x: torch.Tensor, rotary) -> torch.Tensor:
    # NOTE: [tokens, heads, dim] seen as one sequence of `tokens` with per-token (cos, sin).
    return apply_rotary_emb(x.unsqueeze(0), rotary, sequence_dim=1).squeeze(0)


def attention_fn(attn):
    processor = attn.processor

    def attention(query, key, value):
        return dispatch_attention_fn(query, key, value, attn_mask=None, backend=processor._attention_backend,
                                     parallel_config=processor._parallel_config)

    return attention


def per_head(attn, x):
    return x.unflatten(-1, (-1, attn.head_dim))


def double_block(block, layout, hidden, encoder, norms, image_mods, text_mods, rotary, method, split, attention=None):
    """A FLUX.1 / FLUX.2 double-stream block on packed tokens: `norms` are the image and text streams' first
    norms, `*_mods` each stream's per-row (shift, 1 + scale, gate) x 2 as its tokens see them; joint attention
    stays inside each row (`attention`: one function per part, as `attend` takes them; None: the processor's)."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = image_mods
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = text_mods
    norm_hidden = layout.modulate(IMAGE, norms[0](hidden), scale_msa, shift_msa)
    norm_encoder = layout.modulate(TEXT, norms[1](encoder), c_scale_msa, c_shift_msa)
    attn = block.attn
    query, key, value = (attn.norm_q(per_head(attn, attn.to_q(norm_hidden))),
                         attn.norm_k(per_head(attn, attn.to_k(norm_hidden))), per_head(attn, attn.to_v(norm_hidden)))
    e_query, e_key, e_value = (attn.norm_added_q(per_head(attn, attn.add_q_proj(norm_encoder))),
                               attn.norm_added_k(per_head(attn, attn.add_k_proj(norm_encoder))),
                               per_head(attn, attn.add_v_proj(norm_encoder)))
    text_out, image_out = attend(
        layout,
        [rope(e_query, rotary[TEXT]), rope(query, rotary[IMAGE])],
        [rope(e_key, rotary[TEXT]), rope(key, rotary[IMAGE])],
        [e_value, value], attention or attention_fn(attn), method,
    )
    attn_output = attn.to_out[1](attn.to_out[0](image_out.to(query.dtype)))
    context_attn_output = attn.to_add_out(text_out.to(query.dtype))

    hidden = layout.gated_add(IMAGE, hidden, gate_msa, attn_output)
    norm_hidden = layout.modulate(IMAGE, block.norm2(hidden), scale_mlp, shift_mlp)
    hidden = layout.gated_apply(IMAGE, hidden, gate_mlp, block.ff, norm_hidden, split)

    encoder = layout.gated_add(TEXT, encoder, c_gate_msa, context_attn_output)
    norm_encoder = layout.modulate(TEXT, block.norm2_context(encoder), c_scale_mlp, c_shift_mlp)
    encoder = layout.gated_apply(TEXT, encoder, c_gate_mlp, block.ff_context, norm_encoder, split)
    if encoder.dtype == torch.float16:
        encoder = encoder.clip(-65504, 65504)
    return encoder, hidden


def teacache_blocks(layout: PackedLayout, states, hidden: torch.Tensor, encoder: torch.Tensor, signal: torch.Tensor,
                    run) -> torch.Tensor:
    """The blocks on packed tokens with per-state TeaCache decisions (`states` per packed row) on `signal` (the
    first block's modulated image tokens): rows that skip add their cached residual. `run(sub_layout, hidden,
    encoder, rows, parts)` runs the blocks on the computing rows (`rows`: their indices; `parts`: the layout parts
    they keep, in `select_rows`' order)."""
    def group(state, rows):
        if state is None:  # NOTE: such rows compute; a run of them may span parts (sizes), so no token range
            return rows, None, None
        part, inner = layout.part_of_row(rows.start)
        tokens = layout.row_tokens(IMAGE, part, inner, inner + len(rows))
        return rows, tokens, signal[tokens].unflatten(0, (len(rows), -1))

    decisions, compute_rows = decide_packed(states, group)

    computed = None
    if compute_rows:
        sub_layout, (text_index, image_index) = layout.select_rows(compute_rows)
        kept_parts = list(dict.fromkeys(layout.part_of_row(row)[0] for row in compute_rows))
        sub_hidden = hidden.index_select(0, image_index)
        sub_out = run(sub_layout, sub_hidden, encoder.index_select(0, text_index),
                      torch.tensor(compute_rows, device=hidden.device), kept_parts)
        computed = (image_index, sub_hidden, sub_out)
    return settle_packed(decisions, hidden, computed)
