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

from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ...cache.teacache import TeaCacheState
from .packing import WanPart, pack_key, wan_packed_forward, wan_packing_unsupported

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
