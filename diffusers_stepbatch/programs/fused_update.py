"""One scheduler update for all rows of an engine step: `x + dt * v` (and the CFG combine) as batched ops.

A per-request `scheduler.step` is a few tiny ops per request and step. Where the update is stateless per step
(FlowMatchEulerDiscreteScheduler without stochastic sampling; EulerDiscreteScheduler with epsilon, no churn) it is
the same arithmetic for every row with its own sigmas, so the program yields it as an `immediate` work item and
the engine runs all requests' updates as one call right after the forwards.

NOTE: bit-identical to each request's `scheduler.step` (same ops, order and precision; each scheduler still
advances its index). Where reduced precision could round a per-row tensor unlike a scalar, a one-time probe per
(device, dtype) compares both, and requests keep their own step if they differ.

>>> update = FusedEuler.for_scheduler(view.scheduler, latents, buffers)   # None: use scheduler.step
>>> latents = yield from update.step(t, latents, cond, uncond, true_cfg_scale)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Generator
from typing import Any

import torch

from ..buffers import LatentBuffers, StepWorkspace, scratch_like, stack_rows
from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key

_probe_lock = threading.Lock()


class FusedEuler:
    """One request's handle on the fused Euler update (flow matching, or Euler discrete with epsilon)."""

    def __init__(self, scheduler: Any, kind: str, buffers: LatentBuffers | None, workspace: StepWorkspace | None):
        self.scheduler = scheduler
        self.kind = kind  # "flow" (FlowMatchEulerDiscreteScheduler) or "euler" (EulerDiscreteScheduler, epsilon)
        self.buffers = buffers
        self.workspace = workspace
        self._dts: torch.Tensor | None = None

    @classmethod
    def for_scheduler(cls, scheduler: Any, sample: torch.Tensor, buffers: LatentBuffers | None = None,
                      workspace: StepWorkspace | None = None) -> FusedEuler | None:
        """The fused update for this scheduler and latents, or None where the scheduler's own step must run."""
        from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

        if type(scheduler) is FlowMatchEulerDiscreteScheduler and not scheduler.config.stochastic_sampling:
            kind = "flow"
        elif type(scheduler) is EulerDiscreteScheduler and scheduler.config.prediction_type == "epsilon":
            kind = "euler"  # NOTE: the programs call its step without s_churn, so it adds no noise
        else:
            return None
        if not _rows_match_scalars(sample.device, sample.dtype, kind):
            return None
        return cls(scheduler, kind, buffers, workspace)

    def step(self, timestep: torch.Tensor, sample: torch.Tensor, cond: torch.Tensor,
             uncond: torch.Tensor | None = None, scale: float | None = None) -> Generator[WorkItem, Any, torch.Tensor]:
        """`scheduler.step(guided, timestep, sample)[0]` with `guided = uncond + scale * (cond - uncond)` (or
        `cond` alone), as an immediate work item shared with the other requests' updates of this step."""
        scheduler = self.scheduler
        if scheduler.step_index is None:
            scheduler._init_step_index(timestep)
        sigma = None
        if self.kind == "flow":
            if self._dts is None or self._dts.device != scheduler.sigmas.device:
                # NOTE: sigmas[i + 1] - sigmas[i] for all i at once: the scheduler's own fp32 subtraction
                self._dts = scheduler.sigmas[1:] - scheduler.sigmas[:-1]
            dt = self._dts[scheduler.step_index]
        else:  # EulerDiscreteScheduler.step with gamma = 0: sigma_hat = sigma * (0 + 1), dt = next - sigma_hat
            sigma = scheduler.sigmas[scheduler.step_index] * 1.0
            dt = scheduler.sigmas[scheduler.step_index + 1] - sigma
        images = sample.shape[0]
        guided = uncond is not None
        buffer = targets = None
        if self.workspace is not None:  # write into this request's idle ping-pong buffer: no allocation
            buffer = self.workspace.idle_latents(sample, cond.dtype)
            targets = list(buffer)
        key = named_key(program=f"fused-{self.kind}", **{
            "true CFG or not": guided, "latent dtype": sample.dtype, "prediction dtype": cond.dtype,
            "latent size": tuple(sample.shape[1:]), "device": str(sample.device), "buffer pool": id(self.buffers),
            "own latent buffers or not": targets is not None})
        inputs = {
            "sample": list(sample), "cond": list(cond), "uncond": list(uncond) if guided else None,
            "dt": [dt] * images, "sigma": None if sigma is None else [sigma] * images, "scale": [float(scale)] * images if guided else None, "target": targets,
        }
        run = functools.partial(_fused_euler, self.buffers)
        prev = yield WorkItem("update", key, inputs, run, rows=images, immediate=True)
        scheduler._step_index += 1
        return buffer if buffer is not None else prev


