"""A trained miniature FLUX text-to-image pipeline for toy shapes, shipped with the package (offline demo model).

>>> from diffusers_stepbatch.toy import load_pipeline
>>> image = load_pipeline()("a red circle at the top left on a white background", height=64, width=64).images[0]

Captions follow `a {color} {shape} {position} on a {background} background` (`toy.scenes`); it draws every size
in `build.supported_sizes()` (48-128 px, aspect 1:2 to 2:1); guidance-distilled: one forward per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import FluxPipeline

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
NATIVE_SIZE = 64
MAX_SEQUENCE_LENGTH = 16
DEFAULT_STEPS = 20
DEFAULT_GUIDANCE = 3.5

__all__ = ["DEFAULT_GUIDANCE", "DEFAULT_STEPS", "MAX_SEQUENCE_LENGTH", "NATIVE_SIZE", "WEIGHTS_DIR", "load_pipeline"]


def load_pipeline(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> FluxPipeline:
    """Load the shipped `ToyFluxPipeline` (`toy.pipeline`) from `WEIGHTS_DIR`, offline; sizes default to 64 x 64."""
    from .pipeline import ToyFluxPipeline

    if not (WEIGHTS_DIR / "model_index.json").is_file():
        raise FileNotFoundError(
            f"no toy weights at {WEIGHTS_DIR}; train them with "
            f"`python -m diffusers_stepbatch.toy.train --out {WEIGHTS_DIR}`"
        )
    pipe = ToyFluxPipeline.from_pretrained(WEIGHTS_DIR, dtype=dtype, local_files_only=True)
    # NOTE: FluxPipeline derives the default height/width as default_sample_size * vae_scale_factor (1024).
    pipe.default_sample_size = NATIVE_SIZE // pipe.vae_scale_factor
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)
