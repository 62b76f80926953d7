"""The ranks of a context-parallel run: torch.distributed started from torchrun's environment, and a check that
every rank holds the same weights."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

# NOTE: how long one collective may wait for a rank inside a model call before the call fails (not the idle wait)
DEFAULT_TIMEOUT_S = 600.0


def start_ranks(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...), unless already joined:
    NCCL with a GPU per local rank, else gloo on the CPU."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("context parallelism needs several ranks: launch with `torchrun --nproc-per-node N ...` "
                           "(or call torch.distributed.init_process_group first)")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def rank_device() -> torch.device:
    """Where this rank's models live: its local GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_weights(models: dict[str, torch.nn.Module]) -> None:
    """A ValueError on every rank when some rank's weights differ from rank 0's (each rank loads its own copy)."""
    for name, model in models.items():
        mine = _fingerprint(model.parameters())
        ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, mine)
        differing = [rank for rank, theirs in enumerate(ranks) if not torch.equal(theirs, ranks[0])]
        if differing:
            raise ValueError(f"the {name} weights of rank(s) {differing} differ from rank 0's: every rank must load "
                             "the same checkpoint (same id, revision, dtype and quantization)")


def _fingerprint(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    sums = [parameter.detach().float().sum() for parameter in parameters]
    return torch.stack(sums).to(torch.float64) if sums else torch.zeros(1, dtype=torch.float64)
