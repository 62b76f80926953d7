"""FLUX.2 (`Flux2Transformer2DModel`: FLUX.2 dev, klein, klein KV, their edit modes).

Rows: latents (an edit row's reference-image tokens appended), text, timestep and guidance are per row. The
forward reads its RoPE positions from the first row only (`img_ids[0]`, `txt_ids[0]`), so a plain forward merges
only calls with equal positions (same image grid, same reference images, same text length); `packing.py` packs
rows of other sizes, aspect ratios, reference images and text lengths into one call, each with its own positions.
The klein KV variant extracts a reference-image KV cache in its first call and reads it in every later call of
the same request, so those calls run alone.
"""

from __future__ import annotations

from typing import Any

from diffusers import Flux2Transformer2DModel

from .. import ModelSupport, Packing, register_model
from .packing import flux2_packing_unsupported, pack_calls, pack_key, token_rows


def _kv_cache_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("kv_cache_mode") is not None or arguments.get("kv_cache") is not None:
        return "FLUX.2 klein KV: the reference-image KV cache belongs to one request's calls"
    return None


@register_model(Flux2Transformer2DModel)
def _flux2() -> ModelSupport:
    # NOTE: lora_rows: every LoRA layer of the plain forward sees rows on dim 0 ([rows, tokens, dim] or the
    # [rows, dim] timestep embedding), and the packed forward's see a stream's [tokens, dim] or [rows, dim].
    return ModelSupport(shared=("img_ids", "txt_ids"), refusal=_kv_cache_refusal, trusted=True, lora_rows=True,
                        packing=Packing(unsupported=flux2_packing_unsupported, key=pack_key, run=pack_calls,
                                        token_rows=token_rows))
