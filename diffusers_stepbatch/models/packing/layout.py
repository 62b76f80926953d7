"""Token packing for mixed-resolution transformer calls: the rows of several shapes in one flat sequence.

A packed call holds *parts* (rows that share a shape); each row has one span of tokens per *stream* (Flux: text,
image), packed without padding as [tokens, ...], part after part and row after row. Token-wise layers run once
over it, per-row conditioning reaches the tokens through `per_token`, and `attend` keeps attention in each row.

>>> layout = PackedLayout(rows=[2, 1], lengths=[(4, 16), (4, 64)])   # 2 rows of 4 + 16 tokens, 1 of 4 + 64
>>> layout.tokens(1)                                                  # image tokens in all: 2 * 16 + 64
96
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# NOTE: mean tokens per part (in one stream) from which row values broadcast per part rather than per token.
_BROADCAST_MIN_TOKENS = 256


@dataclass(frozen=True)
class RowValues:
    """Per-row values [rows, dim] and, where the layout gathers them, their per-token copy [tokens, dim]."""

    per_row: torch.Tensor
    per_token: torch.Tensor | None


@dataclass(frozen=True)
class _Span:
    start: int  # first token of the part in its stream
    length: int  # tokens per row


class PackedLayout:
    """Where each part's rows sit in each packed stream, and which row every token belongs to.

    Args:
        rows: rows per part.
        lengths: per part, tokens per row in each stream (every part has the same number of streams).
        device: where the token-to-row indices live.
    """

    def __init__(self, rows: Sequence[int], lengths: Sequence[Sequence[int]], device: torch.device | str = "cpu"):
        if not rows or len(rows) != len(lengths):
            raise ValueError(f"need one lengths tuple per part, got rows={list(rows)} and lengths={list(lengths)}")
        self.rows = [int(r) for r in rows]
        self.lengths = [tuple(int(n) for n in part) for part in lengths]
        self.num_streams = len(self.lengths[0])
        self.row_starts = [sum(self.rows[:p]) for p in range(len(self.rows))]
        self.num_rows = sum(self.rows)
        self.spans: list[list[_Span]] = []  # spans[part][stream]
        totals = [0] * self.num_streams
        for part_rows, part_lengths in zip(self.rows, self.lengths):
            self.spans.append([_Span(totals[k], n) for k, n in enumerate(part_lengths)])
            for k, n in enumerate(part_lengths):
                totals[k] += part_rows * n
        self._totals = totals
        self.token_rows = [
            torch.cat([
                torch.arange(start, start + part_rows, device=device).repeat_interleave(part_lengths[k])
                for start, part_rows, part_lengths in zip(self.row_starts, self.rows, self.lengths)
            ])
            for k in range(self.num_streams)
        ]

    @property
    def num_parts(self) -> int:
        return len(self.rows)

    def tokens(self, stream: int) -> int:
        return self._totals[stream]

    def pack(self, stream: int, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """[rows, length, ...] per part -> [tokens, ...] for one stream."""
        flat = [part.reshape(-1, *part.shape[2:]) for part in parts]
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    def unpack(self, stream: int, packed: torch.Tensor) -> list[torch.Tensor]:
        """[tokens, ...] of one stream -> [rows, length, ...] per part."""
        out = []
        for part_rows, spans in zip(self.rows, self.spans):
            span = spans[stream]
            out.append(packed[span.start:span.start + part_rows * span.length].unflatten(0, (part_rows, span.length)))
        return out

    def per_token(self, stream: int, per_row: torch.Tensor) -> torch.Tensor:
        """Row values [rows, ...] repeated for every token of one stream: [tokens, ...]."""
        return per_row.index_select(0, self.token_rows[stream])

    def row_values(self, stream: int, per_row: torch.Tensor, chunks: int = 1) -> list[RowValues]:
        """Row values [rows, chunks * dim], split in `chunks`, as one stream's tokens see them (`modulate`)."""
        per_token = None if self.broadcasts(stream) else self.per_token(stream, per_row).chunk(chunks, dim=1)
        return [RowValues(values, None if per_token is None else per_token[i])
                for i, values in enumerate(per_row.chunk(chunks, dim=1))]

    def broadcasts(self, stream: int) -> bool:
        """Whether row values broadcast over each part's [rows, length] view rather than a per-token copy.

        NOTE: with long rows a [tokens, dim] copy per AdaLN value costs more than one kernel per part."""
        return self.tokens(stream) >= _BROADCAST_MIN_TOKENS * self.num_parts

    def modulate(self, stream: int, x: torch.Tensor, scale1: RowValues, shift: RowValues) -> torch.Tensor:
        """AdaLN's `x * (1 + scale) + shift` per row, `scale1` holding 1 + scale: [tokens, dim]."""
        return self._addcmul(stream, shift, x, scale1, row_first=True)

    def gated_add(self, stream: int, residual: torch.Tensor, gate: RowValues, update: torch.Tensor) -> torch.Tensor:
        """The gated residual `residual + gate * update` per row: [tokens, dim]."""
        return self._addcmul(stream, residual, update, gate, row_first=False)

    def gated_apply(self, stream: int, residual: torch.Tensor, gate: RowValues, fn: Callable, x: torch.Tensor,
                    split: bool = True) -> torch.Tensor:
        """`residual + gate * fn(x)` per row for a token-wise `fn`; `split` runs `fn` per part with long rows."""
        if gate.per_token is not None or not split:
            return self.gated_add(stream, residual, gate, fn(x))
        out = residual.new_empty(residual.shape)  # NOTE: contiguous, so each part's span is a view
        for part, (part_rows, row_start) in enumerate(zip(self.rows, self.row_starts)):
            span = self.row_tokens(stream, part, 0, part_rows)
            view = (part_rows, self.spans[part][stream].length, -1)
            torch.addcmul(residual[span].reshape(view), fn(x[span]).reshape(view),
                          gate.per_row[row_start:row_start + part_rows, None], out=out[span].view(view))
        return out

    def apply_into(self, stream: int, fn: Callable, x: torch.Tensor, out: torch.Tensor, split: bool = True) -> None:
        """`out[:] = fn(x)` for a token-wise `fn`; with `split` and long rows per part, as `gated_apply`."""
        if not (split and self.broadcasts(stream)):
            out.copy_(fn(x))
            return
        for part, part_rows in enumerate(self.rows):
            span = self.row_tokens(stream, part, 0, part_rows)
            out[span] = fn(x[span])

    def _addcmul(self, stream, first, tokens, row, row_first):
        # NOTE: `first + tokens * row` in one fused op; `first` is row values too when `row_first`.
        if row.per_token is not None:
            return torch.addcmul(first.per_token if row_first else first, tokens, row.per_token)
        out = tokens.new_empty(tokens.shape)  # NOTE: contiguous, so each part's span is a view
        for part, (part_rows, row_start) in enumerate(zip(self.rows, self.row_starts)):
            span = self.row_tokens(stream, part, 0, part_rows)
            view = (part_rows, self.spans[part][stream].length, -1)
            rows = slice(row_start, row_start + part_rows)
            base = first.per_row[rows, None] if row_first else first[span].reshape(view)
            torch.addcmul(base, tokens[span].reshape(view), row.per_row[rows, None], out=out[span].view(view))
        return out

    def row_tokens(self, stream: int, part: int, first: int, end: int) -> slice:
        """The packed tokens of rows [first, end) of `part` (indices inside the part) in one stream."""
        span = self.spans[part][stream]
        return slice(span.start + first * span.length, span.start + end * span.length)

    def part_of_row(self, row: int) -> tuple[int, int]:
        """(part, index inside the part) of a global row."""
        for part, start in enumerate(self.row_starts):
            if start <= row < start + self.rows[part]:
                return part, row - start
        raise IndexError(f"row {row} is outside the layout's {self.num_rows} rows")

    def select_rows(self, rows: Sequence[int]) -> tuple[PackedLayout, list[torch.Tensor]]:
        """A layout of only `rows` (in order, parts kept together) and, per stream, the tokens they keep."""
        kept_rows, kept_lengths, indices = [], [], [[] for _ in range(self.num_streams)]
        by_part: dict[int, list[int]] = {}
        for row in rows:
            part, inner = self.part_of_row(row)
            by_part.setdefault(part, []).append(inner)
        for part, inners in by_part.items():
            kept_rows.append(len(inners))
            kept_lengths.append(self.lengths[part])
            for k in range(self.num_streams):
                for inner in inners:
                    token_slice = self.row_tokens(k, part, inner, inner + 1)
                    indices[k].append(torch.arange(token_slice.start, token_slice.stop))
        device = self.token_rows[0].device
        index = [torch.cat(parts).to(device) for parts in indices]
        return PackedLayout(kept_rows, kept_lengths, device=device), index


