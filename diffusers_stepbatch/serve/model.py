"""`ServingModel`: the engine a server runs, its public name and the call arguments it fills in by default."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from .config import TOY_MODEL, ServeConfig

logger = logging.getLogger(__name__)


@dataclass
class ServingModel:
    """One `StepBatched` engine behind a server.

    Args:
        sb: the engine.
        name: the model name clients pass as `model` (`/v1/models` lists it).
        call_defaults: pipeline arguments every request gets unless it sets them (the toy model's
            `max_sequence_length=16`, its native size and steps).
    """

    sb: Any
    name: str
    call_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = 0

    def __post_init__(self):
        self.parameters = frozenset(inspect.signature(type(self.sb.pipe).__call__).parameters)

    def accepts(self, argument: str) -> bool:
        """Whether the wrapped pipeline's `__call__` takes `argument`."""
        return argument in self.parameters

    @property
    def default_size(self) -> tuple[int, int]:
        """(width, height) of a request without `size`."""
        pipe = self.sb.pipe
        fallback = getattr(pipe, "default_sample_size", 64) * getattr(pipe, "vae_scale_factor", 8)
        return self.call_defaults.get("width", fallback), self.call_defaults.get("height", fallback)

    def close(self) -> None:
        self.sb.close()


def load_model(config: ServeConfig) -> ServingModel:
    """Load the pipeline `config.model` names and wrap it in a `StepBatched` engine.

    >>> model = load_model(ServeConfig())   # the toy model: offline, ~0.2 s
    """
    import time

    import torch

    from ..cache.teacache import TeaCacheConfig
    from ..wrapper import StepBatched

    dtype = getattr(torch, config.dtype)
    if config.model == TOY_MODEL:
        from ..toy import DEFAULT_GUIDANCE, DEFAULT_STEPS, MAX_SEQUENCE_LENGTH, NATIVE_SIZE, load_pipeline

        pipe = load_pipeline(device=config.device, dtype=dtype)
        # NOTE: the toy model was trained on 16 text tokens; FluxPipeline's default of 512 pads far beyond that.
        defaults = {"height": NATIVE_SIZE, "width": NATIVE_SIZE, "num_inference_steps": DEFAULT_STEPS,
                    "guidance_scale": DEFAULT_GUIDANCE, "max_sequence_length": MAX_SEQUENCE_LENGTH}
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(config.model, dtype=dtype).to(config.device)
        defaults = {}
    pipe.set_progress_bar_config(disable=True)
    sb = StepBatched(
        pipe,
        scheduler=config.scheduler_config(),
        teacache=None if config.teacache is None else TeaCacheConfig(threshold=config.teacache),
        decoder=config.decoder,
        pid_exit_step=config.pid_exit_step,
    )
    logger.info("serving %s as %r: %r", config.model, config.model_name, sb)
    return ServingModel(sb=sb, name=config.model_name, call_defaults=defaults, created=int(time.time()))
