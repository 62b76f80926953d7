"""Qwen2.5-VL as a text encoder (Qwen-Image and its edit pipelines).

Prompt-only calls are rows. With images, `pixel_values` holds every image's patches in one sequence and
`image_grid_thw` one entry per image, not per prompt, so calls with images run alone.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLForConditionalGeneration

from . import ModelSupport, register_model


def _image_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("pixel_values") is not None:
        return "Qwen2.5-VL image patches are one sequence for the whole call, not rows"
    return None


@register_model(Qwen2_5_VLForConditionalGeneration)
def _qwen2_5_vl() -> ModelSupport:
    return ModelSupport(refusal=_image_refusal)
