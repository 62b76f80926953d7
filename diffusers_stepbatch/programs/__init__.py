"""Step programs, one module per pipeline family; importing this package registers them all."""

from . import flux  # noqa: F401  (registers FluxPipeline)
from .registry import PlannedRequest, program_for, register_program, registered_pipelines, request_pipeline

__all__ = ["PlannedRequest", "program_for", "register_program", "registered_pipelines", "request_pipeline"]
