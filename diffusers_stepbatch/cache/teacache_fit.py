"""Fitting a TeaCache rescale polynomial on a pipeline's own runs (FLUX.1's signal unless a model's is given)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .teacache import relative_l1


def fit_coefficients(
    pipe: Any, prompts: Sequence[str], degree: int = 4, seed: int = 0, signal: Callable | None = None,
    **call_kwargs: Any
) -> tuple[float, ...]:
    """Fit a rescale polynomial for `pipe`'s transformer, as the TeaCache authors did for FLUX.1-dev.

    Fits the `change_pairs` of one run per prompt (seed `seed + i`). `signal(transformer, record)`: a model's
    `signal_hook`, a removable hook that records each forward's signal (e.g. `models/z_image/teacache.py`'s).

    >>> coefficients = fit_coefficients(pipe, ["a cat", "a red square"], num_inference_steps=28)
    >>> sb = StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4, coefficients=coefficients))
    """
    import numpy as np

    xs, ys = sampled_change_pairs(pipe, prompts, seed, signal, **call_kwargs)
    if len(xs) <= degree:
        raise ValueError(f"{len(xs)} step pairs cannot fit a degree-{degree} polynomial; use more prompts or steps")
    return tuple(float(c) for c in np.polyfit(xs, ys, degree))


def sampled_change_pairs(pipe: Any, prompts: Sequence[str], seed: int = 0, signal: Callable | None = None,
                         **call_kwargs: Any) -> tuple[list[float], list[float]]:
    """`change_pairs` of one run per prompt, pooled; prompt i sampled with seed `seed + i` (or `generator`)."""
    xs, ys = [], []
    for index, prompt in enumerate(prompts):
        generator = call_kwargs.get("generator") or torch.Generator().manual_seed(seed + index)
        changes = change_pairs(pipe, prompt, signal, **{**call_kwargs, "generator": generator})
        xs.extend(changes[0])
        ys.extend(changes[1])
    return xs, ys


def change_pairs(pipe: Any, prompt: str, signal: Callable | None = None,
                 **call_kwargs: Any) -> tuple[list[float], list[float]]:
    """The points `fit_coefficients` fits, from one run of `pipe` on `prompt` (unwrapped, every step computed):
    over consecutive steps of each CFG branch, the signal's relative L1 change and the model output's."""
    transformer = pipe.transformer
    signals, outputs = [], []
    hooks = [
        (signal or first_block_signal)(transformer, lambda tensor: signals.append(tensor.detach().double())),
        transformer.register_forward_hook(
            lambda module, args, out: outputs.append(_sample(out[0] if isinstance(out, tuple) else out.sample))),
    ]
    try:
        with torch.no_grad():
            pipe(prompt=prompt, **call_kwargs)  # NOTE: FLUX.2 takes `image` first
    finally:
        for hook in hooks:
            hook.remove()
    steps = call_kwargs.get("num_inference_steps") or len(outputs)
    branches = max(len(outputs) // steps, 1)  # true CFG calls the transformer twice per step
    xs, ys = [], []
    for i in range(branches, len(outputs)):
        if outputs[i].shape != outputs[i - branches].shape:
            continue  # NOTE: a step whose call returns other tokens (a KV cache's filling call): no pair
        xs.append(relative_l1(signals[i], signals[i - branches]))
        ys.append(relative_l1(outputs[i], outputs[i - branches]))
    return xs, ys


def first_block_signal(transformer, record):
    return transformer.transformer_blocks[0].norm1.register_forward_hook(lambda module, args, out: record(out[0]))


def _sample(sample) -> torch.Tensor:
    # NOTE: models that take one entry per image (Z-Image) return a list of them
    if isinstance(sample, (list, tuple)):
        return torch.cat([entry.detach().double().flatten() for entry in sample])
    return sample.detach().double()
