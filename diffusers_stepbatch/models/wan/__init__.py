"""Wan 2.1 / 2.2 (`WanTransformer3DModel`: text-, image- and first-last-frame-to-video, both experts of 2.2).

Rows: latents, text, timestep (per video, or per token with Wan 2.2 TI2V's `expand_timesteps`) are per row.
Image conditioning (`encoder_hidden_states_image`) holds one CLIP embedding per video for image-to-video and two
(first and last frame) for first-last-frame-to-video, which the model folds in pairs: rows are blocks.
`packing.py` packs videos of other frame counts and sizes into one call (each row's own patch embedding, RoPE
grid and modulation; attention inside each row; cross-attention to each row's own text and image tokens);
`teacache.py` is the per-row TeaCache forward on top of it. Per-request LoRA applies per row: LoRA layers see
rows on dim 0, packed tokens (`token_rows`), or in a packed forward's per-shape steps that shape's rows.
"""

from __future__ import annotations

from diffusers import WanTransformer3DModel

from .. import ModelSupport, Packing, register_model
from .packing import pack_calls, pack_key, token_rows, wan_packing_unsupported
from .teacache import WAN_COEFFICIENTS, teacache_call


@register_model(WanTransformer3DModel)
def _wan() -> ModelSupport:
    return ModelSupport(row_blocks=("encoder_hidden_states_image",), trusted=True,
                        packing=Packing(unsupported=wan_packing_unsupported, key=pack_key, run=pack_calls,
                                        token_rows=token_rows),
                        teacache_coefficients=WAN_COEFFICIENTS, teacache_forward=teacache_call, lora_rows=True)
