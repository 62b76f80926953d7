"""Dedicated step programs, one per pipeline family; importing this package registers them."""

from . import flux  # noqa: F401  (registers FluxPipeline)
from . import qwenimage  # noqa: F401  (registers QwenImagePipeline)
from . import sd  # noqa: F401  (registers StableDiffusionPipeline)
from . import sd3  # noqa: F401  (registers StableDiffusion3Pipeline)
from . import sdxl  # noqa: F401  (registers StableDiffusionXLPipeline)
