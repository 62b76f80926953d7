"""Qwen-Image's TeaCache forward: `QwenImageTransformer2DModel.forward` with one skip decision per request branch.

The signal is the first block's modulated image input (`img_mod` of the time embedding on `img_norm1`), an edit
row's reference tokens included; a skipping row adds its residual of all blocks (the row loop is the shared
`dense_rows`; packed calls decide in `packing.py`). Calls the packed forward can't stand in for (`zero_cond_t`,
ControlNet residuals, other attention processors, ...) run as the model does, without TeaCache.

The polynomial is vLLM-Omni's for Qwen-Image on this signal (github.com/vllm-project/vllm-omni,
vllm_omni/diffusion/cache/teacache/config.py), hand-tuned; `fit_coefficients(..., signal=signal_hook)` fits one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask
from diffusers.utils import apply_lora_scale

from ...cache.teacache import TeaCacheState
from ...cache.teacache_rows import dense_rows
from ..packing.support import reproduces_call
from .packing import REPRODUCED_ARGUMENTS, qwenimage_packing_unsupported

QWENIMAGE_COEFFICIENTS = (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """The call with a TeaCache state (or None) per row, as the model returns it; None for calls it can't reproduce."""
    if not reproduces_call(arguments, REPRODUCED_ARGUMENTS, "attention_kwargs") or \
            qwenimage_packing_unsupported(transformer) is not None or not len(transformer.transformer_blocks) or \
            arguments.get("img_shapes") is None or arguments.get("encoder_hidden_states") is None:
        return None
    names = REPRODUCED_ARGUMENTS - {"return_dict"}
    output = _forward(transformer, states, **{name: arguments.get(name) for name in names})
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def qwenimage_signal(block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The TeaCache signal: `block`'s modulated image input, [rows, tokens, dim], as the block computes it."""
    return block._modulate(block.img_norm1(hidden), block.img_mod(temb).chunk(2, dim=-1)[0])[0]


def signal_hook(transformer, record: Callable[[torch.Tensor], None]):
    """`fit_coefficients`' `signal=` for Qwen-Image: records `qwenimage_signal` at the first block."""
    def hook(block, args, kwargs):
        record(qwenimage_signal(block, kwargs["hidden_states"], kwargs["temb"]))

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


@apply_lora_scale("attention_kwargs")
def _forward(transformer, states, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
             img_shapes, attention_kwargs):
    # NOTE: the embeddings as QwenImageTransformer2DModel.forward makes them, op for op (tested)
    hidden = transformer.img_in(hidden_states)
    timestep = timestep.to(hidden.dtype)
    encoder = transformer.txt_in(transformer.txt_norm(encoder_hidden_states))
    text_length, _, mask = compute_text_seq_len_from_mask(encoder, encoder_hidden_states_mask)
    temb = transformer.time_text_embed(timestep, hidden)
    rotary = transformer.pos_embed(img_shapes, max_txt_seq_len=text_length, device=hidden.device)
    signal = qwenimage_signal(transformer.transformer_blocks[0], hidden, temb)

    out, commit = dense_rows(transformer, states, hidden, signal, functools.partial(
        _blocks, transformer, encoder=encoder, mask=mask, temb=temb, rotary=rotary, attention_kwargs=attention_kwargs))
    output = transformer.proj_out(transformer.norm_out(out, temb))
    commit()
    return output


def _blocks(transformer, hidden, rows, encoder, mask, temb, rotary, attention_kwargs):
    if rows is not None:
        encoder, temb = encoder[rows], temb[rows]
        mask = None if mask is None else mask[rows]
    for block in transformer.transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, encoder_hidden_states_mask=mask,
                                temb=temb, image_rotary_emb=rotary, joint_attention_kwargs=attention_kwargs)
    return hidden
