"""How a packed call's self-attention stays inside each row: the backends `layout.attend` may use.

- "recover_scatter": each part's rows as one SDPA batch (the model's own attention dispatch), written back.
- "flex": all tokens as one sequence, `torch.nn.attention.flex_attention` with a block-diagonal document mask
  (a row's tokens see only that row's); CPU and CUDA.
- "varlen": all tokens as one sequence, `torch.nn.attention.varlen.varlen_attn` (flash attention with
  cumulative row lengths); CUDA only, float16 / bfloat16 only.
- "auto": the fastest for the device type (`AUTO_CHOICE`).

>>> StepBatched(pipe, packed_attention="flex")          # or "auto" (the default), "recover_scatter", "varlen"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PACKED_ATTENTION = ("auto", "recover_scatter", "flex", "varlen")

# NOTE: recover-scatter was the fastest backend on CPU and CUDA (docs/benchmarks.md#packed-forward).
AUTO_CHOICE = {"cpu": "recover_scatter", "cuda": "recover_scatter"}


def check_packed_attention(method: object) -> str:
    """`method` if it names a backend, else a ValueError that lists them."""
    if method not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention={method!r} is not one of {', '.join(map(repr, PACKED_ATTENTION))}")
    return method  # type: ignore[return-value]


def resolve(method: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `method` means on `device`; a ValueError when it can't run there."""
    check_packed_attention(method)
    if method == "auto":
        return AUTO_CHOICE.get(device.type, "recover_scatter")
    if method == "varlen":
        if device.type != "cuda":
            raise ValueError(f"packed_attention='varlen' needs CUDA (flash attention), but the model is on "
                             f"{device.type}; use 'recover_scatter' or 'flex' there")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"packed_attention='varlen' needs float16 or bfloat16 (flash attention), but the model "
                             f"runs in {dtype}; use 'recover_scatter' or 'flex'")
    return method


def check_can_run(method: str, model: torch.nn.Module) -> None:
    """`resolve`'s ValueError, raised in the caller before a request is queued; reads the model's device and
    dtype (a walk over its modules in diffusers) only for "varlen", the one backend that needs either."""
    check_packed_attention(method)
    if method == "varlen":
        resolve(method, model.device, model.dtype)


def flat_attend(layout, queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor], method: str) -> list[torch.Tensor]:
    """`layout.attend` for the one-sequence backends ("flex", "varlen"): same inputs, same outputs."""
    flat = _flat(layout, queries[0].device)
    query, key, value = (_rows_contiguous(tensors, flat.order) for tensors in (queries, keys, values))
    if method == "flex":
        out = _flex(query, key, value, flat)
    elif method == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(query, key, value, flat.cu_lengths, flat.cu_lengths, flat.max_length, flat.max_length)
    else:
        raise ValueError(f"flat_attend has no backend {method!r}")
    out = out.flatten(1, 2)
    if flat.order is not None:
        out = torch.empty_like(out).index_copy_(0, flat.order, out)
    return list(out.split([q.shape[0] for q in queries]))


class _Flat:
    """A layout's tokens as one sequence in row order: the permutation, row lengths and the flex block mask."""

    def __init__(self, layout, device: torch.device):
        pieces, lengths, offset = [], [], 0
        offsets = []
        for k in range(layout.num_streams):
            offsets.append(offset)
            offset += layout.tokens(k)
        for part, part_rows in enumerate(layout.rows):
            for inner in range(part_rows):
                for k in range(layout.num_streams):
                    tokens = layout.row_tokens(k, part, inner, inner + 1)
                    pieces.append(torch.arange(offsets[k] + tokens.start, offsets[k] + tokens.stop))
                lengths.append(sum(layout.lengths[part]))
        order = torch.cat(pieces)
        # NOTE: a single stream is in row order already; no gather then.
        self.order = None if torch.equal(order, torch.arange(order.numel())) else order.to(device)
        self.cu_lengths = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                       device=device)
        self.max_length = max(lengths)
        self.document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        self.block_mask = None


def _flat(layout, device) -> _Flat:
    # NOTE: one per layout (all blocks of a forward share it); built on first use.
    flat = layout.__dict__.get("_flat")
    if flat is None:
        flat = layout.__dict__["_flat"] = _Flat(layout, device)
    return flat


def _rows_contiguous(tensors: Sequence[torch.Tensor], order: torch.Tensor | None) -> torch.Tensor:
    joined = tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))
    return joined if order is None else joined.index_select(0, order)


def _flex(query, key, value, flat: _Flat) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if flat.block_mask is None:
        document = flat.document

        def same_row(batch, head, q_index, kv_index):
            return document[q_index] == document[kv_index]

        length = document.numel()
        flat.block_mask = create_block_mask(same_row, None, None, length, length, device=query.device)
    # NOTE: [tokens, heads, dim] -> flex's [1, heads, tokens, dim] and back.
    out = flex_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)), block_mask=flat.block_mask)
    return out.squeeze(0).transpose(0, 1)
