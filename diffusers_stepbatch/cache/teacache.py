"""TeaCache with one decision per request and CFG branch, inside merged batches.

TeaCache (Liu et al., 2024) skips the blocks, adding an earlier step's residual, while the first block's modulated
input barely moves (its rescaled relative L1 change, accumulated up to the threshold); first and last steps run.

NOTE: public implementations decide once per batch; here each request holds a `TeaCacheState` per CFG branch
and the model's TeaCache forward decides per row, so a request skips the same steps alone or in a batch.

>>> sb = StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4))
>>> image = sb("a cat", num_inference_steps=28).images[0]
>>> exact = sb("a cat", num_inference_steps=28, teacache=None).images[0]   # per-request override
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.host_sync import host_float

FEW_STEPS = 8  # at or below this many steps every step is a turning point: TeaCache would only harm


@dataclass
class TeaCacheConfig:
    """TeaCache settings for a `StepBatched` engine, or for one request (`teacache=` call argument).

    Args:
        threshold: accumulated rescaled change below which a step reuses the cached residual (0 never skips).
        coefficients: rescale polynomial, highest power first; None takes the model's (its `ModelSupport`).
        min_steps: requests with fewer denoising steps run without TeaCache (and a warning, once per config).
    """

    threshold: float = 0.4
    coefficients: tuple[float, ...] | None = None
    min_steps: int = FEW_STEPS + 1
    _warned: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise ValueError(f"threshold={self.threshold!r} must be a number >= 0 (0 never skips a step)")
        if self.coefficients is not None:
            self.coefficients = tuple(float(c) for c in self.coefficients)
            if not self.coefficients:
                raise ValueError("coefficients=() must hold at least one value (highest power first)")
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int) or self.min_steps < 3:
            raise ValueError(f"min_steps={self.min_steps!r} must be an int >= 3 (first and last steps always run)")

    def states(self, model: Any, num_steps: int, branches: int) -> list[TeaCacheState] | None:
        """Fresh per-branch states for one request, or None when TeaCache must not run for it."""
        if num_steps < self.min_steps:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"TeaCache is off for requests with num_inference_steps={num_steps} < min_steps={self.min_steps}: "
                    "on few-step models every step changes the image and reusing a residual only harms",
                    UserWarning, stacklevel=4,
                )
            return None
        from ..models import support_for

        coefficients = self.coefficients or support_for(model).teacache_coefficients
        if coefficients is None:
            raise ValueError(f"TeaCache has no rescale coefficients for {type(model).__name__}; pass coefficients=")
        return [TeaCacheState(float(self.threshold), coefficients, num_steps) for _ in range(branches)]


@dataclass(eq=False)
class TeaCacheState:
    """One request's TeaCache memory for one CFG branch; the program sets `step` before each forward."""

    threshold: float
    coefficients: tuple[float, ...]
    num_steps: int
    step: int = 0
    accumulated: float = 0.0
    previous_signal: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    computed_steps: int = 0
    skipped_steps: int = 0

    def decide(self, signal: torch.Tensor) -> tuple[bool, float]:
        """(compute?, new accumulated distance) for this signal (of another shape: its rows changed, compute)."""
        edge = self.step == 0 or self.step >= self.num_steps - 1
        if edge or self.previous_signal is None or self.residual is None or self.previous_signal.shape != signal.shape:
            return True, 0.0
        accumulated = self.accumulated + _polyval(self.coefficients, relative_l1(signal, self.previous_signal))
        if self.threshold > 0 and accumulated < self.threshold:
            return False, accumulated
        return True, 0.0

    def commit(self, signal: torch.Tensor, compute: bool, accumulated: float, residual: torch.Tensor | None) -> None:
        self.previous_signal = signal
        self.accumulated = accumulated
        if compute:
            self.residual = residual
            self.computed_steps += 1
        else:
            self.skipped_steps += 1


@contextlib.contextmanager
def kept_on_failure(states: Iterable[TeaCacheState | None]) -> Iterator[None]:
    """A call that raises leaves `states` as they were before it: the engine retries failed calls (alone, or one
    shape at a time), and a retry must decide from the same memory as the failed attempt did."""
    saved = [(state, dict(vars(state))) for state in states if state is not None]
    try:
        yield
    except BaseException:
        for state, fields in saved:
            vars(state).update(fields)
        raise


def saved(states: Iterable[TeaCacheState | None]) -> Callable[[], None]:
    """A function that puts `states` back as they are now (a call that is run again must decide again from them)."""
    fields = [(state, dict(vars(state))) for state in states if state is not None]

    def restore() -> None:
        for state, values in fields:
            vars(state).update(values)

    return restore


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    # NOTE: the skip decision is made on the host, so this is the step's one device read per request branch.
    return host_float((current - previous).abs().mean() / previous.abs().mean())


def _polyval(coefficients: Sequence[float], x: float) -> float:
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


def row_groups(states: Sequence[TeaCacheState | None]) -> list[tuple[TeaCacheState | None, int, int]]:
    """Consecutive rows sharing one state object, as (state, start, end); a program's rows are contiguous."""
    groups: list[tuple[TeaCacheState | None, int, int]] = []
    for row, state in enumerate(states):
        if groups and groups[-1][0] is state:
            groups[-1] = (state, groups[-1][1], row + 1)
        else:
            groups.append((state, row, row + 1))
    return groups


def packed_decisions(states: Sequence[TeaCacheState | None], group: Callable[[TeaCacheState | None, int, int], tuple]
                     ) -> tuple[list[tuple], list[int]]:
    """Each row group's decision on packed tokens, as `settle_packed_decisions` takes them, and the computing rows.

    `group(state, start, end)` gives a group's (rows, image tokens, signal); a group without a state computes (its
    tokens and signal unused)."""
    decisions = []  # (state, rows, tokens, signal, compute, accumulated)
    for state, start, end in row_groups(states):
        rows, tokens, signal = group(state, start, end)
        compute, accumulated = (True, 0.0) if state is None else state.decide(signal)
        decisions.append((state, rows, tokens, signal, compute, accumulated))
    return decisions, [row for _, rows, _, _, compute, _ in decisions if compute for row in rows]


def settle_packed_decisions(decisions: Sequence[tuple], hidden: torch.Tensor,
                            computed: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The blocks' output on packed tokens under per-state decisions, and each state's commit.

    `decisions`: per row group (state, rows, token slice, signal, compute, accumulated); `computed`: the computing
    rows' (token index, their input tokens, their output tokens), the index None when every row computed, or None
    when none did. Skipping rows add their cached residual; states change only here, after the blocks ran."""
    index, sub_hidden, sub_out = computed if computed is not None else (None, None, None)
    if sub_out is None:
        out, residual = torch.empty_like(hidden), None
    elif index is None:
        out, residual = sub_out, sub_out - sub_hidden
    else:
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)
        out[index] = sub_out
        residual[index] = sub_out - sub_hidden
    for state, rows, tokens, _, compute, _ in decisions:
        if not compute:
            out[tokens] = hidden[tokens] + state.residual.flatten(0, 1)
    for state, rows, tokens, signal, compute, accumulated in decisions:
        if state is not None:
            own = residual[tokens].unflatten(0, (len(rows), -1)).clone() if compute else None
            state.commit(signal.clone(), compute, accumulated, own)
    return out
