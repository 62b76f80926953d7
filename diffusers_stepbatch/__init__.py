"""diffusers-stepbatch: step-level continuous batching for Hugging Face diffusers pipelines.

>>> from diffusers_stepbatch import StepBatched
>>> pipe = StepBatched(pipe)          # any supported diffusers pipeline
>>> image = pipe("a cat").images[0]   # same call, same output; concurrent calls share batches
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache.prompt import PromptCache
    from .cache.teacache import TeaCacheConfig
    from .decoders.pid import PiDDecoder
    from .decoders.registry import PiDDecoding, register_decoder
    from .engine.core import EngineClosedError
    from .engine.request import RequestHandle, RequestStatus
    from .engine.scheduler import DeadlineUnmeetable, QueueFull, SchedulerConfig
    from .hook_mode import disable_step_batching, enable_step_batching, is_step_batching
    from .programs.cfg import CFGPolicy
    from .wrapper import StepBatched

__all__ = [
    "CFGPolicy",
    "DeadlineUnmeetable",
    "EngineClosedError",
    "PiDDecoder",
    "PiDDecoding",
    "PromptCache",
    "QueueFull",
    "RequestHandle",
    "RequestStatus",
    "SchedulerConfig",
    "StepBatched",
    "TeaCacheConfig",
    "disable_step_batching",
    "enable_step_batching",
    "is_step_batching",
    "register_decoder",
]
__version__ = "0.1.0"

# NOTE: names load on first use (PEP 562), so that `diffusers-stepbatch serve --help` and the server's flag parsing
# don't import torch and diffusers (seconds) before there is anything to run.
_LAZY = {
    "PromptCache": "cache.prompt",
    "TeaCacheConfig": "cache.teacache",
    "PiDDecoder": "decoders.pid",
    "PiDDecoding": "decoders.registry",
    "register_decoder": "decoders.registry",
    "EngineClosedError": "engine.core",
    "RequestHandle": "engine.request",
    "RequestStatus": "engine.request",
    "DeadlineUnmeetable": "engine.scheduler",
    "QueueFull": "engine.scheduler",
    "SchedulerConfig": "engine.scheduler",
    "disable_step_batching": "hook_mode",
    "enable_step_batching": "hook_mode",
    "is_step_batching": "hook_mode",
    "CFGPolicy": "programs.cfg",
    "StepBatched": "wrapper",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # the next lookup is a plain module attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
