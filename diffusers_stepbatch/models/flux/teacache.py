"""FLUX.1's TeaCache forward: `FluxTransformer2DModel.forward` with one skip decision per request branch.

The rescale polynomial maps the signal's relative L1 change to the model output's, highest power first
(numpy.poly1d order); fitted on FLUX.1-dev by the TeaCache authors (TeaCache4FLUX in
github.com/ali-vilab/TeaCache); FLUX.1-schnell shares the architecture.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ...cache.teacache import TeaCacheState
from ...cache.teacache_fit import change_pairs, fit_coefficients, sampled_change_pairs  # noqa: F401  (the old path)
from ...cache.teacache_rows import dense_rows
from .packing import REPRODUCED_ARGUMENTS, text_image_rotary

FLUX_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `FluxTransformer2DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the call has arguments this forward doesn't reproduce (ControlNet residuals, ...)."""
    # NOTE: attention kwargs reach the blocks' attention processors as in the model's forward, all but IP-Adapter
    # image embeddings, which the model's own forward turns into tokens first
    if any(value is not None for name, value in arguments.items() if name not in REPRODUCED_ARGUMENTS) or \
            "ip_adapter_image_embeds" in (arguments.get("joint_attention_kwargs") or {}):
        return None
    ids = {name: arguments[name][0] if arguments[name].ndim == 3 else arguments[name]
           for name in ("txt_ids", "img_ids")}
    output = flux_teacache_forward(
        transformer, states, arguments["hidden_states"], arguments["encoder_hidden_states"],
        arguments["pooled_projections"], arguments["timestep"], ids["img_ids"], ids["txt_ids"],
        arguments.get("guidance"), arguments.get("joint_attention_kwargs"))
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def flux_teacache_forward(
    transformer: Any,
    states: Sequence[TeaCacheState | None],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor,
    timestep: torch.Tensor,
    img_ids: torch.Tensor,
    txt_ids: torch.Tensor,
    guidance: torch.Tensor | None = None,
    joint_attention_kwargs: dict | None = None,
) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` (return_dict=False, [0]) with per-row TeaCache decisions.

    `states[r]` is row r's state (rows of one request branch share one object) or None (always compute).
    Rows whose state decides to compute run the blocks as one sub-batch; the others add their residual.
    The state changes only after the forward succeeded, so a failed batch retried row by row stays correct.
    """
    return _forward(
        transformer, states, hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
        pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
        guidance=guidance, joint_attention_kwargs=joint_attention_kwargs,
    )


@apply_lora_scale("joint_attention_kwargs")
def _forward(transformer, states, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
             txt_ids, guidance, joint_attention_kwargs):
    # NOTE: the embeddings mirror FluxTransformer2DModel.forward op for op, so with every row computing the
    # output is bit-identical to the model's own forward (tested).
    hidden = transformer.x_embedder(hidden_states)
    timestep = timestep.to(hidden.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden.dtype) * 1000
        temb = transformer.time_text_embed(timestep, guidance, pooled_projections)
    else:
        temb = transformer.time_text_embed(timestep, pooled_projections)
    encoder = transformer.context_embedder(encoder_hidden_states)
    rotary = text_image_rotary(transformer, txt_ids, img_ids)
    signal = transformer.transformer_blocks[0].norm1(hidden, emb=temb)[0]

    out, commit = dense_rows(transformer, states, hidden, signal, functools.partial(
        _blocks, transformer, encoder=encoder, temb=temb, rotary=rotary, joint_attention_kwargs=joint_attention_kwargs))
    output = transformer.proj_out(transformer.norm_out(out, temb))
    commit()
    return output


def _blocks(transformer, hidden, rows, encoder, temb, rotary, joint_attention_kwargs):
    if rows is not None:
        encoder, temb = encoder[rows], temb[rows]
    for block in transformer.transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    for block in transformer.single_transformer_blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
    return hidden
