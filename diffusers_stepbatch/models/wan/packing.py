"""One WanTransformer3DModel forward over videos of different frame counts and sizes (packed tokens).

It drives the model's own submodules the way `WanTransformer3DModel.forward` does, op for op, with four
differences that keep each row's result its own: every row's video is patch-embedded on its own
[channels, frames, height, width] and its tokens are packed without padding (see `packing/layout.py`); each row
gets the RoPE grid the model's own `rope` makes for its shape; each row's AdaLN modulation (from its timestep,
or per token with Wan 2.2 TI2V's `expand_timesteps`) reaches only its own tokens; self-attention runs inside
each row, and cross-attention from each row's tokens to that row's own text (and image tokens for I2V).

Rows of equal video token and context lengths form one part of the layout: they self- and cross-attend as one
SDPA batch, whatever their grids (RoPE is applied per token before).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.utils import apply_lora_scale

from ...adapters.lora import LoraLayout, lora_active, lora_layers, lora_layout, row_subset
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import decide_packed, settle_packed
from ..packing.attention import resolve
from ..packing.layout import PackedLayout, RowValues, adaln_values, attend
from ..packing.support import reproduces_call, unsupported_reason

# NOTE: WanAttnProcessor splits a cross-attention context into image tokens and the last 512 (text) tokens
# when the model has image key/value projections; the packed forward splits each row's context the same way.
_TEXT_CONTEXT = 512


@dataclass
class WanPart:
    """Rows of one video shape: `WanTransformer3DModel.forward`'s inputs for them (rows along dim 0)."""

    hidden_states: torch.Tensor  # [rows, in_channels, frames, height, width]
    timestep: torch.Tensor  # [rows], or [rows, video tokens] (expand_timesteps)
    encoder_hidden_states: torch.Tensor  # [rows, text tokens, text_dim]
    encoder_hidden_states_image: torch.Tensor | None = None  # [rows * blocks, image tokens, image_dim]


def wan_packing_unsupported(transformer) -> str | None:
    """Why `wan_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    return unsupported_reason(transformer, WanAttnProcessor)


def wan_packed_forward(transformer, parts: Sequence[WanPart], attention_kwargs: dict | None = None,
                       packed_attention: str = "auto", teacache: Sequence | None = None) -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part.
    `packed_attention` picks how self-attention stays inside each row (`models/packing/attention.py`);
    `teacache[i]` holds part i's per-row TeaCache states or None (`models/wan/teacache.py`).

    >>> out = wan_packed_forward(pipe.transformer, [WanPart(video_a, t_a, text_a), WanPart(video_b, t_b, text_b)])
    """
    return _forward(transformer, parts, attention_kwargs=attention_kwargs, packed_attention=packed_attention,
                    teacache=teacache)


# the forward's arguments a packed call reproduces; a call with any other argument set runs unpacked
_PACKED_ARGUMENTS = frozenset({"hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
                               "attention_kwargs", "return_dict"})


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `WanTransformer3DModel.forward` to pack, tokens per row), or None."""
    if not reproduces_call(arguments, _PACKED_ARGUMENTS, "attention_kwargs"):
        return None
    hidden, timestep, text = (arguments.get(name) for name in ("hidden_states", "timestep", "encoder_hidden_states"))
    if not all(isinstance(value, torch.Tensor) for value in (hidden, timestep, text)):
        return None
    if hidden.ndim != 5 or text.ndim != 3 or timestep.ndim not in (1, 2) or timestep.shape[0] != hidden.shape[0]:
        return None
    image = arguments.get("encoder_hidden_states_image")
    scale = (arguments.get("attention_kwargs") or {}).get("scale")
    key = (scale, image is None, timestep.ndim, hidden.shape[1], hidden.dtype, text.dtype, str(hidden.device),
           arguments.get("return_dict", True))
    # NOTE: latent voxels stand in for video tokens (the patch size is the model's) in the cost model's count
    return key, prod(hidden.shape[2:]) + text.shape[1]


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different video shapes; each output as the model returns it."""
    outputs = wan_packed_forward(transformer, _parts(calls), calls[0].get("attention_kwargs"), packed_attention,
                                 teacache)
    return [(out,) if not c.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for c, out in zip(calls, outputs)]


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """Per token stream of `pack_calls`' forward (video tokens, text tokens, both in packed order), each token's
    row. Its per-shape steps (patch embedding, image embedding, cross-attention keys) run on rows (`lora_layout`)."""
    return _token_streams(_ordered(transformer, _parts(calls)))


