"""One model over several ranks: diffusers' context parallelism driven by one engine on rank 0.

>>> sb = StepBatched(pipe, parallel=ContextParallelConfig(ulysses_degree=2))   # inside torchrun
>>> sb.follow() if sb.rank > 0 else sb("a cat")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .packed import splits_packed
from .plans import ParallelModels, check_parallel_config, enable_context_parallel
from .ranks import DEFAULT_TIMEOUT_S, check_same_weights, rank_device, start_ranks
from .relay import CallRelay, RanksLost, follow, header_group

PACKING_OFF = ("context parallel: this model's packed calls can't run split (its plan splits inside the model), "
               "each size runs its own call")

__all__ = ["ContextParallelRun", "PACKING_OFF", "RanksLost", "start_context_parallel"]


@dataclass
class ContextParallelRun:
    """This rank's part in a context-parallel run: rank 0 relays its models' calls, the others follow them."""

    config: Any
    rank: int
    world_size: int
    models: ParallelModels
    headers: Any = None
    relay: CallRelay | None = None

    def follow(self) -> int:
        """On a follower: make rank 0's calls until it closes; returns how many calls were made."""
        if self.rank == 0:
            raise RuntimeError("rank 0 runs the engine and sends the calls: only ranks > 0 follow()")
        return follow(list(self.models.split.values()), rank_device(), self.headers)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()

    def packing_refusal(self) -> str | None:
        """`PACKING_OFF` when a split model packs calls but not split over the ranks (`parallel/packed.py`)."""
        from ..models import support_for

        refused = [model for model in self.models.split.values()
                   if support_for(model).packing is not None and not splits_packed(model)]
        return PACKING_OFF if refused else None

    def describe(self) -> dict[str, Any]:
        """For `stats()["parallel"]`: the degrees, which models run split and why the others don't."""
        return {"ranks": self.world_size, "ulysses_degree": self.config.ulysses_degree,
                "ring_degree": self.config.ring_degree, "split": sorted(self.models.split),
                "alone": dict(self.models.alone), "calls_relayed": None if self.relay is None else self.relay.calls,
                "lost": None if self.relay is None or self.relay.lost is None else str(self.relay.lost)}


def start_context_parallel(pipe: Any, config: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> ContextParallelRun:
    """Join the ranks, switch context parallelism on for the pipeline's denoisers (every rank does the same), check
    the ranks hold the same weights, and on rank 0 start relaying the split models' calls."""
    check_parallel_config(config)
    start_ranks(timeout_s)
    models = enable_context_parallel(pipe, config)
    check_same_weights(models.split)
    run = ContextParallelRun(config, dist.get_rank(), dist.get_world_size(), models, header_group())
    if run.rank == 0:  # NOTE: also with no model split: the followers wait for its close
        run.relay = CallRelay(list(models.split.values()), rank_device(), run.headers)
    return run
