"""Uneven sequence gathers on gloo (CPU ranks).

diffusers' "anything" mode (a sequence that doesn't divide by the ranks) gathers the pieces with
`dist.all_gather` of unequal tensors; NCCL takes those, gloo refuses them ("invalid tensor size"). On gloo the
gather here pads each piece to the longest, gathers, and trims: the same tensor NCCL's gather returns.
Written by hand (a gloo limit, not a diffusers option); installed only when the ranks run on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def padded_all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`diffusers.hooks.context_parallel._all_gather_anything` for gloo: pieces of any length along `dim`."""
    from diffusers.models._modeling_parallel import gather_size_by_comm

    tensor = tensor.contiguous()
    sizes = gather_size_by_comm(tensor.shape[dim], group)
    longest = max(sizes)
    padding = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, longest - tensor.shape[dim]]
    padded = F.pad(tensor, padding).contiguous()
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)


def use_padded_gathers_on_gloo() -> None:
    """On gloo ranks, route diffusers' uneven gathers through `padded_all_gather`."""
    if dist.get_backend() != "gloo":
        return
    from diffusers.hooks import context_parallel

    context_parallel._all_gather_anything = padded_all_gather
