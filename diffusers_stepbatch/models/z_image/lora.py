"""Which row each token of Z-Image's concatenated streams belongs to, for per-row LoRA.

`ZImageTransformer2DModel.forward` embeds all rows' patch tokens in one call (`all_x_embedder` on the rows'
padded patches joined along dim 0), likewise all captions (`cap_embedder`) and, in omni mode, all SigLIP features
(`siglip_embedder`); every other LoRA layer input holds the rows on dim 0: the timestep embedder's [rows, ...],
the refiners' and main layers' padded [rows, tokens, dim], the modulation and final layers. Each item (an image, a
caption, a SigLIP grid) is padded to a multiple of 32 tokens before it is joined (`_pad_with_ids`); a missing one
(None, omni mode) is 32 pad tokens.
"""

from __future__ import annotations

from typing import Any

import torch

_SEQ_MULTI_OF = 32  # as transformer_z_image.SEQ_MULTI_OF


def lora_token_rows(arguments: dict[str, Any]) -> list[torch.Tensor]:
    """`ModelSupport.lora_token_rows`: each token's row in the joined patch, caption (and SigLIP) inputs."""
    x, captions = arguments["x"], arguments["cap_feats"]
    patch, frame_patch = arguments.get("patch_size", 2), arguments.get("f_patch_size", 1)
    if isinstance(x[0], list):  # omni mode: per row, a list of images (None: a missing one) and of captions
        image_tokens = [sum(_image_tokens(item, patch, frame_patch) for item in items) for items in x]
        caption_tokens = [sum(_padded(len(item)) for item in items) for items in captions]
    else:
        image_tokens = [_image_tokens(item, patch, frame_patch) for item in x]
        caption_tokens = [_padded(len(item)) for item in captions]
    counts = [image_tokens, caption_tokens]
    siglip = arguments.get("siglip_feats")
    if siglip is not None and siglip[0] is not None:  # NOTE: the model embeds SigLIP features only then
        counts.append([sum(_siglip_tokens(item) for item in items or ()) for items in siglip])
    return [torch.arange(len(per_row)).repeat_interleave(torch.tensor(per_row)) for per_row in counts]


def _padded(tokens: int) -> int:
    return tokens + (-tokens) % _SEQ_MULTI_OF


def _image_tokens(image: torch.Tensor | None, patch: int, frame_patch: int) -> int:
    if image is None:
        return _SEQ_MULTI_OF
    _, frames, height, width = image.shape
    return _padded((frames // frame_patch) * (height // patch) * (width // patch))


def _siglip_tokens(features: torch.Tensor | None) -> int:
    if features is None:
        return _SEQ_MULTI_OF
    height, width, _ = features.shape
    return _padded(height * width)
