"""One LTX2VideoTransformer3DModel forward over rows of different frame counts, sizes and audio lengths.

It drives the model's own submodules the way `LTX2VideoTransformer3DModel.forward` does, op for op, with the
tokens of every row packed without padding in four streams (video, audio, the video prompt, the audio prompt;
see `layout.py`). What keeps each row's result its own:
- every AdaLN value (the blocks' tables plus the row's timestep embedding, the audio/video cross-attention
  scale/shift and gates, LTX-2.3's prompt modulation, the output layer's) reaches only that row's tokens;
- RoPE frequencies come from each row's own coordinates (`video_coords` / `audio_coords` as the pipeline passes
  them, or made from the call's `num_frames`, `height`, `width`, `fps` and `audio_num_frames`);
- video and audio self-attention run inside each row; the prompt cross-attentions, audio-to-video and
  video-to-audio attend per part (rows of equal token counts in all four streams) as one batch, the prompt
  attention with the row's own mask exactly as the model applies it (its -10000 bias, padding kept).

A video `timestep` per token (image-to-video's conditioning frames: [rows, video tokens]) modulates each token
with its own value, as in the model. Spatio-temporal guidance, self-attention masks and keyframe markers are not
reproduced: such calls don't pack (`pack_key` is None) and run as the model's own call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_ltx2 import (
    AudioVisualModelOutput,
    LTX2AudioVideoAttnProcessor,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)
from diffusers.utils import apply_lora_scale

from ...adapters.lora import LoraLayout, lora_active, lora_layers, lora_layout
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import commit_rows, computing_rows, decide_rows
from ..packing.attention import resolve
from ..packing.layout import PackedLayout, RowValues, attend
from ..packing.support import reproduces_call, unsupported_reason

VIDEO, AUDIO, TEXT, AUDIO_TEXT = 0, 1, 2, 3

# the forward's arguments a packed call reproduces; a call with any other argument set runs unpacked
_PACKED_ARGUMENTS = frozenset({
    "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states", "timestep",
    "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask", "audio_encoder_attention_mask", "num_frames",
    "height", "width", "fps", "audio_num_frames", "video_coords", "audio_coords", "isolate_modalities",
    "use_cross_timestep", "attention_kwargs", "return_dict"})
_TIMESTEPS = ("timestep", "audio_timestep", "sigma", "audio_sigma")
_MASKS = ("encoder_attention_mask", "audio_encoder_attention_mask")


def ltx2_packing_unsupported(transformer) -> str | None:
    """Why `ltx2_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    return unsupported_reason(transformer, LTX2AudioVideoAttnProcessor)


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `LTX2VideoTransformer3DModel.forward` to pack, tokens per row), or None."""
    if not arguments.get("spatio_temporal_guidance_blocks"):  # NOTE: [] is no guidance, as the model reads it
        arguments = {name: value for name, value in arguments.items() if name != "spatio_temporal_guidance_blocks"}
    if not reproduces_call(arguments, _PACKED_ARGUMENTS, "attention_kwargs"):
        return None
    video, audio = arguments["hidden_states"], arguments.get("audio_hidden_states")
    text, audio_text = arguments.get("encoder_hidden_states"), arguments.get("audio_encoder_hidden_states")
    if any(not isinstance(t, torch.Tensor) or t.ndim != 3 for t in (video, audio, text, audio_text)):
        return None
    rows = video.shape[0]
    timestep = arguments.get("timestep")
    if not isinstance(timestep, torch.Tensor) or timestep.numel() not in (rows, rows * video.shape[1]):
        return None
    if timestep.numel() != rows and arguments.get("audio_timestep") is None:
        return None  # NOTE: the model would modulate audio tokens by video tokens' timesteps
    for name in _TIMESTEPS[1:]:  # NOTE: one value per row
        value = arguments.get(name)
        if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != rows):
            return None
    for name in _MASKS:
        mask = arguments.get(name)
        if mask is not None and (mask.ndim != 2 or mask.shape[0] != rows):
            return None
    if arguments.get("video_coords") is None and None in (arguments.get(n) for n in ("num_frames", "height", "width")):
        return None
    if arguments.get("audio_coords") is None and arguments.get("audio_num_frames") is None:
        return None
    key = ((arguments.get("attention_kwargs") or {}).get("scale"), video.dtype, audio.dtype, text.dtype,
           str(video.device), arguments.get("return_dict", True), bool(arguments.get("isolate_modalities", False)),
           bool(arguments.get("use_cross_timestep", False)), arguments.get("sigma") is None,
           *(arguments.get(name) is None for name in _MASKS))
    return key, video.shape[1] + audio.shape[1] + text.shape[1] + audio_text.shape[1]


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different sizes; each output as the model returns it."""
    first = calls[0]
    videos, audios = ltx2_packed_forward(transformer, calls, first.get("attention_kwargs"), packed_attention, teacache)
    return [(video, audio) if not call.get("return_dict", True) else AudioVisualModelOutput(sample=video,
                                                                                            audio_sample=audio)
            for call, video, audio in zip(calls, videos, audios)]


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """Per token stream of `pack_calls`' forward (video, audio, video prompt, audio prompt tokens in packed order),
    each token's row (calls' rows in call order)."""
    lengths = [tuple(call[name].shape[1] for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states",
                                                      "audio_encoder_hidden_states"))
               for call in calls for _ in range(call["hidden_states"].shape[0])]
    return _token_streams(lengths, list(range(len(lengths))))


def _order(lengths: Sequence[tuple[int, ...]]) -> list[int]:
    # NOTE: rows of equal token counts in every stream form one part: they attend as one batch.
    return sorted(range(len(lengths)), key=lambda r: lengths[r])


def _token_streams(lengths: Sequence[tuple[int, ...]], ids: Sequence[int]) -> list[torch.Tensor]:
    """Per stream, each packed token's row (`ids[r]`: row r's number in the forward), rows in `_order`."""
    order = _order(lengths)
    ordered = torch.tensor([ids[r] for r in order])
    return [ordered.repeat_interleave(torch.tensor([lengths[r][stream] for r in order])) for stream in range(4)]


def ltx2_packed_forward(transformer, calls: Sequence[dict], attention_kwargs: dict | None = None,
                        packed_attention: str = "auto", teacache: Sequence | None = None
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(video outputs, audio outputs), one per call, for calls (the forward's arguments by name) whose `pack_key`s
    are equal, as one packed call. `packed_attention` picks how self-attention stays inside each row;
    `teacache[i]` holds call i's per-row TeaCache states or None (`models/ltx2/teacache.py`).

    >>> videos, audios = ltx2_packed_forward(pipe.transformer, [dict(hidden_states=x, ...), ...])
    """
    return _forward(transformer, calls, attention_kwargs=attention_kwargs, packed_attention=packed_attention,
                    teacache=teacache)


@dataclass
class _Row:
    call: int
    index: int  # its row in the forward: calls' rows in call order
    streams: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # video, audio, text, audio text
    masks: tuple[torch.Tensor | None, torch.Tensor | None]  # [text tokens] per prompt, or None
    timesteps: tuple[torch.Tensor, ...]  # timestep ([1] or [video tokens]), audio_timestep, sigma, audio_sigma ([1];
    # sigma may be None)
    video_coords: torch.Tensor  # [3, video tokens, 2]
    audio_coords: torch.Tensor  # [1, audio tokens, 2]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(stream.shape[0] for stream in self.streams)


def _rows(transformer, calls: Sequence[dict]) -> list[_Row]:
    rows = []
    for index, call in enumerate(calls):
        video = call["hidden_states"]
        count, device = video.shape[0], video.device
        video_coords = call.get("video_coords")
        if video_coords is None:
            video_coords = transformer.rope.prepare_video_coords(count, call["num_frames"], call["height"],
                                                                 call["width"], device, fps=call.get("fps", 24.0))
        audio_coords = call.get("audio_coords")
        if audio_coords is None:
            audio_coords = transformer.audio_rope.prepare_audio_coords(count, call["audio_num_frames"],
                                                                       call["audio_hidden_states"].device)
        timestep = call["timestep"]
        audio_timestep = call.get("audio_timestep") if call.get("audio_timestep") is not None else timestep
        sigma = call.get("sigma")
        audio_sigma = call.get("audio_sigma") if call.get("audio_sigma") is not None else sigma
        per_row = [None if t is None else t.reshape(count, -1) for t in (timestep, audio_timestep, sigma, audio_sigma)]
        masks = [call.get(name) for name in _MASKS]
        for r in range(count):
            streams = (video[r], call["audio_hidden_states"][r], call["encoder_hidden_states"][r],
                       call["audio_encoder_hidden_states"][r])
            rows.append(_Row(index, len(rows), streams,
                             tuple(None if m is None else m[r] for m in masks),
                             tuple(None if t is None else t[r] for t in per_row), video_coords[r], audio_coords[r]))
            if rows[-1].video_coords.shape[1] != rows[-1].streams[VIDEO].shape[0]:
                raise ValueError(f"video coordinates for {rows[-1].video_coords.shape[1]} tokens, but the row has "
                                 f"{rows[-1].streams[VIDEO].shape[0]} video tokens")
    return rows


@apply_lora_scale("attention_kwargs")
def _forward(transformer, calls, attention_kwargs=None, packed_attention="auto", teacache=None):
    rows = _rows(transformer, calls)
    states = [state for index, call in enumerate(calls)
              for state in (teacache[index] if teacache is not None and teacache[index] is not None
                            else [None] * call["hidden_states"].shape[0])]
    through = None
    if any(state is not None for state in states):
        def through(signal, hidden, audio, run_rows):
            return teacache_blocks(rows, states, signal, hidden, audio, run_rows)

    per_row = packed_rows(transformer, calls[0], rows, packed_attention, through)
    return tuple([torch.stack([per_row[r][stream] for r in range(len(rows)) if rows[r].call == index])
                  for index in range(len(calls))] for stream in (0, 1))


def packed_rows(transformer, flags: dict, rows: Sequence[_Row], packed_attention: str, through=None,
                final: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every row's (video, audio) output, or with `final=False` its tokens after the blocks, in `rows` order.

    `flags`: a call's arguments (the whole-call options). `through(signal, hidden, audio, run_rows)`, where given,
    stands in for the blocks: it gets the first block's modulated video input, the video and audio tokens before
    the blocks (per row) and `run_rows(rows)` (the blocks on those rows only), and returns every row's (video,
    audio) tokens after the blocks."""
    lora = None
    if lora_active(transformer):  # NOTE: per-row values in `rows` order, token streams in packed order
        ids = [row.index for row in rows]
        lora = LoraLayout(ids, _token_streams([row.lengths for row in rows], ids))
    with lora_layout(transformer, lora):
        return _packed_rows(transformer, flags, rows, packed_attention, through, final)


def _packed_rows(transformer, flags, rows, packed_attention, through, final):
    config = transformer.config
    order = _order([row.lengths for row in rows])
    ordered = [rows[r] for r in order]
    sizes: dict[tuple[int, ...], int] = {}
    for row in ordered:
        sizes[row.lengths] = sizes.get(row.lengths, 0) + 1
    device = ordered[0].streams[VIDEO].device
    layout = PackedLayout(rows=list(sizes.values()), lengths=list(sizes), device=device)
    single = {stream: PackedLayout(rows=list(sizes.values()), lengths=[(n[stream],) for n in sizes], device=device)
              for stream in (VIDEO, AUDIO)}

    def cat(stream):
        return torch.cat([row.streams[stream] for row in ordered])

    video_coords = torch.cat([row.video_coords for row in ordered], dim=1).unsqueeze(0)
    audio_coords = torch.cat([row.audio_coords for row in ordered], dim=1).unsqueeze(0)
    ropes = (transformer.rope(video_coords, device=device), transformer.audio_rope(audio_coords, device=device),
             transformer.cross_attn_rope(video_coords[:, 0:1], device=device),
             transformer.cross_attn_audio_rope(audio_coords[:, 0:1], device=device))

    hidden = transformer.proj_in(cat(VIDEO))
    audio = transformer.audio_proj_in(cat(AUDIO))
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    split = not lora_layers(transformer)  # NOTE: as in models/qwenimage/packing.py

    # NOTE: per-row timesteps are embedded in `rows` order (as per-row LoRA numbers the rows), then put in packed
    # order; per-token video timesteps are embedded in packed order (the video token stream)
    count = len(rows)
    packed = torch.tensor(order, device=device)
    timestep, audio_timestep, sigma, audio_sigma = (
        None if rows[0].timesteps[i] is None else torch.cat([row.timesteps[i] for row in rows]) for i in range(4))
    per_token = timestep.numel() != count
    if per_token:  # NOTE: some row has a timestep per video token: every row gets one per token
        timestep = torch.cat([row.timesteps[0].expand(row.streams[VIDEO].shape[0]) for row in ordered])

    def embed(module, values, values_per_token=False, dtype=hidden.dtype):
        out = module(values, batch_size=values.numel(), hidden_dtype=dtype)
        return out if values_per_token else tuple(t.index_select(0, packed) for t in out)

    temb, embedded = embed(transformer.time_embed, timestep, per_token)
    temb_audio, audio_embedded = embed(transformer.audio_time_embed, audio_timestep, dtype=audio.dtype)
    temb_prompt = temb_prompt_audio = None
    if transformer.prompt_modulation and config.use_prompt_adaln_single:
        temb_prompt = embed(transformer.prompt_adaln, sigma)[0]
        temb_prompt_audio = embed(transformer.audio_prompt_adaln, audio_sigma, dtype=audio.dtype)[0]
    cross_timestep = flags.get("use_cross_timestep", False)
    gate_factor = config.cross_attn_timestep_scale_multiplier / config.timestep_scale_multiplier
    video_ca_timestep = audio_sigma if cross_timestep else timestep
    video_ca_per_token = per_token and not cross_timestep
    audio_ca_timestep = sigma if cross_timestep else audio_timestep
    modulation = _Modulation(
        temb=temb, temb_audio=temb_audio, temb_prompt=temb_prompt, temb_prompt_audio=temb_prompt_audio,
        video_ca=embed(transformer.av_cross_attn_video_scale_shift, video_ca_timestep, video_ca_per_token)[0],
        video_ca_gate=embed(transformer.av_cross_attn_video_a2v_gate, video_ca_timestep * gate_factor,
                            video_ca_per_token)[0],
        audio_ca=embed(transformer.av_cross_attn_audio_scale_shift, audio_ca_timestep, dtype=audio.dtype)[0],
        audio_ca_gate=embed(transformer.av_cross_attn_audio_v2a_gate, audio_ca_timestep * gate_factor,
                            dtype=audio.dtype)[0])

    text, audio_text = cat(TEXT), cat(AUDIO_TEXT)
    if config.use_prompt_embeddings:
        text = transformer.caption_projection(text)
        audio_text = transformer.audio_caption_projection(audio_text)
    masks = [_mask_bias(layout, ordered, i, dtype) for i, dtype in enumerate((hidden.dtype, audio.dtype))]

    context = _Context(layout, single, ropes, masks, method, split,
                       cross_modal=not flags.get("isolate_modalities", False))
    if through is None:
        for block in transformer.transformer_blocks:
            hidden, audio = _block(block, context, modulation, hidden, audio, text, audio_text)
    else:
        first = transformer.transformer_blocks[0]
        shift_msa, scale_msa = _values(layout, VIDEO, *_params(first.scale_shift_table, modulation.temb)[:2],
                                       scales=(1,))
        signal = _split(layout.modulate(VIDEO, first.norm1(hidden), scale_msa, shift_msa), VIDEO, order, rows)
        after = through(signal, _split(hidden, VIDEO, order, rows), _split(audio, AUDIO, order, rows),
                        lambda subset: packed_rows(transformer, flags, [rows[r] for r in subset], packed_attention,
                                                   final=False))
        hidden = torch.cat([after[r][0] for r in order])
        audio = torch.cat([after[r][1] for r in order])
    if not final:
        return list(zip(_split(hidden, VIDEO, order, rows), _split(audio, AUDIO, order, rows)))

    outputs = []
    for stream, x, emb, table, norm, proj in (
            (VIDEO, hidden, embedded, transformer.scale_shift_table, transformer.norm_out, transformer.proj_out),
            (AUDIO, audio, audio_embedded, transformer.audio_scale_shift_table, transformer.audio_norm_out,
             transformer.audio_proj_out)):
        values = table[None] + emb[:, None]  # [rows or tokens, 2, dim]: shift, scale
        shift, scale1 = _values(layout, stream, values[:, 0], values[:, 1], scales=(1,))
        outputs.append(_split(proj(layout.modulate(stream, norm(x), scale1, shift)), stream, order, rows))
    return list(zip(*outputs))


def _split(packed, stream, order, rows) -> list[torch.Tensor]:
    """A stream's packed tokens (rows in `order`) as one tensor per row, in `rows` order."""
    per_row = [None] * len(rows)
    start = 0
    for r in order:
        tokens = rows[r].streams[stream].shape[0]
        per_row[r] = packed[start:start + tokens]
        start += tokens
    return per_row


def _mask_bias(layout, ordered, which, dtype) -> list[torch.Tensor | None]:
    """Per part, the prompt mask as the model turns a [rows, tokens] mask into an additive bias [rows, 1, tokens]."""
    biases, start = [], 0
    for part_rows in layout.rows:
        masks = [row.masks[which] for row in ordered[start:start + part_rows]]
        start += part_rows
        biases.append(None if masks[0] is None else ((1 - torch.stack(masks).to(dtype)) * -10000.0).unsqueeze(1))
    return biases


@dataclass
class _Modulation:
    """Per-row embeddings of the timesteps: [rows, k * dim] each (the model's `temb`, `temb_ca_*`, ...); `temb`,
    `video_ca` and `video_ca_gate` are [video tokens, k * dim] where the video timestep is per token."""

    temb: torch.Tensor
    temb_audio: torch.Tensor
    temb_prompt: torch.Tensor | None
    temb_prompt_audio: torch.Tensor | None
    video_ca: torch.Tensor
    video_ca_gate: torch.Tensor
    audio_ca: torch.Tensor
    audio_ca_gate: torch.Tensor


@dataclass
class _Context:
    layout: PackedLayout
    single: dict[int, PackedLayout]  # the video and the audio stream alone, same parts and rows
    ropes: tuple  # video, audio, cross-attention video, cross-attention audio: per-token (cos, sin)
    masks: list[list[torch.Tensor | None]]  # per prompt (video, audio), per part: the additive bias or None
    method: str
    split: bool
    cross_modal: bool


def _params(table: torch.Tensor, emb: torch.Tensor | None) -> list[torch.Tensor]:
    """`get_mod_params` per row: the block's table plus the row's embedding, as [rows, dim] values."""
    if emb is None:  # NOTE: LTX-2.5's static prompt table: the same for every row
        return list(table.unbind(0))
    return list((table[None] + emb.reshape(emb.shape[0], table.shape[0], -1)).unbind(1))


def _values(layout, stream, *values: torch.Tensor, scales: Sequence[int] = ()) -> list[RowValues]:
    """Row values (or one per token of `stream`) as `stream`'s tokens see them, entries at `scales` as 1 + scale
    (for `modulate`)."""
    rows = layout.num_rows
    pieces = [(1 + v if i in scales else v).expand(rows, -1) if v.ndim == 1 else (1 + v if i in scales else v)
              for i, v in enumerate(values)]
    if pieces[0].shape[0] != rows:  # NOTE: a value per token (a row has as many tokens as values only if it's 1)
        return [RowValues(None, piece) for piece in pieces]
    return layout.row_values(stream, torch.cat(pieces, dim=1), len(pieces))


def _block(block, ctx: _Context, mod: _Modulation, hidden, audio, text, audio_text):
    layout = ctx.layout
    video_params = _params(block.scale_shift_table, mod.temb)
    audio_params = _params(block.audio_scale_shift_table, mod.temb_audio)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, *video_text_q = _values(
        layout, VIDEO, *video_params, scales=(1, 4, 7))
    a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp, *audio_text_q = _values(
        layout, AUDIO, *audio_params, scales=(1, 4, 7))

    # 1. self-attention inside each row
    norm = layout.modulate(VIDEO, block.norm1(hidden), scale_msa, shift_msa)
    hidden = layout.gated_add(VIDEO, hidden, gate_msa, _self_attention(block.attn1, ctx, VIDEO, norm, ctx.ropes[0]))
    norm = layout.modulate(AUDIO, block.audio_norm1(audio), a_scale_msa, a_shift_msa)
    audio = layout.gated_add(AUDIO, audio, a_gate_msa,
                             _self_attention(block.audio_attn1, ctx, AUDIO, norm, ctx.ropes[1]))

    # 2. each row's prompt
    if block.cross_attn_adaln:
        shift_kv, scale_kv = _values(layout, TEXT, *_params(block.prompt_scale_shift_table, mod.temb_prompt),
                                     scales=(1,))
        text = layout.modulate(TEXT, text, scale_kv, shift_kv)
        a_shift_kv, a_scale_kv = _values(layout, AUDIO_TEXT, *_params(block.audio_prompt_scale_shift_table,
                                                                      mod.temb_prompt_audio), scales=(1,))
        audio_text = layout.modulate(AUDIO_TEXT, audio_text, a_scale_kv, a_shift_kv)
    hidden = _prompt_attention(block.norm2, block.attn2, ctx, VIDEO, TEXT, hidden, text, ctx.masks[0],
                               video_text_q if block.video_cross_attn_adaln else None)
    audio = _prompt_attention(block.audio_norm2, block.audio_attn2, ctx, AUDIO, AUDIO_TEXT, audio, audio_text,
                              ctx.masks[1], audio_text_q if block.audio_cross_attn_adaln else None)

    # 3. audio-to-video and video-to-audio inside each row
    if ctx.cross_modal:
        norm_video = block.audio_to_video_norm(hidden)
        norm_audio = block.video_to_audio_norm(audio)
        a2v_scale, a2v_shift, v2a_scale, v2a_shift = _values(
            layout, VIDEO, *_params(block.video_a2v_cross_attn_scale_shift_table[:4], mod.video_ca), scales=(0, 2))
        (a2v_gate,) = _values(layout, VIDEO, *_params(block.video_a2v_cross_attn_scale_shift_table[4:],
                                                       mod.video_ca_gate))
        audio_a2v_scale, audio_a2v_shift, audio_v2a_scale, audio_v2a_shift = _values(
            layout, AUDIO, *_params(block.audio_a2v_cross_attn_scale_shift_table[:4], mod.audio_ca), scales=(0, 2))
        (v2a_gate,) = _values(layout, AUDIO, *_params(block.audio_a2v_cross_attn_scale_shift_table[4:],
                                                       mod.audio_ca_gate))
        video_rope, audio_rope = ctx.ropes[2], ctx.ropes[3]
        a2v = _cross_attention(block.audio_to_video_attn, ctx, VIDEO, AUDIO,
                               layout.modulate(VIDEO, norm_video, a2v_scale, a2v_shift),
                               layout.modulate(AUDIO, norm_audio, audio_a2v_scale, audio_a2v_shift),
                               video_rope, audio_rope)
        v2a = _cross_attention(block.video_to_audio_attn, ctx, AUDIO, VIDEO,
                               layout.modulate(AUDIO, norm_audio, audio_v2a_scale, audio_v2a_shift),
                               layout.modulate(VIDEO, norm_video, v2a_scale, v2a_shift),
                               audio_rope, video_rope)
        hidden = layout.gated_add(VIDEO, hidden, a2v_gate, a2v)
        audio = layout.gated_add(AUDIO, audio, v2a_gate, v2a)

    # 4. feed-forward
    norm = layout.modulate(VIDEO, block.norm3(hidden), scale_mlp, shift_mlp)
    hidden = layout.gated_apply(VIDEO, hidden, gate_mlp, block.ff, norm, ctx.split)
    norm = layout.modulate(AUDIO, block.audio_norm3(audio), a_scale_mlp, a_shift_mlp)
    audio = layout.gated_apply(AUDIO, audio, a_gate_mlp, block.audio_ff, norm, ctx.split)
    return hidden, audio


def _rope(attn, x: torch.Tensor, freqs) -> torch.Tensor:
    # NOTE: packed [tokens, dim] as one sequence of a batch of one, the frequencies per token
    apply = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return apply(x.unsqueeze(0), freqs).squeeze(0)


def _projections(attn, hidden, context, query_rope, key_rope):
    """LTX2AudioVideoAttnProcessor's token-wise part: (query, key, value as [tokens, heads, dim], gate logits)."""
    gate_logits = attn.to_gate_logits(hidden) if attn.to_gate_logits is not None else None
    query = attn.norm_q(attn.to_q(hidden))
    key = attn.norm_k(attn.to_k(context))
    value = attn.to_v(context)
    if query_rope is not None:
        query = _rope(attn, query, query_rope)
        key = _rope(attn, key, key_rope if key_rope is not None else query_rope)
    return (*(t.unflatten(1, (attn.heads, -1)) for t in (query, key, value)), gate_logits)


def _output(attn, out: torch.Tensor, dtype, gate_logits) -> torch.Tensor:
    out = out.to(dtype)
    if gate_logits is not None:
        out = (out.unflatten(1, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(1, 2)
    return attn.to_out[1](attn.to_out[0](out))


def _dispatch(attn, query, key, value, mask=None):
    processor = attn.processor
    return dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                 backend=processor._attention_backend, parallel_config=processor._parallel_config)


def _self_attention(attn, ctx: _Context, stream, hidden, rope):
    query, key, value, gate_logits = _projections(attn, hidden, hidden, rope, None)
    (out,) = attend(ctx.single[stream], [query], [key], [value],
                    lambda q, k, v: _dispatch(attn, q, k, v), ctx.method)
    return _output(attn, out, query.dtype, gate_logits)


def _cross_attention(attn, ctx: _Context, query_stream, key_stream, hidden, context, query_rope, key_rope,
                     masks=None):
    """Queries of one stream attend to another stream's tokens of the same row, one SDPA batch per part."""
    query, key, value, gate_logits = _projections(attn, hidden, context, query_rope, key_rope)
    layout = ctx.layout
    out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
    for part, part_rows in enumerate(layout.rows):
        q_span, k_span = layout.row_tokens(query_stream, part, 0, part_rows), layout.row_tokens(key_stream, part, 0,
                                                                                              part_rows)
        q, k, v = (t[span].unflatten(0, (part_rows, -1)) for t, span in ((query, q_span), (key, k_span),
                                                                          (value, k_span)))
        mask = None if masks is None else masks[part]
        if mask is not None:
            mask = attn.prepare_attention_mask(mask, k.shape[1], part_rows).view(part_rows, attn.heads, -1,
                                                                                  mask.shape[-1])
        out[q_span] = _dispatch(attn, q, k, v, mask).flatten(2, 3).flatten(0, 1)
    return _output(attn, out, query.dtype, gate_logits)


def _prompt_attention(norm_layer, attn, ctx: _Context, stream, text_stream, hidden, text, masks, query_mod):
    """The block's prompt cross-attention (Q: the stream; K, V: the row's prompt), LTX-2.3's query modulation
    and gate where `query_mod` holds them."""
    layout = ctx.layout
    norm = norm_layer(hidden)
    if query_mod is not None:
        shift_q, scale_q, gate_q = query_mod
        norm = layout.modulate(stream, norm, scale_q, shift_q)
    out = _cross_attention(attn, ctx, stream, text_stream, norm, text, None, None, masks)
    if query_mod is not None:
        return layout.gated_add(stream, hidden, gate_q, out)
    return hidden + out


def teacache_blocks(rows: Sequence, states: Sequence[TeaCacheState | None], signal: Sequence[torch.Tensor],
                    video: Sequence[torch.Tensor], audio: Sequence[torch.Tensor],
                    run_rows: Callable[[list[int]], list]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The blocks with per-state decisions (`states` per row): rows that skip add their cached residuals.

    States change only after the blocks ran, so a failed call retried per shape stays correct."""
    decisions = decide_rows(states, lambda group: torch.cat([signal[r] for r in group]))
    compute_rows = computing_rows(decisions)
    computed = dict(zip(compute_rows, run_rows(compute_rows))) if compute_rows else {}
    after = [None] * len(rows)
    for decision in decisions:
        if decision.compute:
            for r in decision.rows:
                after[r] = computed[r]
        else:
            cached_video, cached_audio = decision.state.residual
            pieces = zip(decision.rows, cached_video.split([video[r].shape[0] for r in decision.rows]),
                         cached_audio.split([audio[r].shape[0] for r in decision.rows]))
            for r, video_residual, audio_residual in pieces:
                after[r] = (video[r] + video_residual, audio[r] + audio_residual)
    commit_rows(decisions, lambda decision: (torch.cat([computed[r][0] - video[r] for r in decision.rows]),
                                             torch.cat([computed[r][1] - audio[r] for r in decision.rows])))
    return after