def adaln_values(layout: PackedLayout, stream: int, emb: torch.Tensor, chunks: int) -> list[RowValues]:
    """AdaLN-Zero's per-row (shift, 1 + scale, gate, ...) chunks of `emb` as `stream`'s tokens see them."""
    return layout.row_values(stream, adaln_rows(emb, chunks), chunks)


def adaln_rows(emb: torch.Tensor, chunks: int) -> torch.Tensor:
    """`emb` [rows, chunks * dim] with each scale chunk (every third from the second) as 1 + scale."""
    pieces = list(emb.chunk(chunks, dim=1))
    for scale in range(1, chunks, 3):
        pieces[scale] = 1 + pieces[scale]
    return torch.cat(pieces, dim=1)


# attention(query, key, value) on [rows, sequence, heads, head_dim] tensors -> [rows, sequence, heads, head_dim]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend(layout: PackedLayout, queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
           values: Sequence[torch.Tensor], attention: AttentionFn | Sequence[AttentionFn],
           method: str = "recover_scatter", out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Self-attention inside each row over its streams' tokens, in stream order; no token sees another row's.

    `queries[k]` etc. are stream k's packed [tokens, heads, head_dim]; returns stream k's [tokens, heads * head_dim]
    (into `out[k]` when given). "recover_scatter" attends each part as one batch through `attention` (or a list:
    `attention[part]`).
    """
    per_part = not callable(attention)
    if per_part and method != "recover_scatter":
        raise ValueError(f"per-part attention functions need method='recover_scatter', got {method!r}")
    if method != "recover_scatter":
        from .attention import flat_attend

        outputs = flat_attend(layout, queries, keys, values, method)
        if out is None:
            return outputs
        for target, output in zip(out, outputs):
            target.copy_(output)
        return list(out)
    outputs = list(out) if out is not None else [q.new_empty(q.shape[0], q.shape[1] * q.shape[2]) for q in queries]
    for part, (part_rows, spans) in enumerate(zip(layout.rows, layout.spans)):
        gathered = []
        for tensors in (queries, keys, values):
            pieces = [
                tensor[span.start:span.start + part_rows * span.length].unflatten(0, (part_rows, span.length))
                for tensor, span in zip(tensors, spans)
            ]
            gathered.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
        out = (attention[part] if per_part else attention)(*gathered).flatten(2, 3)
        offset = 0
        for k, span in enumerate(spans):
            outputs[k][span.start:span.start + part_rows * span.length] = \
                out[:, offset:offset + span.length].reshape(-1, out.shape[-1])
            offset += span.length
    return outputs
