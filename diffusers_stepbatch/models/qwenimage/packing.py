"""One QwenImageTransformer2DModel forward over rows of different image grids and text lengths (packed tokens).

It drives the model's own submodules the way `QwenImageTransformer2DModel.forward` does, op for op, with
three differences that keep each row's result its own: every row's image and text tokens are packed without
padding (see `layout.py`), each row's AdaLN modulation (`img_mod` / `txt_mod` of its timestep) reaches only its
own tokens, and attention runs inside each row with the row's own RoPE frequencies.

Text padding is dropped rather than masked: the model masks padded text tokens out as attention keys, so they
never reach a kept token, and text RoPE positions are indices into the padded sequence, offset by the image
grid (`max(height // 2, width // 2)` with `scale_rope`), so a kept token keeps its position when the padding
around it goes. Rows that end with equal image and text token counts attend as one SDPA batch, whatever their
grids (RoPE is applied per token before). TeaCache decisions stay per request and CFG branch, on the signal
`teacache.py` decides on: a request may alternate between packed and ordinary calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...adapters.lora import lora_layers
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import decide_packed, settle_packed
from ..packing.attention import resolve
from ..packing.layout import PackedLayout, adaln_values, attend
from ..packing.support import reproduces_call, unsupported_reason

TEXT, IMAGE = 0, 1


@dataclass
class QwenImagePart:
    """Rows of one image shape: `QwenImageTransformer2DModel.forward`'s inputs for them (rows along dim 0).

    `text` and `text_mask` may be a padded [rows, length, dim] tensor and its [rows, length] mask, or one
    entry per row of its own length (a mask entry of None: every token is valid).
    """

    hidden_states: torch.Tensor  # [rows, image tokens, in_channels]
    timestep: torch.Tensor  # [rows], t / 1000 as QwenImagePipeline passes it
    text: Sequence[torch.Tensor]  # per row [text tokens, joint_attention_dim]
    text_mask: Sequence[torch.Tensor | None] | None  # per row [text tokens] (1 / True: valid), or None
    img_shapes: Sequence[tuple[int, int, int]]  # one row's entry of the model's `img_shapes`: [(frames, h, w)]
    teacache: Sequence[TeaCacheState | None] | None = None  # per row


def qwenimage_packing_unsupported(transformer) -> str | None:
    """Why `qwenimage_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    config = transformer.config
    for option in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
        if getattr(config, option, False):
            return f"the transformer's config sets {option}=True"
    return unsupported_reason(transformer, QwenDoubleStreamAttnProcessor2_0)


def qwenimage_packed_forward(transformer, parts: Sequence[QwenImagePart], attention_kwargs: dict | None = None,
                             packed_attention: str = "auto") -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part.
    `packed_attention` picks how attention stays inside each row (`models/packing/attention.py`).

    >>> out = qwenimage_packed_forward(pipe.transformer, [QwenImagePart(x, t, text, mask, [(1, 4, 8)]), ...])
    """
    return _forward(transformer, parts, attention_kwargs=attention_kwargs, packed_attention=packed_attention)


# the forward's arguments that the packed and TeaCache forwards reproduce; a call with any other argument set
# (ControlNet residuals, guidance, additional_t_cond) runs as the model runs it
REPRODUCED_ARGUMENTS = frozenset({"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                               "img_shapes", "attention_kwargs", "return_dict"})


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `QwenImageTransformer2DModel.forward` to pack, tokens per row), or None."""
    if not reproduces_call(arguments, REPRODUCED_ARGUMENTS, "attention_kwargs"):
        return None
    attention_kwargs = arguments.get("attention_kwargs") or {}
    hidden, text, shapes = arguments["hidden_states"], arguments["encoder_hidden_states"], arguments["img_shapes"]
    if not shapes or text is None:
        return None
    key = (attention_kwargs.get("scale"), hidden.dtype, text.dtype, str(hidden.device),
           arguments.get("return_dict", True))
    return key, hidden.shape[1] + text.shape[1]


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different grids and text lengths; each output as the model returns it.
    `teacache[i]`: call i's per-row TeaCache states, or None."""
    outputs = qwenimage_packed_forward(transformer, _parts(calls, teacache), calls[0].get("attention_kwargs"),
                                       packed_attention)
    return [(out,) if not c.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for c, out in zip(calls, outputs)]


def _parts(calls: Sequence[dict], teacache: Sequence | None = None) -> list[QwenImagePart]:
    return [QwenImagePart(hidden_states=c["hidden_states"], timestep=c["timestep"], text=c["encoder_hidden_states"],
                          text_mask=c.get("encoder_hidden_states_mask"), img_shapes=c["img_shapes"][0],
                          teacache=states)
            for c, states in zip(calls, teacache or [None] * len(calls))]


@dataclass
class _Row:
    part: int
    hidden: torch.Tensor  # [image tokens, in_channels]
    timestep: torch.Tensor  # [1]
    text: torch.Tensor  # [kept text tokens, joint_attention_dim]
    text_length: int  # tokens of the row's text as given (padding included)
    kept: torch.Tensor | None  # indices of the kept text tokens in the given text; None: all of them
    img_shapes: tuple[tuple[int, int, int], ...]


def _rows(parts: Sequence[QwenImagePart]) -> list[_Row]:
    """Every row of every part, its text padding (mask 0) dropped."""
    rows = []
    for index, part in enumerate(parts):
        shapes = tuple(tuple(int(n) for n in shape) for shape in part.img_shapes)
        masks = part.text_mask if part.text_mask is not None else [None] * part.hidden_states.shape[0]
        for hidden, timestep, text, mask in zip(part.hidden_states, part.timestep, part.text, masks):
            length, kept = text.shape[0], None
            if mask is not None and not bool(mask.all()):
                kept = mask.bool().nonzero().squeeze(1)
                text = text.index_select(0, kept)
            rows.append(_Row(index, hidden, timestep.reshape(1), text, length, kept, shapes))
    return rows


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """`Packing.token_rows` of `pack_calls`' forward (`packed_token_rows`)."""
    return packed_token_rows(_parts(calls))


def packed_token_rows(parts: Sequence[QwenImagePart]) -> list[torch.Tensor]:
    """Each token's row in the text and image streams of the packed forward (text padding dropped; an edit row's
    reference tokens are image tokens), rows numbered across `parts` in order. The forward packs rows in its own
    order (`_order`), but its LoRA layers with rows on dim 0 (the time embedding, `img_mod` / `txt_mod`, the
    output norm) see them in this numbering. Per-row LoRA maps layer inputs to rows with it."""
    tokens = [(part.hidden_states.shape[1], text) for part in parts for text in _kept_text(part)]
    order = _order(tokens)
    index = torch.tensor(order)
    return [index.repeat_interleave(torch.tensor([tokens[r][1] for r in order])),
            index.repeat_interleave(torch.tensor([tokens[r][0] for r in order]))]


def _kept_text(part: QwenImagePart) -> list[int]:
    """Each row's text tokens once its padding (mask 0) is dropped, as `_rows` keeps them."""
    masks = part.text_mask
    if isinstance(masks, torch.Tensor):
        return masks.bool().sum(dim=1).tolist()
    masks = masks if masks is not None else [None] * len(part.text)
    return [text.shape[0] if mask is None else int(mask.bool().sum()) for text, mask in zip(part.text, masks)]


def _order(tokens: list[tuple[int, int]]) -> list[int]:
    """The packed order of rows with these (image, text) token counts."""
    # NOTE: rows of equal token counts form one part of the layout, so they attend as one batch.
    return sorted(range(len(tokens)), key=lambda r: tokens[r])


@apply_lora_scale("attention_kwargs")
def _forward(transformer, parts, attention_kwargs=None, packed_attention="auto"):
    rows = _rows(parts)
    order = _order([(row.hidden.shape[0], row.text.shape[0]) for row in rows])
    sizes: dict[tuple[int, int], int] = {}
    for r in order:
        shape = (rows[r].text.shape[0], rows[r].hidden.shape[0])
        sizes[shape] = sizes.get(shape, 0) + 1
    device = parts[0].hidden_states.device
    layout = PackedLayout(rows=list(sizes.values()), lengths=list(sizes), device=device)

    hidden = transformer.img_in(torch.cat([rows[r].hidden for r in order]))
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    split = not lora_layers(transformer)  # NOTE: as in models/flux/packing.py: per-row LoRA maps inputs by token count
    # NOTE: the per-row layers (time embedding, modulation) run on the rows in the parts' order, as per-row LoRA
    # numbers them (`packed_token_rows`); their outputs are then taken in the packed order
    packed = None if order == sorted(order) else torch.tensor(order, device=device)
    timestep = torch.cat([row.timestep for row in rows]).to(hidden.dtype)
    encoder = transformer.txt_in(transformer.txt_norm(torch.cat([rows[r].text for r in order])))
    temb = transformer.time_text_embed(timestep, hidden)
    rotary = _packed_rotary(transformer, [rows[r] for r in order], device)

    states = [state for part in parts for state in (part.teacache or [None] * part.hidden_states.shape[0])]
    if any(state is not None for state in states) and len(transformer.transformer_blocks):
        hidden = _teacache_blocks(transformer, layout, states, order, hidden, encoder, temb, packed, rotary, method,
                                  split)
    else:
        hidden = _blocks(transformer, layout, hidden, encoder, temb, packed, rotary, method, split)

    norm_out = transformer.norm_out
    emb = _in_order(norm_out.linear(norm_out.silu(temb).to(hidden.dtype)), packed)
    scale, shift = torch.chunk(emb, 2, dim=1)
    scale1, shift = layout.row_values(IMAGE, torch.cat([1 + scale, shift], dim=1), 2)
    hidden = layout.modulate(IMAGE, norm_out.norm(hidden), scale1, shift)
    output = transformer.proj_out(hidden)

    per_row = [None] * len(rows)
    start = 0
    for r in order:
        tokens = rows[r].hidden.shape[0]
        per_row[r] = output[start:start + tokens]
        start += tokens
    return [torch.stack([per_row[r] for r in range(len(rows)) if rows[r].part == index])
            for index in range(len(parts))]


def _packed_rotary(transformer, ordered: list[_Row], device):
    """Per-stream complex RoPE frequencies for every packed token, from the model's own `pos_embed`."""
    frequencies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    image, text = [], []
    for row in ordered:
        key = (row.img_shapes, row.text_length)
        if key not in frequencies:
            # NOTE: as the model calls it for this row alone (its grid, its text length as given); the text
            # frequencies of a longer padding start with these, so the row's batch-mates don't matter.
            frequencies[key] = transformer.pos_embed([list(row.img_shapes)], device=device,
                                                     max_txt_seq_len=row.text_length)
        image_freqs, text_freqs = frequencies[key]
        if image_freqs.shape[0] != row.hidden.shape[0]:
            raise ValueError(f"img_shapes {list(row.img_shapes)} hold {sum(prod(s) for s in row.img_shapes)} "
                             f"tokens, but the row's hidden_states have {row.hidden.shape[0]}")
        image.append(image_freqs)
        text.append(text_freqs if row.kept is None else text_freqs.index_select(0, row.kept))
    return torch.cat(text), torch.cat(image)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # NOTE: [tokens, heads, dim] seen as one sequence of `tokens` with per-token frequencies.
    return apply_rotary_emb_qwen(x.unsqueeze(0), freqs, use_real=False).squeeze(0)


def _in_order(per_row: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """Rows in the parts' order -> rows in the packed order (None: the same order)."""
    return per_row if packed is None else per_row.index_select(0, packed)


def _blocks(transformer, layout, hidden, encoder, temb, packed, rotary, method, split):
    """The blocks on packed tokens; `temb` per row in the parts' order (`packed` maps it to the packed order, None:
    the same order). Returns the image tokens."""
    for block in transformer.transformer_blocks:
        encoder, hidden = _block(block, layout, hidden, encoder, temb, packed, rotary, method, split)
    return hidden


def _teacache_blocks(transformer, layout, states, order, hidden, encoder, temb, packed, rotary, method, split):
    """`_blocks` with per-state TeaCache decisions (`states` per row in the parts' order) on the signal as
    `teacache.py` computes it, op for op; skipping rows add their cached residual."""
    block = transformer.transformer_blocks[0]
    shift, scale = _in_order(block.img_mod(temb), packed).index_select(0, layout.token_rows[IMAGE]).chunk(6, dim=1)[:2]
    signal = block.img_norm1(hidden) * (1 + scale) + shift
    position = {row: p for p, row in enumerate(order)}

    def group(state, rows):
        rows = [position[row] for row in rows]  # NOTE: a state's rows may sit in several parts
        if state is None:
            return rows, None, None
        tokens = torch.cat([_image_tokens(layout, p) for p in rows]).to(hidden.device)
        return rows, tokens, signal.index_select(0, tokens).unflatten(0, (len(rows), -1))

    decisions, computing = decide_packed(states, group)
    computing.sort()

    if len(computing) == len(order):
        computed = (None, hidden, _blocks(transformer, layout, hidden, encoder, temb, packed, rotary, method, split))
    elif computing:
        sub_layout, (text_index, image_index) = layout.select_rows(computing)
        sub_temb = _in_order(temb, packed).index_select(0, torch.tensor(computing, device=temb.device))
        sub_hidden = hidden.index_select(0, image_index)
        sub_rotary = (rotary[TEXT].index_select(0, text_index), rotary[IMAGE].index_select(0, image_index))
        computed = (image_index, sub_hidden, _blocks(transformer, sub_layout, sub_hidden,
                                                     encoder.index_select(0, text_index), sub_temb, None, sub_rotary,
                                                     method, split))
    else:
        computed = None
    return settle_packed(decisions, hidden, computed)


def _image_tokens(layout, position: int) -> torch.Tensor:
    """The packed image tokens of the row at `position` in the packed order."""
    part, inner = layout.part_of_row(position)
    span = layout.row_tokens(IMAGE, part, inner, inner + 1)
    return torch.arange(span.start, span.stop)


def _block(block, layout, hidden, encoder, temb, packed, rotary, method, split):
    img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = adaln_values(
        layout, IMAGE, _in_order(block.img_mod(temb), packed), 6)
    txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = adaln_values(
        layout, TEXT, _in_order(block.txt_mod(temb), packed), 6)
    img_modulated = layout.modulate(IMAGE, block.img_norm1(hidden), img_scale1, img_shift1)
    txt_modulated = layout.modulate(TEXT, block.txt_norm1(encoder), txt_scale1, txt_shift1)

    img_attn, txt_attn = _attention(block.attn, layout, img_modulated, txt_modulated, rotary, method)
    hidden = layout.gated_add(IMAGE, hidden, img_gate1, img_attn)
    encoder = layout.gated_add(TEXT, encoder, txt_gate1, txt_attn)

    norm_hidden = layout.modulate(IMAGE, block.img_norm2(hidden), img_scale2, img_shift2)
    hidden = layout.gated_apply(IMAGE, hidden, img_gate2, block.img_mlp, norm_hidden, split)
    norm_encoder = layout.modulate(TEXT, block.txt_norm2(encoder), txt_scale2, txt_shift2)
    encoder = layout.gated_apply(TEXT, encoder, txt_gate2, block.txt_mlp, norm_encoder, split)
    if encoder.dtype == torch.float16:
        encoder = encoder.clip(-65504, 65504)
    if hidden.dtype == torch.float16:
        hidden = hidden.clip(-65504, 65504)
    return encoder, hidden


def _attention(attn, layout, hidden, encoder, rotary, method):
    """QwenDoubleStreamAttnProcessor2_0 on packed tokens: joint attention over each row's text + image."""
    head_dim = attn.inner_dim // attn.heads

    def heads(x):
        return x.unflatten(-1, (-1, head_dim))

    def normed(norm, x):
        return x if norm is None else norm(x)

    txt_freqs, img_freqs = rotary
    img_query = _rope(normed(attn.norm_q, heads(attn.to_q(hidden))), img_freqs)
    img_key = _rope(normed(attn.norm_k, heads(attn.to_k(hidden))), img_freqs)
    img_value = heads(attn.to_v(hidden))
    txt_query = _rope(normed(attn.norm_added_q, heads(attn.add_q_proj(encoder))), txt_freqs)
    txt_key = _rope(normed(attn.norm_added_k, heads(attn.add_k_proj(encoder))), txt_freqs)
    txt_value = heads(attn.add_v_proj(encoder))

    processor = attn.processor

    def attention(query, key, value):
        return dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     backend=processor._attention_backend,
                                     parallel_config=processor._parallel_config)

    txt_out, img_out = attend(layout, [txt_query, img_query], [txt_key, img_key], [txt_value, img_value],
                              attention, method)
    img_out = attn.to_out[0](img_out.to(img_query.dtype))
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)
    return img_out, attn.to_add_out(txt_out.to(txt_query.dtype))
