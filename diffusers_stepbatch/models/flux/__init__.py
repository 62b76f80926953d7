"""FLUX.1 (`FluxTransformer2DModel`: FLUX.1 dev / schnell, img2img, inpaint, Fill, Kontext, Control, Chroma-like).

Rows: latents, text, pooled text, timestep and guidance are per row. The position ids are read as one grid
for the whole call (2-D; a 3-D tensor is read from its first row), so rows of one plain forward share image
grid and text length; `packing.py` packs rows of other sizes into one call (each row's own positions and
modulation, attention inside each row); `teacache.py` is the per-row TeaCache forward.
"""

from __future__ import annotations

from diffusers import FluxTransformer2DModel

from .. import ModelSupport, Packing, register_model
from .packing import flux_packing_unsupported, pack_calls, pack_key, token_rows
from .teacache import FLUX_COEFFICIENTS, teacache_call


@register_model(FluxTransformer2DModel)
def _flux() -> ModelSupport:
    return ModelSupport(shared=("img_ids", "txt_ids"), trusted=True, teacache_coefficients=FLUX_COEFFICIENTS,
                        packing=Packing(unsupported=flux_packing_unsupported, key=pack_key, run=pack_calls,
                                        token_rows=token_rows),
                        teacache_forward=teacache_call, lora_rows=True)
