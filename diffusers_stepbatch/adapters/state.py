"""A request's LoRA state, read and validated at submit; it travels with the request's rows.

A request names its adapters with `adapters=` ({name: weight}, as `set_adapters` takes them; a name or a list of
names means weight 1). Without it, the adapters and weights active on the pipeline's denoiser when it was
submitted are read and kept, so a later `pipe.set_adapters(...)` affects later requests only. The LoRA `scale`
of `joint_attention_kwargs` / `cross_attention_kwargs` multiplies the weights, per request.

>>> state = request_adapters(pipe.transformer, {"pixel": 1.0, "ink": 0.3}, lora_scale=0.8)
>>> state.row
{'ink': 0.24, 'pixel': 0.8}
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .lora import lora_layers, per_row_lora, unit_scale

NOT_GIVEN = object()  # a call without `adapters=`: the pipeline's active adapters at submit


@dataclass(frozen=True)
class AdapterState:
    """One request's denoiser LoRA: sorted (adapter, weight x LoRA scale) pairs; empty is the base model."""

    weights: tuple[tuple[str, float], ...] = ()

    @property
    def row(self) -> dict[str, float]:
        return dict(self.weights)


def request_adapters(model: torch.nn.Module, adapters: Any = NOT_GIVEN, lora_scale: Any = None) -> AdapterState | None:
    """The request's `AdapterState` for denoiser `model`; None when the model has no LoRA layers (no adapters=).

    `adapters` is the call's `adapters=` argument (`PlanContext.adapters`). Raises ValueError for unknown
    names, negative or non-finite weights and a non-finite `lora_scale`.
    """
    scale = 1.0 if lora_scale is None else _check_scale(lora_scale)
    if adapters is NOT_GIVEN:
        if not lora_layers(model):
            return None
        weights = active_adapters(model)
    else:
        weights = check_adapters(model, adapters)
    return AdapterState(tuple(sorted((name, weight * scale) for name, weight in weights.items() if weight != 0)))


def active_adapters(model: torch.nn.Module) -> dict[str, float]:
    """{adapter: weight} active on `model` now, read back from its peft layers' scalings (disabled: {})."""
    weights: dict[str, float] = {}
    for layer in lora_layers(model):
        if layer.disable_adapters:
            continue
        for name in layer.active_adapters:
            if name not in layer.scaling:
                continue
            weight = layer.scaling[name] / unit_scale(layer, name)
            first = weights.setdefault(name, weight)
            if not math.isclose(first, weight, rel_tol=1e-6, abs_tol=1e-12):
                raise ValueError(
                    f"adapter {name!r} has different weights in different layers ({first:g} and {weight:g}: "
                    "per-block set_adapters weights); per-request LoRA takes one weight per adapter: pass "
                    f"adapters={{{name!r}: weight}}"
                )
    _check_supported(model, weights)
    return weights


def check_adapters(model: torch.nn.Module, adapters: Any) -> dict[str, float]:
    """Validate an `adapters=` argument: {name: weight}, a name, or a list of names (weight 1)."""
    if isinstance(adapters, str):
        adapters = {adapters: 1.0}
    elif isinstance(adapters, (list, tuple)) and all(isinstance(name, str) for name in adapters):
        adapters = dict.fromkeys(adapters, 1.0)
    if not isinstance(adapters, Mapping):
        raise TypeError(f"adapters={adapters!r} must be a dict of adapter name -> weight, e.g. {{'pixel': 1.0}}")
    loaded = sorted(getattr(model, "peft_config", None) or ())
    weights = {}
    for name, weight in adapters.items():
        if name not in loaded:
            raise ValueError(f"adapters: unknown adapter {name!r}; loaded: {loaded} (load one with "
                             f"pipe.load_lora_weights(..., adapter_name={name!r}))")
        if isinstance(weight, Mapping):
            raise ValueError(f"adapters[{name!r}]={weight!r}: per-block weights are not supported per request; "
                             "pass one number")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"adapters[{name!r}]={weight!r} must be a finite number >= 0")
        weights[name] = float(weight)
    _check_supported(model, weights)
    return weights


def _check_scale(lora_scale: Any) -> float:
    if isinstance(lora_scale, bool) or not isinstance(lora_scale, numbers.Real) or not math.isfinite(lora_scale):
        raise ValueError(f"the LoRA scale {lora_scale!r} (attention kwargs 'scale') must be a finite number")
    return float(lora_scale)


def _check_supported(model: torch.nn.Module, weights: Mapping[str, float]) -> None:
    from peft.tuners.lora.layer import Linear, _ConvNd

    for layer in lora_layers(model):
        for name in weights:
            if name in layer.lora_variant or layer.use_dora.get(name, False):
                raise ValueError(f"adapter {name!r} is a LoRA variant (DoRA, aLoRA, ...) in {type(layer).__name__}; "
                                 "per-request LoRA supports plain LoRA only")
            uses = name in layer.lora_A or name in getattr(layer, "lora_embedding_A", {})
            if uses and not isinstance(layer, (Linear, _ConvNd)):
                raise ValueError(f"adapter {name!r} adapts a {type(layer).__name__} layer; per-request LoRA "
                                 "supports Linear and Conv layers")


def lora_rows(model: torch.nn.Module, states: list[AdapterState | None],
              token_rows: Any = None) -> contextlib.AbstractContextManager:
    """The per-row LoRA context of one denoiser forward (a no-op when the model has no LoRA layers)."""
    if not lora_layers(model):
        return contextlib.nullcontext()
    return per_row_lora(model, [state.row if state is not None else {} for state in states], token_rows)


def text_encoder_state(encoders: list[Any]) -> tuple | None:
    """A hashable summary of the text encoders' LoRA state (active adapters, scalings); None without LoRA.

    Text encoders run with their global adapter state, so encode items key on it: texts planned under
    different states never share an encode call.
    """
    summary = []
    for encoder in encoders:
        layers = lora_layers(encoder) if isinstance(encoder, torch.nn.Module) else []
        summary.append(tuple((bool(layer.disable_adapters), bool(layer.merged),
                              tuple((name, layer.scaling.get(name)) for name in layer.active_adapters))
                             for layer in layers))
    return tuple(summary) if any(summary) else None


def without_lora_scale(attention_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The attention kwargs a per-row LoRA forward passes on: its LoRA `scale` is in each row's weights."""
    return {k: v for k, v in (attention_kwargs or {}).items() if k != "scale"}


def text_lora_scale(encoders: list[Any], lora_scale: Any) -> tuple[Any, tuple | None]:
    """(the LoRA scale an encode needs, the text encoders' LoRA state); the scale is None without text LoRA,
    where it cannot change an embedding, so requests that differ only in it share encodes and cache entries."""
    state = text_encoder_state(encoders)
    return (lora_scale if state is not None else None), state

