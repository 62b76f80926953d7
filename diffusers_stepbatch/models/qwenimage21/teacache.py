"""Qwen-Image 2.1's TeaCache forward: the model's forward with one skip decision per request branch.

The signal is the first block's modulated input of the target image's tokens, the same whether the call fills the
KV cache, reads it or has none; a skipping row adds its cached residual. A cache-filling call always computes.

The polynomial was fitted with `fit_coefficients` (signal `signal_hook`) on the tiny test model
(`tiny_qwenimage21_pipeline()`, prompts "a red circle", "a blue square", "a green cross", 64x64, 16 steps, degree
2): no Qwen-Image 2.1 weights were at hand, so fit the real model's the same way before relying on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from diffusers.utils import apply_lora_scale

from ...adapters.lora import lora_active, lora_layout
from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import commit_rows, computing_rows, decide_rows
from .blocks import run_blocks
from .joint import REPRODUCED, joint_call, project_out, reproduced
from .kv_cache import cache_rows
from .lora import embedding_layout, token_layout

QWENIMAGE21_COEFFICIENTS = (2.30581477e01, -1.18756920e00, 6.04744574e-02)



def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `QwenImage21Transformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments or attention processors this forward doesn't reproduce."""
    if not reproduced(arguments) or not all(
            type(block.attn.processor) is QwenImage21AttnProcessor for block in transformer.transformer_blocks):
        return None
    names = REPRODUCED - {"return_dict"}
    output = _forward(transformer, states, **{name: arguments.get(name) for name in names})
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def block_signal(block, hidden_states: torch.Tensor, modulation: torch.Tensor,
                 target_token_mask: torch.Tensor | None) -> torch.Tensor:
    """The block's modulated attention input, [rows, tokens, dim]."""
    return block._modulate(block.img_norm1(hidden_states), modulation.chunk(2, dim=-1)[0], target_token_mask)[0]


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for Qwen-Image 2.1: records the first block's `block_signal` of the target
    image's tokens (with `causal_condition`, the tokens its modulation mask marks; else of every token)."""
    def hook(block, args, kwargs):
        mask = kwargs.get("target_token_mask")
        signal = block_signal(block, kwargs["hidden_states"], kwargs["modulation"], mask)
        record(signal if mask is None else signal[:, mask])

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


@apply_lora_scale("attention_kwargs")
def _forward(model, states, **arguments):
    # NOTE: the steps before and after the blocks mirror QwenImage21Transformer2DModel.forward (with its
    # per-segment attention processors) call for call, and the blocks run as the packed forward's, so with every
    # row computing the output is the model's own; under per-row LoRA each row has its own t=0 row (`lora.py`)
    rows = torch.arange(arguments["hidden_states"].shape[0])
    with lora_layout(model, embedding_layout(model, rows)):
        call = joint_call(model, **arguments, own_zero_rows=lora_active(model))
    joint, target = call.joint, call.target
    signal = (model.transformer_blocks[0].img_norm1(joint) * (1 + call.token_modulation()[0]))[:, target]
    decisions = decide_rows(states, lambda group: signal[group.start:group.stop],
                            compute_all=call.kv_cache_mode == "extract")  # NOTE: later steps read what it fills
    computing = computing_rows(decisions)

    out, residual = joint, None
    if computing:
        index = torch.tensor(computing, device=joint.device)
        part = call if len(computing) == len(rows) else call.rows(index, cache_rows(call.kv_cache, computing,
                                                                                      len(rows)))
        with lora_layout(model, token_layout(model, [part], [rows[computing]])):
            computed = run_blocks(model, [part])[0]
        if part is call:
            out, residual = computed, (computed - joint)[:, target]
        else:
            out, residual = joint.clone(), joint.new_zeros(len(rows), int(target.sum()), joint.shape[2])
            out[index], residual[index] = computed, (computed - joint[index])[:, target]
    if len(computing) < len(rows):
        out = out.clone() if out is joint else out
        for decision in decisions:
            if not decision.compute:  # NOTE: its text and condition tokens' outputs are not read (the pipeline slices)
                group = slice(decision.rows.start, decision.rows.stop)
                out[group, target] = joint[group, target] + decision.state.residual

    with lora_layout(model, embedding_layout(model, rows)):
        output = project_out(model, out, call)
    commit_rows(decisions, lambda decision: residual[decision.rows.start:decision.rows.stop])
    return output
