"""A request's two denoiser calls of a step (CFG's conditional, then unconditional call) run as one engine call.

A pipeline that calls its denoiser once per CFG branch (Wan, Qwen-Image's true CFG) hands the engine a call,
waits for it, then the other. Where the step before's second call took the first call's batch input (the latents),
the second call is predictable: its arguments that were the first call's own objects (latents, timestep) come from
this step's first call, the others (the negative prompt's embeddings) stay. The first call carries the predicted
second as extra rows; the second call is answered from them only if each argument is the predicted object or equal
to it, else it runs as it comes and predicting stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Call = tuple[tuple, dict]  # (positional arguments, keyword arguments)


@dataclass
class Prediction:
    call: Call
    holder: Any  # gets the predicted call's output when the paired engine call has run
    undo: Callable[[], None] | None = None  # on a miss: what running the predicted rows changed, undone


@dataclass
class BranchPairs:
    """One request's calls of one denoiser, by step; `step` is the request's scheduler step (None: unknown)."""

    step: int | None = None
    calls: list[Call] = field(default_factory=list)  # this step's calls so far
    previous: list[Call] = field(default_factory=list)  # the step before's calls
    prediction: Prediction | None = None
    off: bool = False

    def answer(self, step: int | None, call: Call) -> tuple[bool, Any]:
        """(True, output) where `call` is the predicted one; a call that isn't ends predicting."""
        self._at(step)
        prediction, self.prediction = self.prediction, None
        if prediction is not None:
            if prediction.holder.output is not None and same(prediction.call, call):
                self.calls.append(call)
                return True, prediction.holder.output
            self.off = True
            if prediction.undo is not None:
                prediction.undo()
        return False, None

    def predict(self, step: int | None, call: Call) -> Call | None:
        """Record `call`; where it is a step's first call and the step before made two, the second one's
        predicted arguments."""
        self._at(step)
        self.calls.append(call)
        if self.off or step is None or len(self.calls) != 1 or len(self.previous) != 2:
            return None
        return _predicted(*self.previous, call)

    def expect(self, call: Call, holder: Any, undo: Callable[[], None] | None = None) -> None:
        self.prediction = Prediction(call, holder, undo)

    def _at(self, step: int | None) -> None:
        if step != self.step:
            self.step, self.previous, self.calls = step, self.calls, []


def _predicted(first: Call, second: Call, now: Call) -> Call | None:
    """`second` with each argument that was `first`'s own object taken from `now` (the same position or name)."""
    (first_args, first_kwargs), (second_args, second_kwargs), (now_args, now_kwargs) = first, second, now
    if len(first_args) != len(now_args) or first_kwargs.keys() != now_kwargs.keys():
        return None
    if len(second_args) != len(first_args) or second_kwargs.keys() != first_kwargs.keys():
        return None
    # NOTE: only a call on the first call's own batch input (its first argument) is a branch of it; another (one
    # reading the first's output, or filling a cache) is not predicted: a wrong guess may change state
    name = next(iter(first_kwargs), None)
    first_batch, second_batch = (first_args[0], second_args[0]) if first_args else (first_kwargs.get(name),
                                                                                   second_kwargs.get(name))
    if first_batch is None or second_batch is not first_batch:
        return None
    args = tuple(new if old is mine else mine for old, mine, new in zip(first_args, second_args, now_args))
    kwargs = {name: now_kwargs[name] if first_kwargs[name] is value else value for name, value in second_kwargs.items()}
    return args, kwargs


def same(a: Any, b: Any) -> bool:
    """`a` and `b` are the same object or equal values (tensors: equal shape, dtype, device and elements)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # NOTE: a value that can't say whether it equals another: not predictable
        return False
