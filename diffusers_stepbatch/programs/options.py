"""The step-cost reducers a `StepBatched` engine hands to the step programs it plans.

`StepBatched.submit` plans each call inside `planning_with(options)`; a family's plan function reads
`current_options()` and keeps the result in its program. The call arguments stay exactly the pipeline's,
and a program that knows no reducers simply never asks.

>>> options = current_options()
>>> embeds = yield from cached_encode(options.prompt_cache, namespace, texts, make_item)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..buffers import LatentBuffers
from ..cache.prompt import PromptCache
from ..cache.teacache import TeaCacheConfig
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


_NO_REDUCERS = ProgramOptions()
_current: contextvars.ContextVar[ProgramOptions] = contextvars.ContextVar("stepbatch_program_options",
                                                                          default=_NO_REDUCERS)


def current_options() -> ProgramOptions:
    """The options of the call being planned (no reducers outside `planning_with`)."""
    return _current.get()


@contextlib.contextmanager
def planning_with(options: ProgramOptions) -> Iterator[None]:
    token = _current.set(options)
    try:
        yield
    finally:
        _current.reset(token)
