"""diffusers-stepbatch: step-level continuous batching for Hugging Face diffusers pipelines.

>>> from diffusers_stepbatch import StepBatched
>>> pipe = StepBatched(pipe)          # any supported diffusers pipeline
>>> image = pipe("a cat").images[0]   # same call, same output; concurrent calls share batches
"""

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
