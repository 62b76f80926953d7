"""Model presets: the call defaults a model's card recommends (steps, guidance / true CFG, sequence length, the
size it was trained for), the sizes it draws and a step cap, applied by `serve --model ID`.

A preset is found by Hub id; for a local folder (or a Hub id not in the table) by the pipeline class, told
apart by the folder's `model_index.json` and component configs where one class serves several models (FLUX.1
dev / schnell, FLUX.2 klein base / distilled). Sources: docs/reference/presets.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_STEPS = 100


@dataclass(frozen=True)
class ModelPreset:
    """What a model's card recommends.

    Args:
        hub_id: the card's model id; pipeline: the diffusers pipeline class it loads as.
        call_defaults: pipeline arguments every request gets unless it sets them.
        min_side, max_side, max_aspect: the sizes the card shows it drawing (the model's own limits narrow them).
        max_steps: the most `num_inference_steps` a request may ask for.
        fits: for a local folder of the same class: whether its `model_index.json` and pipeline are this model.
    """

    hub_id: str
    pipeline: str
    call_defaults: dict[str, Any]
    min_side: int = 256
    max_side: int = 2048
    max_aspect: float = 3.0
    max_steps: int = DEFAULT_MAX_STEPS
    fits: Callable[[dict[str, Any], Any], bool] | None = field(default=None, compare=False)

    @property
    def card(self) -> str:
        return f"https://huggingface.co/{self.hub_id}"


def _flux_guidance_distilled(index: dict[str, Any], pipe: Any) -> bool:
    return bool(getattr(getattr(getattr(pipe, "transformer", None), "config", None), "guidance_embeds", False))


def _klein_distilled(index: dict[str, Any], pipe: Any) -> bool:
    return bool(index.get("is_distilled", getattr(getattr(pipe, "config", None), "is_distilled", False)))


def _not(predicate: Callable[[dict[str, Any], Any], bool]) -> Callable[[dict[str, Any], Any], bool]:
    return lambda index, pipe: not predicate(index, pipe)


def _square(side: int) -> dict[str, int]:
    return {"height": side, "width": side}


_KLEIN_DISTILLED = {**_square(1024), "num_inference_steps": 4, "guidance_scale": 1.0}
_KLEIN_BASE = {**_square(1024), "num_inference_steps": 50, "guidance_scale": 4.0}

# NOTE: the first preset of a pipeline class is that class's default for folders no `fits` tells apart.
PRESETS: tuple[ModelPreset, ...] = (
    ModelPreset("Tongyi-MAI/Z-Image-Turbo", "ZImagePipeline",
                {**_square(1024), "num_inference_steps": 9, "guidance_scale": 0.0}, min_side=512),
    ModelPreset("Tongyi-MAI/Z-Image", "ZImagePipeline",
                {**_square(1024), "num_inference_steps": 50, "guidance_scale": 4.0}, min_side=512),
    ModelPreset("black-forest-labs/FLUX.2-dev", "Flux2Pipeline",
                {**_square(1024), "num_inference_steps": 50, "guidance_scale": 4.0}, max_side=2048),
    ModelPreset("black-forest-labs/FLUX.2-klein-4B", "Flux2KleinPipeline", _KLEIN_DISTILLED, fits=_klein_distilled),
    ModelPreset("black-forest-labs/FLUX.2-klein-9B", "Flux2KleinPipeline", _KLEIN_DISTILLED, fits=_klein_distilled),
    ModelPreset("black-forest-labs/FLUX.2-klein-base-4B", "Flux2KleinPipeline", _KLEIN_BASE,
                fits=_not(_klein_distilled)),
    ModelPreset("black-forest-labs/FLUX.2-klein-base-9B", "Flux2KleinPipeline", _KLEIN_BASE,
                fits=_not(_klein_distilled)),
    ModelPreset("black-forest-labs/FLUX.1-dev", "FluxPipeline",
                {**_square(1024), "num_inference_steps": 50, "guidance_scale": 3.5, "max_sequence_length": 512},
                fits=_flux_guidance_distilled),
    ModelPreset("black-forest-labs/FLUX.1-schnell", "FluxPipeline",
                {**_square(1024), "num_inference_steps": 4, "guidance_scale": 0.0, "max_sequence_length": 256},
                max_steps=50, fits=_not(_flux_guidance_distilled)),
    ModelPreset("black-forest-labs/FLUX.1-Kontext-dev", "FluxKontextPipeline",
                {"num_inference_steps": 28, "guidance_scale": 2.5}),
    ModelPreset("Qwen/Qwen-Image", "QwenImagePipeline",
                {**_square(1328), "num_inference_steps": 50, "true_cfg_scale": 4.0, "negative_prompt": " "},
                min_side=512),
    ModelPreset("Qwen/Qwen-Image-2512", "QwenImagePipeline",
                {**_square(1328), "num_inference_steps": 50, "true_cfg_scale": 4.0, "negative_prompt": " "},
                min_side=512),
    ModelPreset("Qwen/Qwen-Image-Edit", "QwenImageEditPipeline",
                {"num_inference_steps": 50, "true_cfg_scale": 4.0, "negative_prompt": " "}, min_side=512),
    ModelPreset("Qwen/Qwen-Image-Edit-2509", "QwenImageEditPlusPipeline",
                {"num_inference_steps": 40, "true_cfg_scale": 4.0, "guidance_scale": 1.0, "negative_prompt": " "},
                min_side=512),
    ModelPreset("Qwen/Qwen-Image-Edit-2511", "QwenImageEditPlusPipeline",
                {"num_inference_steps": 40, "true_cfg_scale": 4.0, "guidance_scale": 1.0, "negative_prompt": " "},
                min_side=512),
    ModelPreset("stabilityai/stable-diffusion-3.5-large", "StableDiffusion3Pipeline",
                {**_square(1024), "num_inference_steps": 28, "guidance_scale": 3.5}, max_side=1536),
    ModelPreset("stabilityai/stable-diffusion-3.5-large-turbo", "StableDiffusion3Pipeline",
                {**_square(1024), "num_inference_steps": 4, "guidance_scale": 0.0}, max_side=1536, max_steps=50),
    ModelPreset("stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline",
                {**_square(1024), "num_inference_steps": 40, "guidance_scale": 4.5}, max_side=1536),
    ModelPreset("stabilityai/stable-diffusion-xl-base-1.0", "StableDiffusionXLPipeline",
                {**_square(1024), "num_inference_steps": 50, "guidance_scale": 5.0}, min_side=512, max_side=1536),
    ModelPreset("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "WanPipeline",
                {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0}),
    ModelPreset("Wan-AI/Wan2.1-T2V-14B-Diffusers", "WanPipeline",
                {"height": 720, "width": 1280, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0}),
    ModelPreset("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "WanImageToVideoPipeline",
                {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0}),
    ModelPreset("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanPipeline",
                {"height": 720, "width": 1280, "num_frames": 81, "num_inference_steps": 40, "guidance_scale": 4.0,
                 "guidance_scale_2": 3.0}),
    ModelPreset("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "WanImageToVideoPipeline",
                {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 40, "guidance_scale": 3.5}),
    ModelPreset("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "WanPipeline",
                {"height": 704, "width": 1280, "num_frames": 121, "num_inference_steps": 50, "guidance_scale": 5.0}),
    ModelPreset("Lightricks/LTX-2", "LTX2Pipeline",
                {"height": 512, "width": 768, "num_frames": 121, "frame_rate": 24.0, "num_inference_steps": 40,
                 "guidance_scale": 4.0}),
    ModelPreset("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", "HunyuanVideo15Pipeline",
                {"height": 480, "width": 848, "num_frames": 121, "num_inference_steps": 50}),
    ModelPreset("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v", "HunyuanVideo15Pipeline",
                {"height": 720, "width": 1280, "num_frames": 121, "num_inference_steps": 50}),
)
_BY_ID = {preset.hub_id.lower(): preset for preset in PRESETS}


def preset_named(hub_id: str) -> ModelPreset:
    """The preset of `hub_id` (`--preset`); a ValueError listing the known ids otherwise."""
    preset = _BY_ID.get(hub_id.strip().lower())
    if preset is None:
        raise ValueError(f"preset={hub_id!r} is not a known model; known: {', '.join(p.hub_id for p in PRESETS)}")
    return preset


def find_preset(model: str, pipe: Any) -> ModelPreset | None:
    """The preset for `model` (a Hub id or a local folder) loaded as `pipe`, or None.

    >>> find_preset("black-forest-labs/FLUX.1-schnell", pipe).call_defaults["num_inference_steps"]
    4
    """
    if model.strip().lower() in _BY_ID:
        return _BY_ID[model.strip().lower()]
    index = _model_index(model)
    name = index.get("_class_name") or type(pipe).__name__
    candidates = [p for p in PRESETS if p.pipeline == name and (p.fits is None or p.fits(index, pipe))]
    if not candidates:
        return None
    # NOTE: a folder often keeps the model's name ("./Z-Image-Turbo"): the longest id it names wins
    named = [p for p in candidates if p.hub_id.split("/")[-1].lower() in os.path.basename(model.rstrip("/")).lower()]
    chosen = max(named, key=lambda p: len(p.hub_id)) if named else candidates[0]
    logger.info("%s: %s's preset (%s)", model, chosen.hub_id, chosen.card)
    return chosen


def _model_index(model: str) -> dict[str, Any]:
    path = os.path.join(model, "model_index.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)
