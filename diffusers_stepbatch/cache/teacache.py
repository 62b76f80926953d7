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
        coefficients: rescale polynomial, highest power first; None takes the model's.
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

    def states(self, model: Any, model_coefficients: tuple[float, ...] | None, num_steps: int,
               branches: int) -> list[TeaCacheState] | None:
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
        coefficients = self.coefficients or model_coefficients
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
