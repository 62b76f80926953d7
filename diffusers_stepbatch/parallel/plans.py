"""Which of a pipeline's models run split over the ranks, and switching diffusers' context parallelism on for them.

A denoiser runs split when its model support gives it a context-parallel plan (`ModelSupport.context_parallel`,
where diffusers has none or one that doesn't fit the model's config) or diffusers does (`_cp_plan`: FLUX.1,
FLUX.2, Qwen-Image, Wan, LTX-2, ...); every other model (text encoders, the VAE, a denoiser without a plan) runs
on rank 0 alone, and `ParallelModels.alone` says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from .gloo_gather import use_padded_gathers_on_gloo

# NOTE: the pipeline components that make the denoising calls (Wan 2.2's second expert is `transformer_2`)
DENOISERS = ("transformer", "transformer_2", "unet")


@dataclass
class ParallelModels:
    """Denoisers split over the ranks (name -> model), and why the others run on rank 0 alone."""

    split: dict[str, torch.nn.Module] = field(default_factory=dict)
    alone: dict[str, str] = field(default_factory=dict)


def context_parallel_plan(model: torch.nn.Module) -> dict | str:
    """The model's context-parallel plan (the model layer's, else diffusers' own), or why it has none."""
    from ..models import support_for

    own = support_for(model).context_parallel
    plan = own(model) if own is not None else getattr(type(model), "_cp_plan", None)
    if plan is None:
        return f"{type(model).__name__} has no context-parallel plan (diffusers' _cp_plan nor the model layer's)"
    return plan


def check_parallel_config(config: Any) -> None:
    """A ValueError for a `parallel=` value that is not a diffusers `ContextParallelConfig`."""
    from diffusers import ContextParallelConfig

    if not isinstance(config, ContextParallelConfig):
        raise ValueError(f"parallel={config!r} must be a diffusers ContextParallelConfig, e.g. "
                         "ContextParallelConfig(ulysses_degree=2)")


def check_degrees(config: Any) -> None:
    """A ValueError when the config's ranks are not the ranks torchrun started."""
    degree = config.ulysses_degree * config.ring_degree
    world = torch.distributed.get_world_size()
    if degree != world:
        raise ValueError(f"ContextParallelConfig(ulysses_degree={config.ulysses_degree}, "
                         f"ring_degree={config.ring_degree}) spans {degree} ranks, but torchrun started {world}; "
                         f"launch with --nproc-per-node {degree}")


def enable_context_parallel(pipe: Any, config: Any) -> ParallelModels:
    """Switch context parallelism on for each denoiser of `pipe` that has a plan (the same on every rank).

    With one kind of split (Ulysses or Ring alone) it also switches on diffusers' "anything" mode for it, so a
    request whose sequence doesn't divide by the ranks (an odd text length) runs too.
    """
    check_degrees(config)
    if config.ring_degree == 1:
        config.ulysses_anything = True
    elif config.ulysses_degree == 1:
        config.ring_anything = True
    use_padded_gathers_on_gloo()
    models = ParallelModels()
    for name in DENOISERS:
        model = getattr(pipe, name, None)
        if not isinstance(model, torch.nn.Module):
            continue
        plan = context_parallel_plan(model)
        if isinstance(plan, str):
            models.alone[name] = f"{plan}: it runs on rank 0 alone"
            continue
        _check_attention_backend(model, config)
        with _one_device_when_no_accelerator():
            model.enable_parallelism(config=config, cp_plan=plan)
        models.split[name] = model
    return models


def _check_attention_backend(model: torch.nn.Module, config: Any) -> None:
    """Ring attention needs a backend that returns the log-sum-exp; PyTorch's own SDPA (the CPU's) doesn't."""
    if config.ring_degree == 1:
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backends = [module.processor._attention_backend for module in model.modules()
                if hasattr(getattr(module, "processor", None), "_attention_backend")]
    backend = backends[0] if backends else None
    name = AttentionBackendName(backend) if backend else _AttentionBackendRegistry.get_active_backend()[0]
    if name == AttentionBackendName.NATIVE:
        raise ValueError(f"ring_degree={config.ring_degree} needs an attention backend that returns the "
                         "log-sum-exp (flash, _native_cudnn, _native_flash, sage; `--attention-backend`), but "
                         f"{type(model).__name__} uses PyTorch's SDPA ('native'); use ulysses_degree instead")


@contextlib.contextmanager
def _one_device_when_no_accelerator() -> Iterator[None]:
    # NOTE: diffusers divides by `torch.accelerator.device_count()`, 0 on CPU ranks
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        yield
