"""optimum-quanto recipe: quantize a pipeline's transformer weights before serving it with StepBatched.

Rows stay independent, so a quantized transformer batches like the original; the gain is memory. qint4 fails
under `torch.inference_mode()` but runs under `no_grad`, which the engine thread uses.

>>> quantize_transformer(pipe, weights="qint8")          # in place; or StepBatched(pipe, quantize="qint8")
"""

from __future__ import annotations

from typing import Any

WEIGHT_TYPES = ("qint8", "qint4", "qfloat8")


def quantize_transformer(pipe: Any, weights: str = "qint8", exclude: str | list[str] | None = None) -> Any:
    """Quantize `pipe.transformer`'s weights in place with optimum-quanto (quantize + freeze); returns `pipe`.
    `weights`: "qint8", "qint4" or "qfloat8"; `exclude`: module name patterns left in full precision."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"quantize={weights!r} is not supported; use one of {list(WEIGHT_TYPES)}")
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError(f"{type(pipe).__name__} has no transformer to quantize; quantize its denoiser yourself")
    from optimum import quanto

    quanto.quantize(transformer, weights=getattr(quanto, weights), exclude=exclude)
    quanto.freeze(transformer)
    return pipe
