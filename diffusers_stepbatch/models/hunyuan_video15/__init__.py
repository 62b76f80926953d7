"""HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`: HunyuanVideo15Pipeline and its image-to-video pipeline).

Rows: latents, both prompts with their masks, image embeds and timesteps are per row, and the model's text
reordering, refiner and masks work row by row. One decision is not: whether the call is text-to-video, read from
all image embeds at once (`torch.all(image_embeds == 0)`), so a row with an image beside rows without would lose
its image; calls merge by rows only with calls of the same kind (`merge_key`). `packing.py` packs calls of other
frame counts and sizes, each call's kind decided for its own rows; `teacache.py` is the per-row TeaCache forward
on top of it. Every LoRA layer sees rows on dim 0 (the token refiner and the image and ByT5 projections
included) or packed tokens, so per-request LoRA applies per row, packed too.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import HunyuanVideo15Transformer3DModel

from .. import ModelSupport, Packing, register_model
from .context_parallel import hunyuan_video15_context_parallel_plan
from .packing import hunyuan_video15_packing_unsupported, pack_calls, pack_key, token_rows
from .teacache import HUNYUAN_VIDEO15_COEFFICIENTS, teacache_call


def text_to_video(arguments: dict[str, Any]) -> bool | None:
    """Whether the model reads the call as text-to-video (all image embeds zero); None without image embeds."""
    image_embeds = arguments.get("image_embeds")
    return bool(torch.all(image_embeds == 0)) if isinstance(image_embeds, torch.Tensor) else None


@register_model(HunyuanVideo15Transformer3DModel)
def _hunyuan_video15() -> ModelSupport:
    return ModelSupport(merge_key=text_to_video, trusted=True,
                        packing=Packing(unsupported=hunyuan_video15_packing_unsupported, key=pack_key,
                                        run=pack_calls, token_rows=token_rows),
                        teacache_coefficients=HUNYUAN_VIDEO15_COEFFICIENTS, teacache_forward=teacache_call,
                        lora_rows=True, context_parallel=hunyuan_video15_context_parallel_plan)
