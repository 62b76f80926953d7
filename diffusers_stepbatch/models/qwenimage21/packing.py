"""Qwen-Image 2.1 calls of other layouts (sizes, prompt token counts, condition images) as one packed call.

Each call keeps its own joint sequence, positions and modulation rows; the blocks run once over every call's
tokens, attention per call (`blocks.py`). Calls that fill their KV cache, read it or have none pack together.
Under per-row LoRA every call runs here (`lora_forward`), each row with its own t=0 modulation row (`lora.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from diffusers.utils import apply_lora_scale

from ...adapters.lora import LoraLayout, lora_active, lora_layout, lora_uniform
from ..packing.support import unsupported_reason
from .blocks import run_blocks
from .joint import REPRODUCED, joint_call, joint_tokens, project_out, reproduced
from .lora import call_rows, embedding_layout, token_layout
from .teacache import teacache_call


def qwenimage21_packing_unsupported(transformer) -> str | None:
    """Why the packed forward can't stand in for this transformer's forward, or None when it can."""
    return unsupported_reason(transformer, QwenImage21AttnProcessor)


def pack_key(arguments: dict) -> tuple | None:
    """(what must match for calls to pack, tokens per row), or None."""
    if not reproduced(arguments):
        return None
    hidden, mask, timestep = arguments["hidden_states"], arguments.get("img_mask"), arguments.get("timestep")
    if not (isinstance(mask, torch.Tensor) and isinstance(timestep, torch.Tensor) and timestep.ndim == 1
            and timestep.shape[0] == hidden.shape[0]):
        return None
    scale = (arguments.get("attention_kwargs") or {}).get("scale")
    return (scale, hidden.dtype, str(hidden.device), arguments.get("return_dict", True)), joint_tokens(arguments)


def lora_forward(transformer, arguments: dict) -> Any:
    """`ModelSupport.lora_forward`: a call under per-row LoRA, through the packed forward (where it can't stand in,
    the model's forward for one request's rows); None without `causal_condition` (the model's forward then has its
    rows on dim 0 throughout)."""
    if not transformer.config.causal_condition:
        return None
    reason = qwenimage21_packing_unsupported(transformer)
    if reason is None and pack_key(arguments) is None:
        reason = "the call has arguments the packed forward doesn't reproduce"
    if reason is None:
        return pack_calls(transformer, [arguments], "", [None])[0]
    if not lora_uniform(transformer):  # NOTE: the merged call then runs each request's rows alone
        raise ValueError(f"rows with other adapters can't share a {type(transformer).__name__} call: {reason}")
    rows = torch.arange(arguments["hidden_states"].shape[0])
    with lora_layout(transformer, LoraLayout(rows, [torch.cat([rows, rows[:1]])])):  # its t=0 row: their adapters
        return transformer(**arguments)


def pack_calls(transformer, calls: Sequence[dict], packed_attention: str, teacache: Sequence) -> list:
    """One packed forward for calls of several layouts; each call's output as the model would return it."""
    if any(state is not None for states in teacache for state in states or ()):
        # NOTE: TeaCache decides per call here: each call runs its own TeaCache forward
        outputs = [teacache_call(transformer, states or [None] * call["hidden_states"].shape[0], call)
                   for call, states in zip(calls, teacache)]
        return [output if output is not None else transformer(**call) for output, call in zip(outputs, calls)]
    arguments = [{name: call.get(name) for name in REPRODUCED - {"return_dict"}} for call in calls]
    outputs = _forward(transformer, arguments, attention_kwargs=calls[0].get("attention_kwargs"))
    return [(out,) if not call.get("return_dict", True) else Transformer2DModelOutput(sample=out)
            for call, out in zip(calls, outputs)]


@apply_lora_scale("attention_kwargs")
def _forward(model, arguments: Sequence[dict], attention_kwargs=None) -> list[torch.Tensor]:
    rows, own_zero_rows = call_rows(arguments), lora_active(model)
    joints = []
    for call, ids in zip(arguments, rows):
        with lora_layout(model, embedding_layout(model, ids)):
            joints.append(joint_call(model, **call, own_zero_rows=own_zero_rows))
    with lora_layout(model, token_layout(model, joints, rows)):
        hidden = run_blocks(model, joints)
    outputs = []
    for part, call, ids in zip(hidden, joints, rows):
        with lora_layout(model, embedding_layout(model, ids)):
            outputs.append(project_out(model, part, call))
    return outputs
