"""Z-Image (`ZImageTransformer2DModel`: Z-Image, Z-Image-Turbo, img2img, inpaint, Omni).

The forward takes one list entry per image (latents `x`, captions `cap_feats`, and in omni mode SigLIP
features and noise masks) and pads and masks them itself, so images of different sizes and prompts of
different lengths share one call as they are; its output `sample` is a list with one entry per image.
ControlNet residuals come padded to the longest sequence of the call that made them, so those calls run alone.
`teacache.py` is the per-row TeaCache forward; `lora.py` maps the tokens the forward joins across rows (patches,
captions, SigLIP features) to their rows, so per-request LoRA applies per row.
"""

from __future__ import annotations

from typing import Any

from diffusers import ZImageTransformer2DModel

from .. import ModelSupport, register_model
from .context_parallel import z_image_context_parallel_plan
from .lora import lora_token_rows
from .teacache import Z_IMAGE_COEFFICIENTS, teacache_call


def _controlnet_refusal(model, arguments: dict[str, Any]) -> str | None:
    if arguments.get("controlnet_block_samples") is not None:
        return "Z-Image ControlNet residuals are padded to the longest sequence of their own call"
    return None


@register_model(ZImageTransformer2DModel)
def _z_image() -> ModelSupport:
    return ModelSupport(row_lists=("x", "cap_feats", "siglip_feats", "image_noise_mask"), output_lists_are_rows=True,
                        refusal=_controlnet_refusal, trusted=True, teacache_coefficients=Z_IMAGE_COEFFICIENTS,
                        teacache_forward=teacache_call, lora_rows=True, lora_token_rows=lora_token_rows,
                        context_parallel=z_image_context_parallel_plan)
