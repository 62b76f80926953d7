"""What a call is planned with besides its arguments: the engine's reducers, PiD early exit, its `adapters=`.

>>> planned = plan(pipe, call_args, PlanContext(options=ProgramOptions(prompt_cache=PromptCache())))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..adapters.state import NOT_GIVEN
from ..buffers import LatentBuffers
from ..cache.prompt import PromptCache
from ..cache.teacache import TeaCacheConfig
from .cfg import CFGPolicy

if TYPE_CHECKING:
    from .pid_exit import PiDExitOptions


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
