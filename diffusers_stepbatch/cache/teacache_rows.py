"""The per-row TeaCache driver of every model's TeaCache forward: each run of rows sharing a `TeaCacheState` (a
request's CFG branch) decides on its own signal, computing rows run the blocks together, skipping rows add their
cached residual, and the states change only once the blocks ran (a failed call retried decides the same again).
A model hands in its signal and blocks: `dense_rows` (rows are the batch's), `decide_packed` + `settle_packed`
(packed tokens), `decide_rows` + `commit_rows` (rows holding lists of token streams)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.lora import row_subset
from .teacache import TeaCacheState


@dataclass
class RowDecision:
    """One run of rows' TeaCache decision in a call.

    Args:
        state: the rows' state; None: rows without TeaCache, which compute.
        rows: the rows' indices in the call (or in the packed order); tokens: theirs in a packed call.
        signal: what the state decided on, kept as its previous signal at commit.
        compute, accumulated: the decision, and the state's accumulated distance after this step.
    """

    state: TeaCacheState | None
    rows: Sequence[int]
    signal: Any = None
    compute: bool = True
    accumulated: float = 0.0
    tokens: torch.Tensor | None = None


def row_groups(states: Sequence[TeaCacheState | None]) -> list[tuple[TeaCacheState | None, range]]:
    """Consecutive rows sharing one state object, as (state, rows); a program's rows are contiguous."""
    groups: list[tuple[TeaCacheState | None, range]] = []
    for row, state in enumerate(states):
        if groups and groups[-1][0] is state:
            groups[-1] = (state, range(groups[-1][1].start, row + 1))
        else:
            groups.append((state, range(row, row + 1)))
    return groups


def decide_rows(states: Sequence[TeaCacheState | None], signal: Callable[[range], Any],
                compute_all: bool = False) -> list[RowDecision]:
    """Each run of rows' decision on `signal(rows)`; `compute_all`: every run computes (a call filling a cache)."""
    decisions = []
    for state, rows in row_groups(states):
        if state is None:
            decisions.append(RowDecision(None, rows))
            continue
        own = signal(rows)
        compute, accumulated = (True, 0.0) if compute_all else state.decide(own)
        decisions.append(RowDecision(state, rows, own, compute, accumulated))
    return decisions


def computing_rows(decisions: Sequence[RowDecision]) -> list[int]:
    return [row for decision in decisions if decision.compute for row in decision.rows]


def commit_rows(decisions: Sequence[RowDecision], residual: Callable[[RowDecision], Any]) -> None:
    """Each state's step, once the blocks ran: `residual(decision)` is asked for computing rows only."""
    for decision in decisions:
        if decision.state is not None:
            own = residual(decision) if decision.compute else None
            decision.state.commit(decision.signal, decision.compute, decision.accumulated, own)


def dense_rows(model: torch.nn.Module, states: Sequence[TeaCacheState | None], hidden: torch.Tensor,
               signal: torch.Tensor, blocks: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """(every row's output, commit): `blocks(hidden, rows=index)` on the rows that compute (index None: all), each
    with its own LoRA; skipping rows add their cached residual. Call commit once the forward succeeded."""
    decisions = decide_rows(states, lambda rows: _own(signal, rows))
    compute_rows = computing_rows(decisions)
    if len(compute_rows) == hidden.shape[0]:
        out = blocks(hidden, rows=None)
        residual = out - hidden
    else:
        out, residual = torch.empty_like(hidden), None
        if compute_rows:
            index = torch.tensor(compute_rows, device=hidden.device)
            with row_subset(model, compute_rows):  # NOTE: per-row LoRA: these rows' own adapters
                sub = blocks(hidden[index], rows=index)
            out[index] = sub
            residual = torch.empty_like(hidden)
            residual[index] = sub - hidden[index]
        for decision in decisions:
            if not decision.compute:
                rows = slice(decision.rows[0], decision.rows[-1] + 1)
                out[rows] = hidden[rows] + decision.state.residual
    return out, lambda: commit_rows(decisions, lambda decision: _own(residual, decision.rows))


def _own(batch: torch.Tensor, rows: range) -> torch.Tensor:
    """Rows that don't keep the rest of the batch alive."""
    return batch if (rows.start, rows.stop) == (0, batch.shape[0]) else batch[rows.start:rows.stop].clone()


def decide_packed(states: Sequence[TeaCacheState | None],
                  group: Callable[[TeaCacheState | None, range], tuple[Sequence[int], Any, Any]]
                  ) -> tuple[list[RowDecision], list[int]]:
    """Each run of rows' decision on packed tokens, and the computing rows. `group(state, rows)` gives a run its (rows
    in the packed order, image tokens, signal); a run without a state computes (its tokens and signal unused)."""
    decisions = []
    for state, rows in row_groups(states):
        packed_rows, tokens, signal = group(state, rows)
        compute, accumulated = (True, 0.0) if state is None else state.decide(signal)
        decisions.append(RowDecision(state, packed_rows, signal, compute, accumulated, tokens))
    return decisions, computing_rows(decisions)


def settle_packed(decisions: Sequence[RowDecision], hidden: torch.Tensor,
                  computed: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The blocks' output on packed tokens, and each state's commit. `computed`: the computing rows' (token index
    or None for all, their input tokens, their output tokens), or None; skipping rows add their cached residual."""
    index, sub_hidden, sub_out = computed if computed is not None else (None, None, None)
    if sub_out is None:
        out, residual = torch.empty_like(hidden), None
    elif index is None:
        out, residual = sub_out, sub_out - sub_hidden
    else:
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)
        out[index] = sub_out
        residual[index] = sub_out - sub_hidden
    for decision in decisions:
        if not decision.compute:
            out[decision.tokens] = hidden[decision.tokens] + decision.state.residual.flatten(0, 1)
    for decision in decisions:
        decision.signal = None if decision.state is None else decision.signal.clone()
    commit_rows(decisions, lambda d: residual[d.tokens].unflatten(0, (len(d.rows), -1)).clone())
    return out
