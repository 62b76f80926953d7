"""optimum-quanto recipe: quantize a pipeline's transformer weights before serving it with StepBatched.

Quantized weights keep their shapes and rows stay independent, so a quantized transformer batches like the
original and a request's batched output equals its solo quantized output (tested). The gain is memory:
qint8 halves bf16 weights. On CPU it is slower than fp32 (measured in benchmarks/quanto.py); on accelerators
with int8/fp8 kernels it is about even or faster.

>>> from diffusers_stepbatch.quantize import quantize_transformer
>>> quantize_transformer(pipe, weights="qint8")          # in place, then
>>> sb = StepBatched(pipe)                                # or in one line: StepBatched(pipe, quantize="qint8")

Notes: qint4 weights fail under `torch.inference_mode()` ("Cannot set version_counter for inference tensor")
but run under `torch.no_grad()`, which is what the engine thread uses.
"""

from __future__ import annotations

from typing import Any

WEIGHT_TYPES = ("qint8", "qint4", "qfloat8")


def quantize_transformer(pipe: Any, weights: str = "qint8", exclude: str | list[str] | None = None) -> Any:
    """Quantize `pipe.transformer`'s weights in place with optimum-quanto (quantize + freeze); returns `pipe`.

    Args:
        pipe: a diffusers pipeline with a `transformer` (a UNet pipeline: quantize `pipe.unet` yourself).
        weights: "qint8", "qint4" or "qfloat8".
        exclude: module name patterns left in full precision (quanto's `exclude`), e.g. "proj_out".
    """
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"quantize={weights!r} is not supported; use one of {list(WEIGHT_TYPES)}")
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError(f"{type(pipe).__name__} has no transformer to quantize; quantize its denoiser yourself")
    from optimum import quanto

    quanto.quantize(transformer, weights=getattr(quanto, weights), exclude=exclude)
    quanto.freeze(transformer)
    return pipe