def _parts(calls: Sequence[dict]) -> list[WanPart]:
    return [WanPart(hidden_states=c["hidden_states"], timestep=c["timestep"],
                    encoder_hidden_states=c["encoder_hidden_states"],
                    encoder_hidden_states_image=c.get("encoder_hidden_states_image")) for c in calls]


@dataclass
class _Row:
    part: int  # the input part it came from
    index: int  # its row inside that part
    grid: tuple[int, int, int]  # post-patch (frames, height, width)
    context: int  # context tokens (image tokens, then text)
    row: int  # its row in the forward: parts' rows in part order
    text: int  # text tokens

    @property
    def tokens(self) -> int:
        return prod(self.grid)


def _rows(transformer, parts: Sequence[WanPart]) -> list[_Row]:
    p_t, p_h, p_w = transformer.config.patch_size
    image_embedder = transformer.condition_embedder.image_embedder
    # NOTE: first-last-frame-to-video's embedder (its pos_embed) folds each video's two images into one context
    fold = 2 if image_embedder is not None and image_embedder.pos_embed is not None else 1
    rows = []
    for index, part in enumerate(parts):
        frames, height, width = part.hidden_states.shape[2:]
        grid = (frames // p_t, height // p_h, width // p_w)
        if part.timestep.ndim == 2 and part.timestep.shape[1] != prod(grid):
            raise ValueError(f"timestep has {part.timestep.shape[1]} entries per row, but the video has "
                             f"{prod(grid)} tokens ({grid} after patching)")
        image = part.encoder_hidden_states_image
        text = part.encoder_hidden_states.shape[1]
        context = text + (0 if image is None else image.shape[1] * fold)
        first = len(rows)
        rows.extend(_Row(index, r, grid, context, first + r, text) for r in range(part.hidden_states.shape[0]))
    return rows


def _ordered(transformer, parts: Sequence[WanPart]) -> list[_Row]:
    rows = _rows(transformer, parts)
    return [rows[r] for r in _order(rows)]


def _token_streams(ordered: Sequence[_Row]) -> list[torch.Tensor]:
    """Each token's row in the forward's token streams: video, then text tokens, in packed order."""
    ids = torch.tensor([row.row for row in ordered])
    return [ids.repeat_interleave(torch.tensor([count(row) for row in ordered]))
            for count in (lambda row: row.tokens, lambda row: row.text)]


def _order(rows: Sequence[_Row]) -> list[int]:
    # NOTE: rows of equal token counts (video, context) form one part of the layout, so they attend as one batch.
    return sorted(range(len(rows)), key=lambda r: (rows[r].tokens, rows[r].context))


@functools.lru_cache(maxsize=64)
def _layout(rows: tuple, lengths: tuple, device: torch.device) -> PackedLayout:
    # NOTE: the same few shapes recur step after step; building a layout is ~30 small kernels.
    return PackedLayout(rows, lengths, device=device)


def _layouts(ordered: Sequence[_Row], device) -> tuple[PackedLayout, PackedLayout]:
    """(video tokens, context tokens) layouts with the same parts: consecutive rows of equal lengths."""
    counts: dict[tuple[int, int], int] = {}
    for row in ordered:
        counts[(row.tokens, row.context)] = counts.get((row.tokens, row.context), 0) + 1
    rows = tuple(counts.values())
    return (_layout(rows, tuple((video,) for video, _ in counts), device),
            _layout(rows, tuple((context,) for _, context in counts), device))


@apply_lora_scale("attention_kwargs")
def _forward(transformer, parts, attention_kwargs=None, packed_attention="auto", teacache=None):
    ordered = _ordered(transformer, parts)
    # NOTE: per-row inputs (timestep embeddings) hold the parts' rows in part order; the rest are token streams
    layout = LoraLayout(torch.arange(len(ordered)), _token_streams(ordered)) if lora_active(transformer) else None
    with lora_layout(transformer, layout):
        return _packed(transformer, parts, ordered, packed_attention, teacache)


def _packed(transformer, parts, ordered, packed_attention, teacache):
    device = parts[0].hidden_states.device
    video, contexts = _layouts(ordered, device)
    # [context tokens, dim]; [rows, dim] (or [tokens, dim] with per-token timesteps), in packed row order
    context, temb, proj = _conditions(transformer, parts, ordered)
    proj = proj.unflatten(1, (6, -1))
    per_token = parts[0].timestep.ndim == 2

    hidden = _patch_embed(transformer, parts, ordered)
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    rotary = _packed_rotary(transformer, parts, ordered)

    states = [None if teacache is None or teacache[row.part] is None else teacache[row.part][row.index]
              for row in ordered]
    inputs = PackedInputs(video, contexts, context, proj, per_token, rotary, method,
                          torch.tensor([row.row for row in ordered]))
    if all(state is None for state in states):
        hidden = packed_blocks(transformer, inputs, hidden)
    else:

        hidden = teacache_blocks(transformer, inputs, hidden, states)

    values = transformer.scale_shift_table[0].to(temb.device) + temb.unsqueeze(1)  # [rows or tokens, 2, dim]
    shift, scale1 = values[:, 0], 1 + values[:, 1]
    if per_token:
        scale, shift = RowValues(None, scale1), RowValues(None, shift)
    else:
        scale, shift = video.row_values(0, torch.cat([scale1, shift], dim=1), 2)
    hidden = video.modulate(0, transformer.norm_out(hidden.float()), scale, shift).type_as(hidden)
    return _unpatchify(transformer, parts, ordered, transformer.proj_out(hidden))


@dataclass
class PackedInputs:
    """What the blocks read besides the video tokens, in packed row order."""

    video: PackedLayout  # the video tokens' layout
    contexts: PackedLayout  # the context tokens' layout (same parts)
    context: torch.Tensor  # [context tokens, dim]: each row's image then text tokens
    proj: torch.Tensor  # the timestep projection: [rows, 6, dim], or [video tokens, 6, dim] when per_token
    per_token: bool
    rotary: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [video tokens, 1, head_dim]
    method: str  # the packed attention backend
    rows: torch.Tensor  # each packed row's row in the forward (per-row LoRA numbers rows so)

    def select(self, rows: list[int]) -> tuple[PackedInputs, torch.Tensor]:
        """The inputs of only `rows` (ascending) and the index of their video tokens."""
        video, (index,) = self.video.select_rows(rows)
        contexts, (context_index,) = self.contexts.select_rows(rows)
        proj = self.proj.index_select(0, index if self.per_token else torch.tensor(rows, device=index.device))
        rotary = tuple(r.index_select(0, index) for r in self.rotary)
        return PackedInputs(video, contexts, self.context.index_select(0, context_index), proj, self.per_token,
                            rotary, self.method, self.rows[rows]), index


def packed_blocks(transformer, inputs: PackedInputs, hidden: torch.Tensor) -> torch.Tensor:
    """The transformer blocks over packed video tokens [tokens, dim]."""
    context_parts = inputs.contexts.unpack(0, inputs.context)
    split = not lora_layers(transformer)  # NOTE: as in models/flux/packing.py: per-row LoRA maps inputs by token count
    layout, part_layouts = None, [None] * len(context_parts)
    if lora_active(transformer):  # NOTE: the video tokens of these rows; cross-attention keys per part, by rows
        layout = LoraLayout(inputs.rows, [inputs.rows[inputs.video.token_rows[0].cpu()]])
        part_layouts = [LoraLayout(inputs.rows[start:start + rows])
                        for start, rows in zip(inputs.video.row_starts, inputs.video.rows)]
    with lora_layout(transformer, layout):
        for block in transformer.blocks:
            hidden = _block(block, inputs.video, hidden, context_parts, inputs.proj, inputs.per_token, inputs.rotary,
                            inputs.method, split, transformer, part_layouts)
    return hidden


def _conditions(transformer, parts, ordered):
    """The packed context ([context tokens, dim]: each row's image then text tokens), temb and timestep projection
    ([rows, ...], or [video tokens, ...] with per-token timesteps), in packed row order, from the model's own
    condition embedder."""
    embedder = transformer.condition_embedder
    # NOTE: the text projection is token-wise: all rows' tokens in one call, in packed order (a LoRA token stream)
    texts = embedder.text_embedder(torch.cat([parts[row.part].encoder_hidden_states[row.index] for row in ordered]))
    texts = texts.split([row.text for row in ordered])
    per_token = parts[0].timestep.ndim == 2
    if per_token:  # NOTE: in packed order, as the video tokens (the same LoRA token stream)
        steps = torch.cat([parts[row.part].timestep[row.index] for row in ordered])
    else:  # rows in part order, as the forward's rows
        steps = torch.cat([part.timestep for part in parts])
    steps = embedder.timesteps_proj(steps)
    time_dtype = next(iter(embedder.time_embedder.parameters())).dtype
    if steps.dtype != time_dtype and time_dtype != torch.int8:
        steps = steps.to(time_dtype)
    temb = embedder.time_embedder(steps).type_as(parts[0].encoder_hidden_states)
    proj = embedder.time_proj(embedder.act_fn(temb))
    if not per_token:
        index = torch.tensor([row.row for row in ordered], device=temb.device)
        temb, proj = temb.index_select(0, index), proj.index_select(0, index)

    images = []
    for part, rows in zip(parts, _part_rows(parts)):
        image = part.encoder_hidden_states_image
        if image is not None:
            with row_subset(transformer, rows):  # NOTE: this part's rows, on dim 0
                image = embedder.image_embedder(image)
            if image.shape[0] != part.encoder_hidden_states.shape[0]:
                raise ValueError(f"encoder_hidden_states_image folds to {image.shape[0]} rows, but the call has "
                                 f"{part.encoder_hidden_states.shape[0]}")
        images.append(image)
    context = [text if images[row.part] is None else torch.cat([images[row.part][row.index], text])
               for row, text in zip(ordered, texts)]
    return torch.cat(context), temb, proj


def _part_rows(parts) -> list[range]:
    """Each part's rows in the forward (parts' rows in part order)."""
    ranges, start = [], 0
    for part in parts:
        ranges.append(range(start, start + part.hidden_states.shape[0]))
        start += part.hidden_states.shape[0]
    return ranges


def _patch_embed(transformer, parts, ordered):
    """Each row's video through the model's Conv3d on its own shape, packed as [tokens, dim] in row order."""
    by_shape: dict[tuple, list[int]] = {}
    for index, part in enumerate(parts):
        by_shape.setdefault(tuple(part.hidden_states.shape[1:]), []).append(index)
    embedded: dict[int, torch.Tensor] = {}
    part_rows = _part_rows(parts)
    for indices in by_shape.values():
        with row_subset(transformer, [r for i in indices for r in part_rows[i]]):  # NOTE: this shape's rows
            out = transformer.patch_embedding(torch.cat([parts[i].hidden_states for i in indices]))
        out = out.flatten(2).transpose(1, 2)
        for i, chunk in zip(indices, out.split([parts[i].hidden_states.shape[0] for i in indices])):
            embedded[i] = chunk
    return torch.cat([embedded[row.part][row.index] for row in ordered]).contiguous()


def _packed_rotary(transformer, parts, ordered):
    """(cos, sin) [tokens, 1, head_dim] for every packed token, from the model's own `rope` for its row's shape."""
    per_part = [transformer.rope(part.hidden_states[:1]) for part in parts]
    cos = torch.cat([per_part[row.part][0][0] for row in ordered])
    sin = torch.cat([per_part[row.part][1][0] for row in ordered])
    return cos, sin


def _unpatchify(transformer, parts, ordered, output):
    """[tokens, out_channels * patch] in row order -> per part [rows, out_channels, frames, height, width]."""
    p_t, p_h, p_w = transformer.config.patch_size
    per_row: dict[tuple[int, int], torch.Tensor] = {}
    start = 0
    for row in ordered:
        per_row[(row.part, row.index)] = output[start:start + row.tokens]
        start += row.tokens
    outputs = []
    for index, part in enumerate(parts):
        grid = next(row.grid for row in ordered if row.part == index)
        rows = part.hidden_states.shape[0]
        hidden = torch.stack([per_row[(index, r)] for r in range(rows)])
        hidden = hidden.reshape(rows, *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        outputs.append(hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3))
    return outputs


def _modulation(block, layout, proj, per_token) -> list[RowValues]:
    """The block's (shift, 1 + scale, gate) x 2 per row (or per token), in float32 as the block computes them."""
    values = block.scale_shift_table[0] + proj.float()  # [rows or tokens, 6, dim]
    if not per_token:
        return adaln_values(layout, 0, values.flatten(1), 6)
    chunks = list(values.unbind(1))
    for scale in (1, 4):
        chunks[scale] = 1 + chunks[scale]
    return [RowValues(None, chunk) for chunk in chunks]


def _block(block, layout, hidden, context_parts, proj, per_token, rotary, method, split, transformer, part_layouts):
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _modulation(block, layout, proj, per_token)

    # 1. Self-attention
    norm_hidden = layout.modulate(0, block.norm1(hidden.float()), scale_msa, shift_msa).type_as(hidden)
    attn_output = _self_attention(block.attn1, layout, norm_hidden, rotary, method)
    hidden = layout.gated_add(0, hidden.float(), gate_msa, attn_output.float()).type_as(hidden)

    # 2. Cross-attention
    norm_hidden = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + _cross_attention(block.attn2, layout, norm_hidden, context_parts, transformer, part_layouts)

    # 3. Feed-forward
    norm_hidden = layout.modulate(0, block.norm3(hidden.float()), c_scale_msa, c_shift_msa).type_as(hidden)
    return layout.gated_apply(0, hidden.float(), c_gate_msa, lambda x: block.ffn(x).float(), norm_hidden,
                              split).type_as(hidden)


def _apply_rotary(x, cos, sin):
    # NOTE: WanAttnProcessor's own rotation (its dtypes included), on [tokens, heads, head_dim].
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _self_attention(attn, layout, hidden, rotary, method):
    """WanAttnProcessor's self-attention on packed tokens, inside each row."""
    query = attn.norm_q(attn.to_q(hidden)).unflatten(1, (attn.heads, -1))
    key = attn.norm_k(attn.to_k(hidden)).unflatten(1, (attn.heads, -1))
    value = attn.to_v(hidden).unflatten(1, (attn.heads, -1))
    query, key = _apply_rotary(query, *rotary), _apply_rotary(key, *rotary)
    processor = attn.processor

    def attention(q, k, v):
        return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     backend=processor._attention_backend,
                                     parallel_config=processor._parallel_config)

    out = attend(layout, [query], [key], [value], attention, method)[0].type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


