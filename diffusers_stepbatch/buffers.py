"""Latent buffer manager: tensors of the denoising loop are allocated once and rewritten in place.

Batch inputs go into pooled buffers per (input, row shape, dtype, device), grown by doubling; each request's
`StepWorkspace` holds its guided prediction, Euler update and two ping-pong latent buffers. Every write covers
the rows it hands out (no zeroing pass), and the arithmetic is the replaced code's ops in the same order, so
outputs are bit-identical. One `LatentBuffers` belongs to one engine thread; it is not thread-safe.

>>> buffers = LatentBuffers()
>>> batch = buffers.stack("timestep", [torch.tensor(0.5), torch.tensor(0.25)])   # a view into the pool
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class LatentBuffers:
    """A pool of batch-assembly buffers, and the factory of per-request `StepWorkspace`s."""

    def __init__(self):
        self._pool: dict[tuple, torch.Tensor] = {}
        self.grows = 0

    def stack(self, name: str, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """`torch.stack(rows)` written into the pooled buffer of `name`; returns a view of its first rows."""
        first = rows[0]
        key = (name, tuple(first.shape), first.dtype, first.device)
        pooled = self._pool.get(key)
        if pooled is None or pooled.shape[0] < len(rows):
            capacity = max(len(rows), 2 * pooled.shape[0] if pooled is not None else 0)
            pooled = self._pool[key] = torch.empty((capacity, *first.shape), dtype=first.dtype, device=first.device)
            self.grows += 1
        batch = pooled[: len(rows)]
        torch.stack(list(rows), out=batch)
        return batch

    def scratch(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A pooled tensor of `shape` for intermediate results (its contents are overwritten by the next use)."""
        key = (name, tuple(shape[1:]), dtype, device)
        pooled = self._pool.get(key)
        if pooled is None or pooled.shape[0] < shape[0]:
            capacity = max(shape[0], 2 * pooled.shape[0] if pooled is not None else 0)
            pooled = self._pool[key] = torch.empty((capacity, *shape[1:]), dtype=dtype, device=device)
            self.grows += 1
        return pooled[: shape[0]]

    def workspace(self) -> StepWorkspace:
        return StepWorkspace()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pool.values())

    def stats(self) -> dict[str, int]:
        return {"buffers": len(self._pool), "bytes": self.nbytes, "grows": self.grows}


def stack_rows(buffers: LatentBuffers | None, name: str, rows: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """Assemble a batch input from its per-row tensors: into the pool when there is one, else freshly."""
    if rows is None:
        return None
    return buffers.stack(name, rows) if buffers is not None else torch.stack(list(rows))


def scratch_like(buffers: LatentBuffers | None, name: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped as `like`: pooled scratch when there is a pool, else fresh."""
    if buffers is None:
        return torch.empty_like(like)
    return buffers.scratch(name, like.shape, like.dtype, like.device)


class StepWorkspace:
    """One request's loop buffers: guided prediction, Euler scratch and ping-pong latents, allocated at first use
    and reused; a returned tensor must not be kept across two steps (the step after next overwrites it)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._ping_pong = ("latents.a", "latents.b")
        self._dts: torch.Tensor | None = None

    def _buffer(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or like.dtype
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != dtype or buffer.device != like.device:
            buffer = self._buffers[name] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return buffer

    def idle_latents(self, sample: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ping-pong buffer that `sample` is not: where this request's next latents go."""
        target = self._ping_pong[1] if self._buffers.get(self._ping_pong[0]) is sample else self._ping_pong[0]
        return self._buffer(target, sample, dtype)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """`uncond + scale * (cond - uncond)`, computed in a reused buffer."""
        guided = self._buffer("guided", cond)
        torch.sub(cond, uncond, out=guided)
        guided.mul_(scale)
        return torch.add(uncond, guided, out=guided)

    def scheduler_step(self, scheduler: Any, model_output: torch.Tensor, timestep: torch.Tensor,
                       sample: torch.Tensor) -> torch.Tensor:
        """`scheduler.step(model_output, timestep, sample)[0]` into the idle ping-pong buffer (FlowMatchEuler without
        stochastic sampling; any other scheduler runs its own `step`)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if type(scheduler) is not FlowMatchEulerDiscreteScheduler or scheduler.config.stochastic_sampling:
            return scheduler.step(model_output, timestep, sample, return_dict=False)[0]
        if scheduler.step_index is None:
            scheduler._init_step_index(timestep)
        if self._dts is None or self._dts.device != scheduler.sigmas.device:
            # NOTE: every step's fp32 sigma difference at once, as the scheduler computes each (no 0-dim tensors).
            self._dts = scheduler.sigmas[1:] - scheduler.sigmas[:-1]
        dt = self._dts[scheduler.step_index]
        # NOTE: the ops of FlowMatchEulerDiscreteScheduler.step, operands in the same order:
        # prev = sample.to(float32) + dt * model_output, then .to(model_output.dtype).
        delta = torch.mul(dt, model_output, out=self._buffer("delta", model_output))
        out = self.idle_latents(sample, model_output.dtype)
        if sample.dtype == torch.float32 and model_output.dtype == torch.float32:
            torch.add(sample, delta, out=out)
        else:
            upcast = self._buffer("upcast", sample, torch.float32)
            upcast.copy_(sample)
            torch.add(upcast, delta, out=upcast)
            out.copy_(upcast)
        scheduler._step_index += 1
        return out


class AllocationCounter:
    """Counts tensor allocations in this thread: op outputs with new storage (views and `out=` writes are not);
    `exclude(module)` stops counting inside that module's forward.

    >>> with AllocationCounter() as counter:
    ...     x = torch.ones(3) + 1
    >>> counter.count
    2
    """

    def __init__(self):
        self.count = 0
        self._paused = 0
        self._mode = None
        self._handles: list = []

    def exclude(self, module: torch.nn.Module) -> AllocationCounter:
        # NOTE: leaving the dispatch mode (rather than ignoring ops) keeps the model at full speed meanwhile.
        def pause(*_):
            self._paused += 1
            if self._paused == 1 and self._mode is not None:
                self._mode.__exit__(None, None, None)

        def resume(*_):
            self._paused -= 1
            if self._paused == 0 and self._mode is not None:
                self._mode.__enter__()

        self._handles += [module.register_forward_pre_hook(pause), module.register_forward_hook(resume)]
        return self

    def __enter__(self) -> AllocationCounter:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if not counter._paused:
                    seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor)}
                    for t in tree_flatten(out)[0]:
                        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                            if t.untyped_storage().data_ptr() not in seen:
                                counter.count += 1
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._mode.__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles = []
