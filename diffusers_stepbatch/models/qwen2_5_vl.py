"""Qwen2.5-VL and Qwen3-VL as text encoders (Qwen-Image and its edit pipelines, Qwen-Image 2.1, Bria FIBO 2).

Prompt-only calls are rows. With images, `pixel_values` holds every image's patches in one sequence and
`image_grid_thw` one entry per image, not per prompt, so calls with images run alone.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, Qwen3VLModel

from . import ModelSupport, register_model


def _image_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("pixel_values") is not None:
        family = "Qwen2.5-VL" if isinstance(model, Qwen2_5_VLForConditionalGeneration) else "Qwen3-VL"
        return f"{family} image patches are one sequence for the whole call, not rows"
    return None


@register_model(Qwen2_5_VLForConditionalGeneration)
@register_model(Qwen3VLForConditionalGeneration)
@register_model(Qwen3VLModel)
def _vision_language_encoder() -> ModelSupport:
    return ModelSupport(refusal=_image_refusal)
