"""Shared by the drop-in tests: one tiny pipeline per family and the call every family takes."""

import torch

from .references import family_pipe, family_size, flux_pipe, seeded

FAMILIES = ["flux", "sd3-tiny", "qwen-tiny", "sdxl-euler", "sd-euler", "pixart-tiny"]


def pipe_for(name: str):
    pipe = flux_pipe("dev-tiny") if name == "flux" else family_pipe(name)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(name: str, **overrides) -> dict:
    height, width = (32, 32) if name == "flux" else family_size(name)
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0, output_type="pt")
    if name.startswith("pixart"):
        kwargs.update(use_resolution_binning=False, clean_caption=False, max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def run(fn, kwargs: dict) -> torch.Tensor:
    output = fn(**seeded(kwargs))
    return output[0] if isinstance(output, tuple) else output.images