def _cross_attention(attn, layout, hidden, context_parts, transformer, part_layouts):
    """WanAttnProcessor's cross-attention: each part's rows to their own context, as one SDPA batch."""
    query = attn.norm_q(attn.to_q(hidden)).unflatten(1, (attn.heads, -1))
    backend = attn.processor._attention_backend
    out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
    for part, (context, part_layout) in enumerate(zip(context_parts, part_layouts)):
        tokens = layout.row_tokens(0, part, 0, layout.rows[part])
        part_query = query[tokens].unflatten(0, (layout.rows[part], -1))
        image = None
        if attn.add_k_proj is not None:
            image_length = context.shape[1] - _TEXT_CONTEXT
            image, context = context[:, :image_length], context[:, image_length:]
        with lora_layout(transformer, part_layout):  # NOTE: keys and values of this part's rows, on dim 0
            key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
            value = attn.to_v(context).unflatten(2, (attn.heads, -1))
            if image is not None:
                key_image = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
                value_image = attn.add_v_proj(image).unflatten(2, (attn.heads, -1))
        part_out = dispatch_attention_fn(part_query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         backend=backend, parallel_config=None).flatten(2, 3).type_as(query)
        if image is not None:
            image_out = dispatch_attention_fn(part_query, key_image, value_image, attn_mask=None, dropout_p=0.0,
                                              is_causal=False, backend=backend, parallel_config=None)
            part_out = part_out + image_out.flatten(2, 3).type_as(query)
        out[tokens] = part_out.flatten(0, 1)
    return attn.to_out[1](attn.to_out[0](out))


def teacache_blocks(transformer, inputs: PackedInputs, hidden: torch.Tensor,
                    states: Sequence[TeaCacheState | None]) -> torch.Tensor:
    """`packed_blocks` with per-state decisions (`states` per packed row): rows that skip add their residual."""
    video = inputs.video
    def group(state, rows):
        part, inner = video.part_of_row(rows.start)
        tokens = video.row_tokens(0, part, inner, inner + len(rows))
        return rows, tokens, inputs.proj[tokens] if inputs.per_token else inputs.proj[rows.start:rows.stop]

    decisions, compute_rows = decide_packed(states, group)

    computed = None
    if len(compute_rows) == video.num_rows:
        computed = (None, hidden, packed_blocks(transformer, inputs, hidden))
    elif compute_rows:
        sub_inputs, index = inputs.select(compute_rows)
        sub_hidden = hidden.index_select(0, index)
        computed = (index, sub_hidden, packed_blocks(transformer, sub_inputs, sub_hidden))
    return settle_packed(decisions, hidden, computed)
