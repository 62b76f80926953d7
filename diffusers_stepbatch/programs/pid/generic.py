"""PiD early exit for pipelines the generic program serves (FLUX.2, FLUX.2 klein and klein KV, Z-Image).

The pipeline's own `__call__` runs at 1/sr_scale of the requested size with `output_type="latent"`; a step
callback, chained after the caller's own, keeps the latents (and positive prompt embeddings) after step K and sets
the pipeline's `_interrupt`, so its loop skips the remaining steps (diffusers pipelines `continue` while
`self.interrupt`) and its VAE never runs. PiD then decodes that x_t at the requested size, batched with other
requests, and the call returns the pipeline's own output type:

>>> pid = plan_generic_pid_exit(pipe, args, context)     # None when the engine decodes with the VAE
>>> args = pid.call_args                                 # the call the pipeline runs
>>> program = pid.decoded(program)                       # its program, then the PiD decode
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from ...engine.batch import WorkItem
from ..callbacks import run_step_callback
from ..options import PlanContext
from .exit import PiDExit, pid_exit_decode, plan_pid_exit

_HANDED_OVER = ("latents", "prompt_embeds")


@dataclass
class _Capture:
    """What the step callback kept after step K: the request's view, its latents and positive prompt embeddings."""

    view: Any = None
    latents: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None


@dataclass
class GenericPiDExit:
    """One request's early exit through its pipeline's own loop."""

    pid: PiDExit
    args: dict[str, Any]  # the call as the caller made it (size, output type, generator, prompt)
    call_args: dict[str, Any]  # the call the pipeline runs: main size, latent output, the exit callback
    capture: _Capture = field(default_factory=_Capture)

    def decoded(self, program: Generator[WorkItem, Any, Any]) -> Generator[WorkItem, Any, Any]:
        """Run `program` (the pipeline call) to its end, then decode the kept x_t with PiD."""
        output = yield from program
        kept = self.capture
        if kept.latents is None:
            raise RuntimeError(
                f"the pipeline call ended before step pid_exit_step={self.pid.exit_step} (was it interrupted?); "
                "PiD has no latent to decode"
            )
        images = yield from pid_exit_decode(kept.view, self.pid, self.args, kept.latents, kept.prompt_embeds)
        if isinstance(output, tuple):  # return_dict=False
            return (images,)
        return type(output)(images=images)


def plan_generic_pid_exit(pipe: Any, args: dict[str, Any], context: PlanContext) -> GenericPiDExit | None:
    """Validate the call for PiD early exit (in the caller's thread) and build the call the pipeline runs."""
    pid = plan_pid_exit(pipe, args, context)
    if pid is None:
        return None
    exit_ = GenericPiDExit(pid, args, {})
    user = args.get("callback_on_step_end")
    user_inputs = list(args.get("callback_on_step_end_tensor_inputs") or [])
    if isinstance(user, (PipelineCallback, MultiPipelineCallbacks)):
        user_inputs = list(user.tensor_inputs)
    exit_.call_args = {
        **args,
        "height": pid.main_height,
        "width": pid.main_width,
        "output_type": "latent",
        "callback_on_step_end": _exit_callback(exit_, user, user_inputs),
        "callback_on_step_end_tensor_inputs": list(dict.fromkeys([*user_inputs, *_HANDED_OVER])),
    }
    return exit_


def _exit_callback(exit_: GenericPiDExit, user: Any, user_inputs: list[str]):
    last = exit_.pid.exit_step - 1

    def on_step_end(view: Any, step: int, timestep: Any, tensors: dict) -> dict:
        if user is not None and step <= last:
            # NOTE: the caller's callback sees only the tensors it asked for, as in a plain call
            tensors = {**tensors, **run_step_callback(user, view, step, timestep,
                                                      {k: tensors[k] for k in user_inputs})}
        if step == last:
            exit_.capture = _Capture(view, tensors["latents"], tensors["prompt_embeds"])
            view._interrupt = True  # NOTE: per request: the view's own flag; the loop skips the remaining steps
        return tensors

    return on_step_end
