"""Wan's TeaCache forward: `WanTransformer3DModel.forward` with one skip decision per request branch.

As in TeaCache4Wan2.1 (github.com/ali-vilab/TeaCache), the signal is the timestep projection that modulates the
blocks (one per video, or per token with `expand_timesteps`); a skipping row adds its last computed residual. The
polynomials (highest power first) are the authors' fits: `WAN_COEFFICIENTS` (Wan 2.1 T2V 1.3B) is the default, the
others are for `TeaCacheConfig(coefficients=...)`. Calls run through the packed forward (`packing.py`), so a
request's decisions are the same alone, merged or packed with other sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ...cache.teacache import TeaCacheState, packed_decisions, settle_packed_decisions
from .packing import PackedInputs, WanPart, pack_key, packed_blocks, wan_packed_forward, wan_packing_unsupported

WAN_MODEL_COEFFICIENTS = {
    "Wan2.1-T2V-1.3B": (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
    "Wan2.1-T2V-14B": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
    "Wan2.1-I2V-14B-480P": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
    "Wan2.1-I2V-14B-720P": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
}
WAN_COEFFICIENTS = WAN_MODEL_COEFFICIENTS["Wan2.1-T2V-1.3B"]


def teacache_call(transformer, states: Sequence[TeaCacheState | None], arguments: dict) -> Any:
    """A `WanTransformer3DModel` call (its arguments by name) with per-row TeaCache decisions, as the model
    returns it; None when the packed forward can't stand in for the model's (then the call runs as is)."""
    if pack_key(arguments) is None or wan_packing_unsupported(transformer) is not None:
        return None
    part = WanPart(arguments["hidden_states"], arguments["timestep"], arguments["encoder_hidden_states"],
                   arguments.get("encoder_hidden_states_image"))
    (output,) = wan_packed_forward(transformer, [part], arguments.get("attention_kwargs"), teacache=[states])
    return (output,) if not arguments.get("return_dict", True) else Transformer2DModelOutput(sample=output)


def teacache_blocks(transformer, inputs: PackedInputs, hidden: torch.Tensor,
                    states: Sequence[TeaCacheState | None]) -> torch.Tensor:
    """`packed_blocks` with per-state decisions (`states` per packed row): rows that skip add their residual."""
    video = inputs.video
    def group(state, start, end):
        part, inner = video.part_of_row(start)
        tokens = video.row_tokens(0, part, inner, inner + end - start)
        return range(start, end), tokens, inputs.proj[tokens] if inputs.per_token else inputs.proj[start:end]

    decisions, compute_rows = packed_decisions(states, group)

    computed = None
    if len(compute_rows) == video.num_rows:
        computed = (None, hidden, packed_blocks(transformer, inputs, hidden))
    elif compute_rows:
        sub_inputs, index = inputs.select(compute_rows)
        sub_hidden = hidden.index_select(0, index)
        computed = (index, sub_hidden, packed_blocks(transformer, sub_inputs, sub_hidden))
    return settle_packed_decisions(decisions, hidden, computed)
