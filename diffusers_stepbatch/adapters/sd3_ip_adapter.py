"""IP-Adapter for the SD3 program: image tokens and scales per row, as StableDiffusion3Pipeline computes them.

SD3's IP-Adapter takes one image prompt per call and resamples it at each row's timestep inside the
transformer (`image_proj(embeds, timestep)`), so the embeddings are per-row inputs and requests at different
steps share forwards; each row gets its request's scale (`per_row_ip_scales`).

>>> ip = plan_sd3_ip_adapter(pipe, args, do_cfg=True)            # at submit, in the caller's thread
>>> embeds = yield from sd3_ip_image_embeds(pipe, view, ip, args, device, num_images, do_cfg)
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import torch

from ..engine.batch import WorkItem
from .ip_adapter import IPAdapterState, _image_key, _snapshot_scales


def sd3_ip_processors(transformer: torch.nn.Module) -> tuple:
    """The SD3 transformer's IP-Adapter attention processors, in `attn_processors` order."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0

    return tuple(p for p in transformer.attn_processors.values() if isinstance(p, SD3IPAdapterJointAttnProcessor2_0))


def plan_sd3_ip_adapter(pipe: Any, args: dict[str, Any], do_cfg: bool) -> IPAdapterState | None:
    """Validate a StableDiffusion3Pipeline call's IP-Adapter inputs; None when the transformer has none."""
    image, embeds = args.get("ip_adapter_image"), args.get("ip_adapter_image_embeds")
    processors = sd3_ip_processors(pipe.transformer)
    if not processors:
        if image is not None or embeds is not None:
            raise ValueError("ip_adapter_image / ip_adapter_image_embeds need an IP-Adapter on the transformer: "
                             "pipe.load_ip_adapter(...) first")
        return None
    if image is not None and embeds is not None:
        raise ValueError("pass either ip_adapter_image or ip_adapter_image_embeds, not both")
    if embeds is not None:
        rows = 2 if do_cfg else 1
        if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3 or embeds.shape[0] != rows:
            shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ValueError(f"ip_adapter_image_embeds is {shape}; SD3 takes one tensor [{rows}, tokens, dim]"
                             f"{' ([negative, positive] under CFG)' if do_cfg else ''}")
    if image is not None:
        count = image.shape[0] if isinstance(image, torch.Tensor) and image.ndim == 4 else (
            len(image) if isinstance(image, list) else 1)
        if count != 1:
            raise ValueError(f"ip_adapter_image has {count} images; SD3's IP-Adapter takes one image prompt per call")
        if getattr(pipe, "image_encoder", None) is None:
            raise ValueError("ip_adapter_image needs pipe.image_encoder (a SiglipVisionModel, see load_ip_adapter); "
                             "or pass ip_adapter_image_embeds")
    # NOTE: as the pipeline does, an image is used only while some scale is > 0 at the call (is_ip_adapter_active);
    # given embeddings are used at any scale.
    active = any(scale > 0 for scale in _snapshot_scales(processors, True))
    has_image = embeds is not None or (image is not None and active)
    if has_image and args.get("skip_guidance_layers") is not None:
        raise ValueError("skip_guidance_layers with an SD3 IP-Adapter image prompt is not supported: the pipeline "
                         "feeds the skip-layer forward the image tokens of the whole CFG batch (twice its rows); "
                         "drop skip_guidance_layers or the image prompt")
    return IPAdapterState(processors, _snapshot_scales(processors, has_image), has_image)


def sd3_ip_image_embeds(pipe: Any, view: Any, state: IPAdapterState, args: dict[str, Any], device: Any,
                        num_images: int, do_cfg: bool) -> Generator[WorkItem, Any, torch.Tensor]:
    """The request's image embeddings as the pipeline prepares them ([negative, positive] rows under CFG).

    Without an image prompt: zero embeddings at scale 0, as many tokens as the encoder gives (to share forwards).
    """
    embeds = args.get("ip_adapter_image_embeds")
    if not state.has_image:
        width = pipe.transformer.image_proj.proj_in.in_features
        embeds = torch.zeros(2 if do_cfg else 1, _encoder_tokens(pipe), width, device=device,
                             dtype=pipe.transformer.dtype)
    elif embeds is None:
        image = args["ip_adapter_image"]
        rows = image if isinstance(image, (torch.Tensor, list)) else [image]
        run = functools.partial(_encode_image, pipe, device)
        positive = yield WorkItem("encode", _image_key("sd3.ip_image", rows, device), {"image": rows}, run, rows=1)
        embeds = torch.cat([torch.zeros_like(positive), positive]) if do_cfg else positive
    return view.prepare_ip_adapter_image_embeds(None, embeds, device, num_images, do_cfg)


def _encoder_tokens(pipe: Any) -> int:
    """Tokens per image of the pipeline's image encoder (a ViT's patches, SigLIP has no class token); 1 without one."""
    encoder = getattr(pipe, "image_encoder", None)
    config = getattr(getattr(encoder, "config", None), "vision_config", None) or getattr(encoder, "config", None)
    if config is None or not hasattr(config, "image_size"):
        return 1
    return (config.image_size // config.patch_size) ** 2 + (0 if "siglip" in config.model_type else 1)


def _encode_image(pipe: Any, device: Any, image: Any) -> torch.Tensor:
    return pipe.encode_image(image, device)
