"""What a call is planned with besides its arguments: the engine's reducers, PiD early exit, its `adapters=`.

>>> planned = plan(pipe, call_args, PlanContext(options=ProgramOptions(prompt_cache=PromptCache())))
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from ..adapters.state import NOT_GIVEN
from ..buffers import LatentBuffers
from ..cache.prompt import PromptCache
from ..cache.teacache import TeaCacheConfig
from ..decoders.registry import PiDDecoding
from .cfg import CFGPolicy


@dataclass(frozen=True)
class ProgramOptions:
    """Reducers in force for one request.

    Args:
        prompt_cache: text-encoder outputs cache; None encodes every time.
        teacache: TeaCache settings for this request; None runs every step.
        cfg_policy: whether CFG branches share a forward.
        buffers: the engine's latent buffer pool; None allocates step tensors afresh.
        packed_attention: how a packed mixed-resolution call keeps attention inside each row
            (`models/packing/attention.py`: "auto", "recover_scatter", "flex", "varlen").
    """

    prompt_cache: PromptCache | None = None
    teacache: TeaCacheConfig | None = None
    cfg_policy: CFGPolicy = field(default_factory=lambda: CFGPolicy(mode="batched"))
    buffers: LatentBuffers | None = None
    packed_attention: str = "auto"


@dataclass(frozen=True)
class PiDExitOptions:
    """An engine's PiD decoding and where its requests leave the main model.

    Args:
        decoding: the PiD decoder, its text source and sampler.
        exit_step: K, the number of main-model steps before PiD takes over: an int in [1, N], or a fraction of
            the N steps in (0, 1] (rounded to the nearest step); None: N - 2 (at least 1). K = N hands PiD the
            clean latent (sigma 0).
    """

    decoding: PiDDecoding
    exit_step: int | float | None = None

    def __post_init__(self):
        step = self.exit_step
        if step is None:
            return
        if isinstance(step, bool) or not isinstance(step, numbers.Real):
            raise ValueError(f"pid_exit_step={step!r} must be a step index (int >= 1), a fraction in (0, 1] or None")
        if isinstance(step, numbers.Integral):
            if step < 1:
                raise ValueError(f"pid_exit_step={step} must be >= 1: the main model runs at least one step")
        elif not 0 < step <= 1:
            raise ValueError(f"pid_exit_step={step} as a fraction of the steps must be in (0, 1]")

    def step_for(self, num_steps: int) -> int:
        """K for a call of `num_steps` steps; ValueError when it falls outside [1, num_steps]."""
        step = self.exit_step
        if step is None:
            return max(num_steps - 2, 1)
        if isinstance(step, numbers.Integral):
            if step > num_steps:
                raise ValueError(
                    f"pid_exit_step={step} is beyond num_inference_steps={num_steps}; use a step in [1, {num_steps}] "
                    "or a fraction of the steps"
                )
            return int(step)
        exit_at = round(step * num_steps)
        if exit_at < 1:
            raise ValueError(
                f"pid_exit_step={step} of num_inference_steps={num_steps} rounds to step 0; use a larger fraction"
            )
        return exit_at


@dataclass
class PlanContext:
    """One call's planning context.

    Args:
        options: the reducers in force for the call.
        pid: the engine's PiD early exit; None decodes with the VAE.
        adapters: the call's `adapters=` argument (`NOT_GIVEN`: the pipeline's active adapters).
        views: the per-request pipeline views made while planning (`request_pipeline` appends them).
    """

    options: ProgramOptions = field(default_factory=ProgramOptions)
    pid: PiDExitOptions | None = None
    adapters: Any = NOT_GIVEN
    views: list = field(default_factory=list)
