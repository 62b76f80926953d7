"""Stable Diffusion 3 (`SD3Transformer2DModel`: SD3 / SD3.5, img2img, inpaint, ControlNet).

Rows: latents, text, pooled text and timestep are per row; `packing.py` packs rows of other sizes into one call,
for the dedicated program only (its calls carry skip sets and adapters it keys itself; the generic program's calls
of this model run per size).
"""

from __future__ import annotations

from diffusers import SD3Transformer2DModel

from .. import ModelSupport, Packing, register_model
from .packing import pack_calls, sd3_packing_unsupported, token_rows


@register_model(SD3Transformer2DModel)
def _sd3() -> ModelSupport:
    return ModelSupport(trusted=True, lora_rows=True,
                        packing=Packing(unsupported=sd3_packing_unsupported, key=None, run=pack_calls,
                                        token_rows=token_rows))
