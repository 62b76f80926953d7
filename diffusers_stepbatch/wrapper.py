"""StepBatched: wrap a diffusers pipeline so that concurrent calls share batched denoising steps."""

from __future__ import annotations

import asyncio
import inspect
import weakref
from typing import Any

from .engine.core import EngineCore
from .engine.request import Request, RequestHandle, next_request_id
from .engine.scheduler import StepScheduler
from .programs import program_for, registered_pipelines

_OWN_ATTRIBUTES = frozenset({"pipe", "engine", "_plan", "_signature", "_finalizer"})


class StepBatched:
    """A diffusers pipeline whose concurrent calls are merged into shared batches between denoising steps.

    Calls take the wrapped pipeline's own arguments and return its own output type; a request's output
    does not depend on which other requests shared its batches. Other attributes fall through to the
    wrapped pipeline.

    >>> from diffusers import FluxPipeline
    >>> from diffusers_stepbatch import StepBatched
    >>> pipe = StepBatched(FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev"), max_batch_size=8)
    >>> image = pipe("a cat", num_inference_steps=28).images[0]

    Args:
        pipe: the diffusers pipeline to serve.
        max_batch_size: the most rows (images x CFG branches) in one denoising forward.
    """

    def __init__(self, pipe: Any, *, max_batch_size: int = 8):
        plan = program_for(pipe)
        if plan is None:
            supported = ", ".join(cls.__name__ for cls in registered_pipelines())
            raise ValueError(f"StepBatched has no step program for {type(pipe).__name__}; supported: {supported}")
        self.pipe = pipe
        self._plan = plan
        self._signature = inspect.signature(type(pipe).__call__)
        self.engine = EngineCore(StepScheduler(max_batch_size))
        # NOTE: the engine thread holds the engine, not this wrapper; when the wrapper is collected, stop it.
        self._finalizer = weakref.finalize(self, self.engine.close, True)

    # ------------------------------------------------------------------------------------- calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one call, batched with whatever else is in flight; blocks until its output is ready."""
        handle = self.submit(*args, **kwargs)
        try:
            return handle.result()
        except BaseException:  # KeyboardInterrupt or an outer timeout: don't leave the request running
            handle.abort()
            raise

    def submit(self, *args: Any, **kwargs: Any) -> RequestHandle:
        """Validate a call and queue it; returns a `concurrent.futures.Future` with `abort()`.

        Bad input raises `ValueError` (or `TypeError` for unknown arguments) here, in the caller.
        """
        if self.engine.in_engine_thread():
            raise RuntimeError("StepBatched cannot be called from its own engine thread (e.g. from a step callback)")
        call_args = self._bind(args, kwargs)
        planned = self._plan(self.pipe, call_args)
        request_id = next_request_id()
        handle = RequestHandle(request_id, wake_engine=self.engine.wake)
        request = Request(
            request_id=request_id,
            program=planned.program,
            handle=handle,
            num_rows=planned.num_rows,
            num_steps=planned.num_steps,
        )
        self.engine.submit(request)
        return handle

    async def agenerate(self, *args: Any, **kwargs: Any) -> Any:
        """`await sb.agenerate(...)`; cancelling the awaiting task aborts the request."""
        return await asyncio.wrap_future(self.submit(*args, **kwargs))

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            bound = self._signature.bind(self.pipe, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(self.pipe).__name__}.__call__: {exc}") from None
        bound.apply_defaults()
        call_args = dict(bound.arguments)
        call_args.pop(next(iter(self._signature.parameters)))  # self
        return call_args

    # --------------------------------------------------------------------------------- lifecycle
    def stats(self) -> dict:
        """Engine statistics: batch-size histograms per work kind, finished requests, recent request timings."""
        snapshot = self.engine.metrics.snapshot()
        snapshot["waiting"] = len(self.engine.scheduler.waiting)
        snapshot["running"] = len(self.engine.scheduler.running)
        return snapshot

    def close(self, cancel_pending: bool = False) -> None:
        """Stop the engine thread; in-flight requests finish first unless `cancel_pending` cancels them."""
        self.engine.close(cancel_pending=cancel_pending)

    def __enter__(self) -> StepBatched:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def to(self, *args: Any, **kwargs: Any) -> StepBatched:
        """Move the wrapped pipeline (as `DiffusionPipeline.to`) and return this wrapper."""
        self.pipe.to(*args, **kwargs)
        return self

    # ------------------------------------------------------------------------ attribute fall-through
    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:  # not set yet (during __init__): don't recurse into the pipe
            raise AttributeError(name)
        return getattr(self.__dict__["pipe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:  # e.g. `sb.scheduler = ...`: requests submitted afterwards copy the new scheduler
            setattr(self.pipe, name, value)

    def __repr__(self) -> str:
        return f"StepBatched({type(self.pipe).__name__}, max_batch_size={self.engine.scheduler.max_batch_size})"
