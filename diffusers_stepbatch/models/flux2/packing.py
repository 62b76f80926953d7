"""One Flux2Transformer2DModel forward over rows of different image sizes, reference images and text lengths.

It drives the model's own submodules the way `Flux2Transformer2DModel.forward` does, op for op, with three
differences that keep each row's result its own: tokens of all rows are packed without padding (see
`packing/layout.py`), each row's AdaLN modulation (the shared `double_stream_modulation_img/txt` and
`single_stream_modulation` layers of its own timestep and guidance) reaches only its own tokens, and attention runs
inside each row with the row's own 4-axis RoPE positions. An edit row's reference-image tokens are part of its image
tokens (the pipelines append them to the latents, with their own time-axis offsets in `img_ids`), so they pack as
that row's tokens and come back in its output, as the model returns them. klein KV's calls that fill or read a
reference KV cache pack too (`kv_packing.py`). TeaCache decisions stay per request and CFG branch
(`packing/joint.teacache_blocks`): a request may alternate between packed and ordinary calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_flux2 import (Flux2AttnProcessor, Flux2KVAttnProcessor,
                                                            Flux2KVParallelSelfAttnProcessor,
                                                            Flux2ParallelSelfAttnProcessor,
                                                            Flux2Transformer2DModelOutput)
from diffusers.utils import apply_lora_scale

from ...adapters.lora import lora_layers
from ...cache.teacache import TeaCacheState
from ..packing.joint import (IMAGE, TEXT, attention_fn, double_block, joint_stream_layout, joint_stream_rotary,
                             parts_layout, per_head, rope, stream_rotary, teacache_blocks, token_streams)
from ..packing.attention import resolve
from ..packing.layout import adaln_values, attend
from ..packing.rotary_memo import remembered
from ..packing.support import reproduces_call, unsupported_reason
from .kv_packing import KV_ARGUMENTS, PartKV, kv_role, packed_kv, part_kv


@dataclass
class Flux2Part:
    """The rows of one shape: `Flux2Transformer2DModel.forward`'s inputs for them (rows along dim 0)."""

    hidden_states: torch.Tensor  # [rows, image tokens (reference images included), in_channels]
    encoder_hidden_states: torch.Tensor  # [rows, text tokens, joint_attention_dim]
    timestep: torch.Tensor  # [rows], t / 1000 as the FLUX.2 pipelines pass it
    guidance: torch.Tensor | None  # [rows] (FLUX.2 dev) or None (klein)
    txt_ids: torch.Tensor  # [text tokens, 4]
    img_ids: torch.Tensor  # [image tokens, 4]
    teacache: Sequence[TeaCacheState | None] | None = None  # per row
    kv: PartKV | None = None  # klein KV: the part fills or reads a reference KV cache


def flux2_packing_unsupported(transformer) -> str | None:
    """Why `flux2_packed_forward` can't stand in for this transformer's forward, or None when it can."""
    # NOTE: klein KV's processors run a call without KV arguments as the plain ones do
    return unsupported_reason(transformer, (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor, Flux2KVAttnProcessor,
                                            Flux2KVParallelSelfAttnProcessor))


def flux2_packed_forward(transformer, parts: Sequence[Flux2Part], joint_attention_kwargs: dict | None = None,
                         packed_attention: str = "auto") -> list[torch.Tensor]:
    """The model's output (`forward(...)[0]`) for every part, as one packed call; one tensor per part.

    `packed_attention` picks how attention stays inside each row (`models/packing/attention.py`).

    >>> out = flux2_packed_forward(pipe.transformer, [Flux2Part(x, text, t, None, txt_ids, img_ids), ...])
    """
    return _forward(transformer, parts, joint_attention_kwargs=joint_attention_kwargs,
                    packed_attention=packed_attention)


