"""The model layer: what StepBatched knows about each denoiser class, registered by class.

Batching is a property of the denoiser, not of the pipeline: dozens of pipelines share a few transformer
classes. A `ModelSupport` says how one class's call arguments split into rows, which inputs must be equal for
calls to share a forward, and when a call can't be shared at all. The step programs (dedicated and generic)
ask `support_for(model)`; a class without a module gets `DEFAULT_SUPPORT`, whose first merge of every call
signature is checked against separate calls (`models/calls.py`), so an unknown model never returns a silently
wrong output.

>>> @register_model(ZImageTransformer2DModel)
... def _z_image() -> ModelSupport:
...     return ModelSupport(row_lists=("x", "cap_feats"), output_lists_are_rows=True, trusted=True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# refusal(model, arguments) -> why this call can't share a forward, or None
Refusal = Callable[[torch.nn.Module, dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class ModelSupport:
    """How calls of one denoiser class share a forward.

    Args:
        row_lists: arguments that are lists with one entry per row (Z-Image's per-image latents and captions).
        shared: tensors the model reads as a whole or from their first row only (FLUX.2's position ids): calls
            share a forward only when these are equal, whatever their shape says.
        output_lists_are_rows: list outputs hold one entry per row (else a list is a tuple of outputs).
        refusal: a per-call reason that the call must run alone (e.g. a KV cache carried between calls).
        trusted: the class's row rules are proven by equivalence tests; otherwise the first merged call of each
            call signature is checked against the same calls run apart.
        teacache_coefficients: the TeaCache rescale polynomial for this model (highest power first), if known.
    """

    row_lists: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    output_lists_are_rows: bool = False
    refusal: Refusal | None = None
    trusted: bool = False
    teacache_coefficients: tuple[float, ...] | None = None


DEFAULT_SUPPORT = ModelSupport()
_SUPPORT: dict[type, ModelSupport] = {}


def register_model(model_class: type) -> Callable[[Callable[[], ModelSupport]], Callable[[], ModelSupport]]:
    """Register the `ModelSupport` a factory returns as what StepBatched knows about `model_class`."""

    def decorate(factory: Callable[[], ModelSupport]) -> Callable[[], ModelSupport]:
        _SUPPORT[model_class] = factory()
        return factory

    return decorate


def support_for(model: torch.nn.Module) -> ModelSupport:
    """The support registered for the model's class or its nearest registered base class."""
    _load_modules()
    for cls in type(model).__mro__:
        support = _SUPPORT.get(cls)
        if support is not None:
            return support
    return DEFAULT_SUPPORT


def registered_models() -> list[type]:
    _load_modules()
    return list(_SUPPORT)


_loaded = False


def _load_modules() -> None:
    """Import the per-class modules once (lazily: each imports its diffusers model class)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import flux, flux2, qwenimage, sd3, unet, z_image  # noqa: F401  (each registers its classes)
