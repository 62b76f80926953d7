"""Step programs, one module per pipeline family; importing this package registers them all."""

from . import flux  # noqa: F401  (registers FluxPipeline)
from . import generic  # noqa: F401  (registers the fallback for every other DiffusionPipeline)
from . import qwenimage  # noqa: F401  (registers QwenImagePipeline)
from . import sd  # noqa: F401  (registers StableDiffusionPipeline)
from . import sd3  # noqa: F401  (registers StableDiffusion3Pipeline)
from . import sdxl  # noqa: F401  (registers StableDiffusionXLPipeline)
from .registry import PlannedRequest, program_for, register_program, registered_pipelines, request_pipeline

__all__ = ["PlannedRequest", "program_for", "register_program", "registered_pipelines", "request_pipeline"]
