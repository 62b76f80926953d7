"""One Qwen-Image 2.1 call's joint sequence, as `QwenImage21Transformer2DModel.forward` builds it before its blocks
(call for call, for its per-segment attention processors), and its output layers, for the TeaCache and packed
forwards."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import _qwenimage21_prefix_segments

from ..packing.support import reproduces_call

SLOT_TOKENS = 4  # latent tokens per image slot of the vision-language sequence (2x2)

# the forward's arguments these forwards reproduce; a call with any other computes as the model does
REPRODUCED = frozenset({"hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask",
                        "encoder_hidden_states_mask", "attention_kwargs", "kv_cache", "kv_cache_mode", "return_dict"})


def reproduced(arguments: dict) -> bool:
    """The call is one these forwards reproduce: no other argument, and a KV cache only with its mode (else the
    model's own forward runs, and raises as it does)."""
    mode = arguments.get("kv_cache_mode")
    return (reproduces_call(arguments, REPRODUCED, "attention_kwargs") and mode in (None, "extract", "cached")
            and (arguments.get("kv_cache") is None) == (mode is None))


@dataclass
class JointCall:
    """The blocks' inputs for one call: `joint` [rows, tokens, dim] (only the target image's tokens when the call
    reads its KV cache), and what the blocks and the output layers take with it."""

    joint: torch.Tensor
    rotary_emb: torch.Tensor
    temb: torch.Tensor  # a row per row, then `zero_rows` t=0 rows
    modulation: torch.Tensor  # of `temb`'s rows
    modulation_mask: torch.Tensor | None  # which tokens read their row's timestep row (else a t=0 row)
    target: torch.Tensor  # the target image's tokens of `joint`
    attention_mask: torch.Tensor | None
    segments: list | None  # the prefix's attention segments (a call that runs its whole sequence)
    key_valid: torch.Tensor | None
    write: slice | None  # the prefix's tokens, where the call fills the KV cache
    kv_cache: Any
    kv_cache_mode: str | None
    zero_rows: int = 0  # with `causal_condition`: the model's one t=0 row for every row, or one per row

    def per_token(self, params: torch.Tensor) -> torch.Tensor:
        """Per-row `params` of `temb`'s rows per token, [rows, tokens or 1, dim]: a target image's token takes
        its row's, another token its row's t=0 row's (the model's `_select_modulation_rows`)."""
        if self.modulation_mask is None:
            return params.unsqueeze(1)
        real, zero = params[:-self.zero_rows].unsqueeze(1), params[-self.zero_rows:].unsqueeze(1)
        return torch.where(self.modulation_mask.view(1, -1, 1), real, zero)

    def token_modulation(self) -> list[torch.Tensor]:
        """The blocks' (scale, gate) of the attention and of the MLP, per token: [rows, tokens or 1, dim] each."""
        return [self.per_token(params) for half in self.modulation.chunk(2, dim=-1) for params in half.chunk(2, -1)]

    def rows(self, index: torch.Tensor, kv_cache: Any) -> JointCall:
        """The blocks' inputs for rows `index` (their KV cache `kv_cache`); not for `project_out`."""
        zero = self.modulation[self.joint.shape[0]:]
        if self.zero_rows > 1:  # NOTE: one t=0 row per row
            zero = zero[index]
        return dataclasses.replace(
            self, joint=self.joint[index], temb=None, modulation=torch.cat([self.modulation[index], zero]),
            attention_mask=_pick(self.attention_mask, index), key_valid=_pick(self.key_valid, index),
            kv_cache=kv_cache, zero_rows=len(zero))


def joint_tokens(arguments: dict) -> int:
    """Tokens per row of the call's sequence as `joint_call` lays it out: only the target image's where the call
    reads its KV cache."""
    if arguments.get("kv_cache_mode") == "cached":
        return math.prod(arguments["img_shapes"][0][-1])
    return int(torch.where(arguments["img_mask"][0], SLOT_TOKENS, 1).sum())


def _pick(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[index]


def project_out(model, hidden: torch.Tensor, call: JointCall) -> torch.Tensor:
    """`norm_out` and `proj_out` of the blocks' output [rows, tokens, dim], as the model runs them."""
    norm = model.norm_out
    scale = norm.linear(norm.silu(call.temb).to(hidden.dtype))
    return model.proj_out(norm.norm(hidden) * (1 + call.per_token(scale)))


def joint_call(model, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
               encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None, kv_cache_mode=None,
               own_zero_rows: bool = False) -> JointCall:
    """`own_zero_rows`: each row gets its own t=0 row (`temb` and `modulation` then hold 2 x rows rows: the rows'
    timesteps, then their t=0 rows), as per-row LoRA needs; the model's forward has one for the whole call."""
    rows = hidden_states.shape[0]
    hidden_states = model.img_in(hidden_states)
    encoder_hidden_states = model.txt_in(encoder_hidden_states)
    repeats = torch.where(img_mask, SLOT_TOKENS, 1)[0]
    image_pad_mask = torch.repeat_interleave(img_mask[0], repeats)
    target_tokens = math.prod(img_shapes[0][-1])
    joint = torch.cat([encoder_hidden_states, encoder_hidden_states.new_zeros(
        rows, target_tokens // SLOT_TOKENS, encoder_hidden_states.shape[2])], dim=1)
    joint = joint.repeat_interleave(repeats, dim=1)
    joint[:, image_pad_mask] = hidden_states
    rotary_emb = model.pos_embed(img_shapes[0], image_pad_mask, device=hidden_states.device)
    image_ids, target = model.build_token_metadata(image_pad_mask, img_shapes[0])

    timestep = timestep.to(hidden_states.dtype)
    modulation_mask, zero_rows = None, 0
    if model.config.causal_condition:
        zero_rows = rows if own_zero_rows else 1
        timestep = torch.cat([timestep, timestep.new_zeros(zero_rows)], dim=0)
        modulation_mask = target
    temb = model.time_text_embed(timestep, hidden_states)
    modulation = model.modulation(temb)

    key_valid = None
    if encoder_hidden_states_mask is not None:
        key_valid = torch.ones(rows, image_pad_mask.shape[0], dtype=torch.bool, device=hidden_states.device)
        text_positions = (~image_pad_mask).nonzero(as_tuple=True)[0]
        vlm_text_positions = ~img_mask[0][: encoder_hidden_states_mask.shape[1]]
        key_valid[:, text_positions] = encoder_hidden_states_mask.bool()[:, vlm_text_positions]
    prefix_len = int((~target).sum())

    if kv_cache_mode == "cached":
        return JointCall(joint[:, prefix_len:], rotary_emb[prefix_len:], temb, modulation,
                         modulation_mask[prefix_len:], target[prefix_len:],
                         None if key_valid is None else key_valid[:, None, None, :], None, None, None, kv_cache,
                         kv_cache_mode, zero_rows)
    return JointCall(joint, rotary_emb, temb, modulation, modulation_mask, target, None,
                     _qwenimage21_prefix_segments(image_ids, prefix_len), key_valid,
                     slice(0, prefix_len) if kv_cache_mode == "extract" else None, kv_cache, kv_cache_mode, zero_rows)