# the forward's arguments that the packed and TeaCache forwards reproduce besides klein KV's (`KV_ARGUMENTS`); a call
# with any other argument set runs as is
REPRODUCED_ARGUMENTS = frozenset({"hidden_states", "encoder_hidden_states", "timestep", "guidance", "txt_ids",
                                  "img_ids", "joint_attention_kwargs", "return_dict"})


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls of `Flux2Transformer2DModel.forward` to pack, tokens per row), or None."""
    if not reproduces_call(arguments, REPRODUCED_ARGUMENTS | KV_ARGUMENTS, "joint_attention_kwargs"):
        return None
    hidden, text = arguments["hidden_states"], arguments.get("encoder_hidden_states")
    if text is None or any(not isinstance(arguments.get(name), torch.Tensor) for name in ("img_ids", "txt_ids")):
        return None
    if kv_role(arguments) is None:
        return None
    # NOTE: timestep and guidance are joined per row: one value per row, as the FLUX.2 pipelines pass them
    for name in ("timestep", "guidance"):
        value = arguments.get(name)
        if (value is not None or name == "timestep") and not (
                isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape[0] == hidden.shape[0]):
            return None
    attention_kwargs = arguments.get("joint_attention_kwargs") or {}
    key = (arguments.get("guidance") is None, attention_kwargs.get("scale"), hidden.dtype, text.dtype,
           str(hidden.device), arguments.get("return_dict", True))
    return key, hidden.shape[1] + text.shape[1]


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of different sizes; each call's output as the model would return it (an
    extract call's with the KV cache it filled)."""
    parts = _parts(calls, teacache, transformer)
    outputs = flux2_packed_forward(transformer, parts, calls[0].get("joint_attention_kwargs"), packed_attention)
    returned = []
    for call, part, out in zip(calls, parts, outputs):
        filled = part.kv.cache if part.kv.mode == "extract" else None  # NOTE: None without reference tokens
        if call.get("return_dict", True):
            returned.append(Flux2Transformer2DModelOutput(sample=out, kv_cache=filled))
        else:
            returned.append((out, filled) if part.kv.mode == "extract" else (out,))
    return returned


def token_rows(transformer, calls: Sequence[dict]) -> list[torch.Tensor]:
    """`Packing.token_rows`: each token's row in the text, image (an edit row's reference tokens included) and joint
    streams of `pack_calls`' forward; its other LoRA layer inputs (the time and guidance embedding, the shared
    modulation layers) hold rows on dim 0, in call order."""
    return token_streams(_parts(calls))


def _parts(calls: Sequence[dict], teacache: Sequence | None = None, transformer=None) -> list[Flux2Part]:
    """The calls as parts; with `transformer`, with their KV roles (an extract call's new cache)."""
    def ids(tensor):
        return tensor[0] if tensor.ndim == 3 else tensor  # NOTE: the model reads a 3-D tensor's first row too

    parts = []
    for c, states in zip(calls, teacache or [None] * len(calls)):
        kv = None if transformer is None else part_kv(transformer, c)
        if kv is not None and kv.mode == "extract":
            states = None  # NOTE: the cache-filling call computes and leaves TeaCache's states, as `teacache.py`
        parts.append(Flux2Part(hidden_states=c["hidden_states"], encoder_hidden_states=c["encoder_hidden_states"],
                               timestep=c["timestep"], guidance=c.get("guidance"), txt_ids=ids(c["txt_ids"]),
                               img_ids=ids(c["img_ids"]), teacache=states, kv=kv))
    return parts


def _part_rotary(transformer, part: Flux2Part):
    """The model's (cos, sin) of one part's text then image positions, computed as the model does: each id tensor
    through `pos_embed` on its own, then joined."""
    if part.img_ids.shape[0] != part.hidden_states.shape[1] or part.txt_ids.shape[0] != \
            part.encoder_hidden_states.shape[1]:
        raise ValueError(f"img_ids / txt_ids hold {part.img_ids.shape[0]} / {part.txt_ids.shape[0]} positions, but "
                         f"the row has {part.hidden_states.shape[1]} image and {part.encoder_hidden_states.shape[1]} "
                         "text tokens")
    return text_image_rotary(transformer, part.txt_ids, part.img_ids)


