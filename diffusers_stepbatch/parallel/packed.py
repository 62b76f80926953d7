"""Packed calls split over the ranks, for models whose plan splits only the forward's own inputs (FLUX.1, FLUX.2).

Under Ulysses each rank holds a share of every row's tokens and, inside attention, all tokens of a share of the
heads; a packed call's attention runs part by part (`models/packing/layout.attend`) through the processor's
parallel dispatch, so each row still attends only to its own tokens. Each rank runs the packed forward on its
share of every call's tokens (split as the plan splits the forward's inputs), and each call's output is gathered
as the plan gathers the forward's; the model's own gather hooks stay off meanwhile (they would gather the packed
tensor as one). Plans that split inside the model (Qwen-Image, Wan, LTX-2, Z-Image) keep packing off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .plans import context_parallel_plan


def splits_packed(model: torch.nn.Module) -> bool:
    """True when the model's plan splits its forward's own inputs only and gathers outputs only."""
    from diffusers.models._modeling_parallel import ContextParallelOutput

    plan = context_parallel_plan(model)
    if isinstance(plan, str) or "" not in plan:
        return False
    return all(name == "" or isinstance(entry, (ContextParallelOutput, list, tuple)) for name, entry in plan.items())


def run_split_packed(packing: Any, model: torch.nn.Module, calls: list[dict[str, Any]], packed_attention: str) -> list:
    """This rank's share of a packed call: every call's inputs split, its output gathered whole."""
    from diffusers.hooks.context_parallel import ContextParallelGatherHook, ContextParallelSplitHook

    config = model._parallel_config.context_parallel_config
    plan = context_parallel_plan(model)
    split = ContextParallelSplitHook(plan[""], config)
    shares = [{name: split._prepare_cp_input(value, plan[""][name])
               if name in plan[""] and isinstance(value, torch.Tensor) else value for name, value in call.items()}
              for call in calls]
    with _gathers_off(model, plan):
        outputs = packing.run(model, shares, packed_attention, [None] * len(calls))
    gather = ContextParallelGatherHook([_output_gather(plan)], config)
    return [_with_sample(output, gather.post_forward(model, _sample(output))) for output in outputs]


def _output_gather(plan: dict):
    from diffusers.models._modeling_parallel import ContextParallelOutput

    outputs = [entry for name, entry in plan.items() if name and isinstance(entry, ContextParallelOutput)]
    if len(outputs) != 1:
        raise ValueError(f"a split packed call needs one gathered output in the plan, found {len(outputs)}")
    return outputs[0]


@contextlib.contextmanager
def _gathers_off(model: torch.nn.Module, plan: dict) -> Iterator[None]:
    from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE

    hooks = []
    for name, entry in plan.items():
        if name:
            registry = getattr(model.get_submodule(name), "_diffusers_hook", None)
            hook = registry.get_hook(_CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(name)) if registry else None
            if hook is not None:
                hooks.append((hook, hook.metadata))
                hook.metadata = [None] * len(hook.metadata)  # NOTE: a None entry is left as it is
    try:
        yield
    finally:
        for hook, metadata in hooks:
            hook.metadata = metadata


def _sample(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(output: Any, sample: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output