def _fused_euler(buffers: LatentBuffers | None, sample, cond, uncond, dt, sigma, scale, target) -> torch.Tensor:
    """All rows' Euler step on the guided prediction, as the scheduler computes it: flow matching (`sigma` None)
    `sample.to(float32) + dt * guided`; Euler (epsilon) `s + (s - (s - sigma * guided)) / sigma * dt` with
    `s = sample.to(float32)`; then `.to(guided.dtype)`."""
    sample, cond = stack_rows(buffers, "update.sample", sample), stack_rows(buffers, "update.cond", cond)
    per_row = (-1,) + (1,) * (sample.dim() - 1)
    # NOTE: a CPU 0-dim operand with device tensors rounds like a Python number
    dt_like_number = dt[0].device.type == "cpu" and sample.device.type != "cpu"
    dt = stack_rows(buffers, "update.dt", dt).to(sample.device, non_blocking=True).view(per_row)
    noise = cond
    if uncond is not None:
        uncond = stack_rows(buffers, "update.uncond", uncond)
        scale = torch.tensor(scale, dtype=torch.float32).to(cond.device, non_blocking=True).view(per_row)
        # NOTE: uncond + scale * (cond - uncond), the order of FluxPipeline's and the workspace's combine
        difference = torch.sub(cond, uncond, out=scratch_like(buffers, "update.guided", cond))
        scaled = _times_scalar(difference, scale, like_number=True, out=difference)
        noise = torch.add(uncond, scaled, out=difference)
    if sigma is None:
        delta = _times_scalar(noise, dt, like_number=dt_like_number, out=scratch_like(buffers, "update.delta", noise))
    else:
        sigma = torch.stack(sigma).to(sample.device, non_blocking=True).view(per_row)
        upcast = sample.to(torch.float32)  # the scheduler's upcast (the same tensor when already float32)
        original = upcast - _times_scalar(noise, sigma, like_number=dt_like_number)
        derivative = _divided_by_scalar(upcast - original, sigma, like_number=dt_like_number)
        delta = derivative * dt
    if sample.dtype == torch.float32 and noise.dtype == torch.float32:
        prev = torch.add(sample, delta, out=scratch_like(buffers, "update.prev", sample))
    else:
        prev = (sample.to(torch.float32) + delta).to(noise.dtype)
    if target is not None:
        torch._foreach_copy_(list(target), list(prev.unbind(0)))
    return prev if target is not None or buffers is None else prev.clone()


def _times_scalar(x: torch.Tensor, per_row: torch.Tensor, like_number: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`s * x` for each row's own scalar s, rounded as torch rounds that scalar operand in a reduced-precision op:
    a Python number (or a CPU 0-dim tensor with a device tensor, `like_number`) enters at float32; a 0-dim
    tensor on x's device is first cast to x's dtype. float32 needs neither."""
    if x.dtype == torch.float32:
        return torch.mul(per_row, x, out=out)
    product = x.to(torch.float32) * per_row if like_number else per_row.to(x.dtype) * x
    return product.to(x.dtype) if out is None else out.copy_(product)


def _divided_by_scalar(x: torch.Tensor, per_row: torch.Tensor, like_number: bool) -> torch.Tensor:
    """`x / s` (float32) for each row's own s, as torch divides by that scalar: by a CPU scalar a device kernel
    multiplies by its reciprocal; otherwise a true division."""
    return x * torch.reciprocal(per_row) if like_number else x / per_row


@functools.lru_cache(maxsize=None)
def _rows_match_scalars_cached(device: str, dtype: torch.dtype, kind: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 257, generator=generator).to(device=device, dtype=dtype)
    scalars = torch.rand(4, generator=generator) * 2 - 1
    # (the operand as the scheduler or the pipeline passes it, whether it rounds like a number)
    forms = [(float, True), (lambda s: s.to(device), False)]
    if torch.device(device).type != "cpu":
        forms.append((lambda s: s, True))  # a 0-dim CPU tensor with a device tensor
    for operand, like_number in forms:
        reference = torch.stack([operand(s) * row for s, row in zip(scalars, x)])
        fused = _times_scalar(x, scalars.to(device).view(-1, 1), like_number)
        if reference.dtype != fused.dtype or not torch.equal(reference, fused):  # NOTE: a host read, once
            return False
    if kind == "euler":  # float32 divisions by each row's sigma
        wide = x.to(torch.float32)
        for operand, like_number in forms[1:]:
            reference = torch.stack([row / operand(s) for s, row in zip(scalars, wide)])
            if not torch.equal(reference, _divided_by_scalar(wide, scalars.to(device).view(-1, 1), like_number)):
                return False
    return True


def _rows_match_scalars(device: torch.device, dtype: torch.dtype, kind: str) -> bool:
    """Whether per-row scalars reproduce torch's scalar rounding bit for bit here (probed once)."""
    if dtype == torch.float32 and kind == "flow":
        return True
    with _probe_lock:
        return _rows_match_scalars_cached(str(device), dtype, kind)
