"""HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`: HunyuanVideo15Pipeline and its image-to-video pipeline).

Rows: latents, both prompts with their masks, image embeds and timesteps are per row, and the model's text
reordering, refiner and masks work row by row. One decision is not: whether the call is text-to-video, read from
all image embeds at once (`torch.all(image_embeds == 0)`), so a row with an image beside rows without would lose
its image. Text-to-video calls (zero image embeds) merge by rows at equal sizes and pack at other sizes through
`packing.py`; image-conditioned calls run alone.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import HunyuanVideo15Transformer3DModel

from .. import ModelSupport, Packing, register_model
from .packing import hunyuan_video15_packing_unsupported, pack_calls, pack_key


def _image_conditioned(model: torch.nn.Module, arguments: dict[str, Any]) -> str | None:
    image_embeds = arguments.get("image_embeds")
    if isinstance(image_embeds, torch.Tensor) and not bool(torch.all(image_embeds == 0)):
        return ("its image embeds decide text-to-video for the whole batch (torch.all(image_embeds == 0)), so an "
                "image-conditioned call can't share a forward with other calls")
    return None


@register_model(HunyuanVideo15Transformer3DModel)
def _hunyuan_video15() -> ModelSupport:
    return ModelSupport(refusal=_image_conditioned, trusted=True,
                        packing=Packing(unsupported=hunyuan_video15_packing_unsupported, key=pack_key,
                                        run=pack_calls))