def text_image_rotary(transformer, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the text then image positions, as `Flux2Transformer2DModel.forward` makes them, once per ids
    tensors (`rotary_memo.py`)."""
    def embed():
        image, text = transformer.pos_embed(img_ids), transformer.pos_embed(txt_ids)
        return torch.cat([text[0], image[0]], dim=0), torch.cat([text[1], image[1]], dim=0)

    return remembered(transformer.pos_embed, (txt_ids, img_ids), embed)


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, parts, joint_attention_kwargs=None, packed_attention="auto"):
    first = parts[0]
    layout = parts_layout(parts)
    raw = layout.pack(IMAGE, [p.hidden_states for p in parts])
    timestep = torch.cat([p.timestep for p in parts]).to(raw.dtype) * 1000
    guidance = None
    if first.guidance is not None:
        guidance = torch.cat([p.guidance for p in parts]).to(raw.dtype) * 1000
    temb = transformer.time_guidance_embed(timestep, guidance)
    kv = packed_kv(transformer, [p.kv or PartKV(None) for p in parts], layout.rows, timestep, guidance)
    if kv is not None:
        packed_attention = "recover_scatter"  # NOTE: a KV part attends as its own batch, as the model does
    mod_img = transformer.double_stream_modulation_img(temb)
    mod_txt = transformer.double_stream_modulation_txt(temb)
    mod_single = transformer.single_stream_modulation(temb)

    hidden = transformer.x_embedder(raw)
    encoder = transformer.context_embedder(layout.pack(TEXT, [p.encoder_hidden_states for p in parts]))
    method = resolve(packed_attention, hidden.device, hidden.dtype)
    part_rotary = [_part_rotary(transformer, part) for part in parts]
    mods = (mod_img, mod_txt, mod_single)

    states = [s for p in parts for s in (p.teacache or [None] * p.hidden_states.shape[0])]
    if all(state is None for state in states) or not len(transformer.transformer_blocks):
        hidden = _blocks(transformer, layout, hidden, encoder, mods, part_rotary, method, kv)
    else:
        hidden = _teacache_blocks(transformer, layout, states, hidden, encoder, mods, part_rotary, method, kv)

    norm_out = transformer.norm_out
    emb = norm_out.linear(norm_out.silu(temb).to(hidden.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    scale1, shift = layout.row_values(IMAGE, torch.cat([1 + scale, shift], dim=1), 2)
    out = layout.modulate(IMAGE, norm_out.norm(hidden), scale1, shift)
    outputs = layout.unpack(IMAGE, transformer.proj_out(out))
    return outputs if kv is None else kv.outputs(outputs)


def _blocks(transformer, layout, hidden, encoder, mods, part_rotary, method, kv=None):
    """The double and single blocks on packed tokens; `mods` are the shared modulation layers' outputs per row
    (image, text, single stream), `kv` the parts' KV roles (None: plain calls). Returns the image tokens."""
    mod_img, mod_txt, mod_single = mods
    # NOTE: MLPs may run per part (temporaries of one part's size) unless per-row LoRA maps their inputs to
    # rows by token count, which a part's slice would not match.
    split = not lora_layers(transformer)
    if len(transformer.transformer_blocks):
        rotary = stream_rotary(layout, part_rotary)
        image_mods = adaln_values(layout, IMAGE, mod_img, 6) if kv is None else kv.image_values(layout, mod_img)
        text_mods = adaln_values(layout, TEXT, mod_txt, 6)
        text_lengths = [text for text, _ in layout.lengths]
        for index, block in enumerate(transformer.transformer_blocks):
            attention = None if kv is None else kv.attention(block.attn, text_lengths, index, double=True)
            encoder, hidden = double_block(block, layout, hidden, encoder, (block.norm1, block.norm1_context),
                                           image_mods, text_mods, rotary, method, split, attention)
    if len(transformer.single_transformer_blocks):
        hidden = _single_blocks(transformer, layout, hidden, encoder, mod_single, part_rotary, method, kv)
    return hidden


def _teacache_blocks(transformer, layout, states, hidden, encoder, mods, part_rotary, method, kv=None):
    """`_blocks` with per-state TeaCache decisions on the signal as `teacache.py` computes it, op for op."""
    shift, scale = mods[0].index_select(0, layout.token_rows[IMAGE]).chunk(6, dim=1)[:2]
    signal = (1 + scale) * transformer.transformer_blocks[0].norm1(hidden) + shift

    def run(sub_layout, sub_hidden, sub_encoder, rows, parts):
        sub_mods = tuple(mod.index_select(0, rows) for mod in mods)
        sub_kv = None if kv is None else kv.select(layout, rows.tolist())
        return _blocks(transformer, sub_layout, sub_hidden, sub_encoder, sub_mods,
                       [part_rotary[part] for part in parts], method, sub_kv)

    return teacache_blocks(layout, states, hidden, encoder, signal, run)


def _single_blocks(transformer, layout, hidden, encoder, mod_single, part_rotary, method, kv=None):
    """The single-stream blocks over each row's text then image tokens; returns the image tokens."""
    joint_layout = joint_stream_layout(layout)
    joint = hidden.new_empty(joint_layout.tokens(0), hidden.shape[1])
    for joint_part, text, image in zip(joint_layout.unpack(0, joint), layout.unpack(TEXT, encoder),
                                       layout.unpack(IMAGE, hidden)):
        joint_part[:, :text.shape[1]] = text
        joint_part[:, text.shape[1]:] = image
    rotary = joint_stream_rotary(layout, part_rotary)
    text_lengths = [text for text, _ in layout.lengths]
    shift, scale, gate = (adaln_values(joint_layout, 0, mod_single, 3) if kv is None
                          else kv.joint_values(joint_layout, text_lengths, mod_single))
    attn = transformer.single_transformer_blocks[0].attn
    # NOTE: one [tokens, attention + mlp dim] workspace for all blocks, written in place of the processor's
    # torch.cat([attn_output, mlp_hidden_states])
    mixed = joint.new_empty(joint.shape[0], attn.to_out.in_features)
    for index, block in enumerate(transformer.single_transformer_blocks):
        attention = None if kv is None else kv.attention(block.attn, text_lengths, index, double=False)
        joint = _single_block(block, joint_layout, joint, shift, scale, gate, rotary, method, mixed, attention)
    return layout.pack(IMAGE, [part[:, text_len:] for part, (text_len, _) in
                               zip(joint_layout.unpack(0, joint), layout.lengths)])


def _single_block(block, joint_layout, joint, shift, scale, gate, rotary, method, mixed, attention=None):
    """Flux2SingleTransformerBlock with Flux2ParallelSelfAttnProcessor on the packed joint stream (`attention`:
    one function per part; None: the processor's)."""
    norm = joint_layout.modulate(0, block.norm(joint), scale, shift)
    attn = block.attn
    projected = attn.to_qkv_mlp_proj(norm)
    qkv_dim = 3 * attn.inner_dim
    qkv, mlp = projected[:, :qkv_dim], projected[:, qkv_dim:]
    query, key, value = qkv.chunk(3, dim=-1)
    query = rope(attn.norm_q(per_head(attn, query)), rotary)
    key = rope(attn.norm_k(per_head(attn, key)), rotary)
    inner = attn.inner_dim
    attend(joint_layout, [query], [key], [per_head(attn, value)], attention or attention_fn(attn), method,
           out=[mixed[:, :inner]])
    mixed[:, inner:] = attn.mlp_act_fn(mlp)
    joint = joint_layout.gated_add(0, joint, gate, attn.to_out(mixed))
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint
