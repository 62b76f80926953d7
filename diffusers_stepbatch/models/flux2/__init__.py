"""FLUX.2 (`Flux2Transformer2DModel`: FLUX.2 dev, klein, klein KV, their edit modes).

Rows: latents (an edit row's reference-image tokens appended), text, timestep and guidance are per row. The
forward reads its RoPE positions from the first row only, so a plain forward merges only calls with equal positions
(image grid, reference images, text length); `packing.py` packs rows of other sizes, reference images and text
lengths into one call, each with its own positions; `teacache.py` is the per-row TeaCache forward. The klein KV
variant's reference-image KV cache (`kv_cache.py`) is a row state: each request gets its rows of a returned
cache, cached calls read their rows' caches stacked; `kv_packing.py` packs such calls of other sizes.
"""

from __future__ import annotations

from diffusers import Flux2Transformer2DModel

from .. import ModelSupport, Packing, register_model
from .kv_cache import KV_CACHE
from .packing import flux2_packing_unsupported, pack_calls, pack_key, token_rows
from .teacache import FLUX2_COEFFICIENTS, teacache_call


@register_model(Flux2Transformer2DModel)
def _flux2() -> ModelSupport:
    # NOTE: lora_rows: every LoRA layer of the plain forward sees rows on dim 0 ([rows, tokens, dim] or the
    # [rows, dim] timestep embedding), and the packed forward's see a stream's [tokens, dim] or [rows, dim].
    return ModelSupport(shared=("img_ids", "txt_ids"), row_states={"kv_cache": KV_CACHE}, trusted=True, lora_rows=True,
                        packing=Packing(unsupported=flux2_packing_unsupported, key=pack_key, run=pack_calls,
                                        token_rows=token_rows),
                        teacache_coefficients=FLUX2_COEFFICIENTS, teacache_forward=teacache_call)
