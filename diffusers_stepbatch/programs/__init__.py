"""The pipeline flow: step programs that read like a pipeline's `__call__` and yield work items.

`dedicated/` holds one program per pipeline family, `generic/` the program for every other pipeline (its own
`__call__` per request, model calls intercepted), `checks/` the input checks, `pid/` PiD early exit; beside them
the shared parts: the registry, planning options, request views, CFG, callbacks, the fused update, cache hooks.
Importing this package registers every program.
"""

from . import dedicated  # noqa: F401  (registers the family programs)
from . import generic  # noqa: F401  (registers the fallback for every other DiffusionPipeline)
from .registry import PlannedRequest, program_for, register_program, registered_pipelines, request_pipeline

__all__ = ["PlannedRequest", "program_for", "register_program", "registered_pipelines", "request_pipeline"]
