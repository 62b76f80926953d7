"""IP-Adapter for the SD, SDXL and Flux programs (SD3: `sd3_ip_adapter.py`): embeddings and scales per row.

diffusers keeps IP-Adapter scales on the UNet's attention processors (`pipe.set_ip_adapter_scale`), global
state like LoRA weights. A request reads them at submit and keeps its own copy; `set_ip_adapter_scale` called on
the request's pipeline view (as `IPAdapterScaleCutoffCallback` does) changes that copy only. During a forward,
`per_row_ip_scales` hands each IP processor a per-row scale, so requests with different scales, images, and
requests without an image prompt (zero embeddings at scale 0: exactly the model without its image branch)
share one UNet forward.

>>> ip = plan_ip_adapter(pipe, args, do_cfg=True)           # at submit, in the caller's thread
>>> embeds = yield from ip_image_embeds(pipe, view, ip, args, device, num_images, do_cfg)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import NamedKey, named_key
from ..module_scan import marked_modules

_SCALES_LOCK = threading.Lock()  # submit-time reads vs a request's set_ip_adapter_scale (see bind_scale_setter)


def ip_processors(model: torch.nn.Module) -> tuple:
    """The IP-Adapter attention processors of a UNet or Flux transformer, in `attn_processors` order."""
    from diffusers.models.attention_processor import (
        IPAdapterAttnProcessor,
        IPAdapterAttnProcessor2_0,
        IPAdapterXFormersAttnProcessor,
    )
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    kinds = (IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0, IPAdapterXFormersAttnProcessor,
             FluxIPAdapterAttnProcessor)
    # NOTE: `model.attn_processors` order (pre-order over the modules that have `get_processor`), walked cheaply.
    processors = (sub.get_processor() for _, sub in marked_modules(model) if hasattr(type(sub), "get_processor"))
    return tuple(p for p in processors if isinstance(p, kinds))


def _read_scale(processor: Any) -> Any:
    """A processor's scale: a list (one entry per adapter; UNet and Flux) or one float (SD3)."""
    return copy.deepcopy(list(processor.scale)) if isinstance(processor.scale, list) else float(processor.scale)


def _snapshot_scales(processors: tuple, has_image: bool) -> list:
    if not has_image:  # NOTE: a request without an image prompt runs at scale 0 (zero embeddings)
        return [[0.0] * len(p.scale) if isinstance(p.scale, list) else 0.0 for p in processors]
    with _SCALES_LOCK:
        return [_read_scale(p) for p in processors]


@dataclass
class IPAdapterState:
    """One request's IP-Adapter: the processors it was planned against and its own scales (one list per
    processor, one entry per adapter: a float, or a list of per-image floats with masks)."""

    processors: tuple
    scales: list
    has_image: bool
    masks: list | None = None  # UNet: `ip_adapter_masks`, one tensor (or None) per adapter (adapters/ip_masks.py)

    def row(self) -> tuple[tuple, list]:
        return self.processors, self.scales


def plan_ip_adapter(pipe: Any, args: dict[str, Any], do_cfg: bool, num_images: int = 1) -> IPAdapterState | None:
    """Validate a call's IP-Adapter inputs; None when the UNet has no IP-Adapter (and none was asked for)."""
    from .ip_masks import plan_ip_masks

    images, embeds = args.get("ip_adapter_image"), args.get("ip_adapter_image_embeds")
    has_image = images is not None or embeds is not None
    processors = ip_processors(pipe.unet)
    masks = plan_ip_masks(args, len(pipe.unet.encoder_hid_proj.image_projection_layers) if processors else 0,
                          num_images * (2 if do_cfg else 1))
    if masks is not None and not has_image:
        raise ValueError("cross_attention_kwargs['ip_adapter_masks'] needs an image prompt: pass ip_adapter_image "
                         "or ip_adapter_image_embeds")
    if not processors:
        if has_image:
            raise ValueError("ip_adapter_image / ip_adapter_image_embeds need an IP-Adapter on the UNet: "
                             "pipe.load_ip_adapter(...) first")
        return None
    layers = pipe.unet.encoder_hid_proj.image_projection_layers
    if images is not None:
        images = images if isinstance(images, list) else [images]
        if len(images) != len(layers):
            raise ValueError(f"ip_adapter_image has {len(images)} entries for {len(layers)} IP-Adapters; "
                             "pass one image (or list of images) per IP-Adapter")
        if getattr(pipe, "image_encoder", None) is None:
            raise ValueError("ip_adapter_image needs pipe.image_encoder (load_ip_adapter(..., "
                             "image_encoder_folder=...)); or pass ip_adapter_image_embeds")
    if embeds is not None:
        if len(embeds) != len(layers):
            raise ValueError(f"ip_adapter_image_embeds has {len(embeds)} tensors for {len(layers)} IP-Adapters")
        rows = 2 if do_cfg else 1
        for i, tensor in enumerate(embeds):
            if tensor.shape[0] != rows:
                raise ValueError(f"ip_adapter_image_embeds[{i}] has {tensor.shape[0]} rows; with"
                                 f"{'' if do_cfg else 'out'} CFG pass {rows} ([negative, positive] under CFG)")
    if not has_image:
        from diffusers.models.embeddings import ImageProjection

        if not all(isinstance(layer, ImageProjection) for layer in layers):
            raise ValueError("this UNet's IP-Adapter needs an image prompt (diffusers raises without one): pass "
                             "ip_adapter_image or ip_adapter_image_embeds (with set_ip_adapter_scale(0.0))")
    return IPAdapterState(processors, _snapshot_scales(processors, has_image), has_image, masks)


def ip_key_fields(state: IPAdapterState, embed_shapes: Sequence[tuple]) -> NamedKey:
    """The denoise key's IP-Adapter part: rows of one forward share the IP processors and embedding shapes."""
    return named_key(**{"ip_adapter: processors": tuple(map(id, state.processors)),
                        "ip_adapter: image embedding shapes (images per adapter)": tuple(embed_shapes)})


def bind_scale_setter(view: Any, pipe: Any, state: IPAdapterState) -> None:
    """`view.set_ip_adapter_scale(...)` (e.g. from `IPAdapterScaleCutoffCallback`) sets this request's scales."""
    view.__dict__["set_ip_adapter_scale"] = functools.partial(_set_request_scale, pipe, state)


def _set_request_scale(pipe: Any, state: IPAdapterState, scale: Any) -> None:
    # NOTE: diffusers' own set_ip_adapter_scale computes the per-processor values (block dicts and all); it
    # writes them on the shared processors, so read them back for this request and put the old ones back.
    if not state.has_image:
        return  # a request without an image prompt stays at scale 0
    with _SCALES_LOCK:
        saved = [_read_scale(p) for p in state.processors]
        try:
            type(pipe).set_ip_adapter_scale(pipe, scale)
            state.scales = [_read_scale(p) for p in state.processors]
        finally:
            for processor, values in zip(state.processors, saved):
                processor.scale = values


def ip_image_embeds(pipe: Any, view: Any, state: IPAdapterState, args: dict[str, Any], device: Any,
                    num_images: int, do_cfg: bool) -> Generator[WorkItem, Any, list[torch.Tensor]]:
    """The request's image embeddings as the pipeline prepares them (one tensor per adapter, CFG rows first).

    Images are encoded in batched work items (one per adapter, shared with other requests' images).
    """
    layers = pipe.unet.encoder_hid_proj.image_projection_layers
    embeds = args.get("ip_adapter_image_embeds")
    if not state.has_image:  # zero embeddings at scale 0: the model without its image branch
        embeds = [torch.zeros(2 if do_cfg else 1, 1, layer.image_embeds.in_features, device=device,
                              dtype=pipe.unet.dtype) for layer in layers]
    elif embeds is None:
        from diffusers.models.embeddings import ImageProjection

        images = args["ip_adapter_image"]
        images = images if isinstance(images, list) else [images]
        embeds = []
        for single, layer in zip(images, layers):
            hidden = not isinstance(layer, ImageProjection)
            rows = single if isinstance(single, (torch.Tensor, list)) else [single]
            key = _image_key("unet.ip_image", rows, device, hidden)
            run = functools.partial(_encode_images, pipe, device, hidden)
            count = rows.shape[0] if isinstance(rows, torch.Tensor) else len(rows)
            positive, negative = yield WorkItem("encode", key, {"image": rows}, run, rows=count)
            embeds.append(torch.stack([negative, positive]) if do_cfg else positive[None])
    return view.prepare_ip_adapter_image_embeds(None, embeds, device, num_images, do_cfg)


def _image_key(program: str, rows: Any, device: Any, hidden: bool = False) -> Any:
    """Images of one kind (tensors, or a list of PIL images / arrays) go through the encoder together."""
    kind = ("batched tensor" if isinstance(rows, torch.Tensor)
            else "tensors" if isinstance(rows[0], torch.Tensor) else "images")
    return named_key(program=program, **{"image encoder output (hidden states)": hidden, "image type": kind,
                                         "device": str(device)})


def _encode_images(pipe: Any, device: Any, output_hidden_states: bool, image: Any) -> tuple:
    return pipe.encode_image(image, device, 1, output_hidden_states)


_FLUX_INPUTS = ("ip_adapter_image", "ip_adapter_image_embeds", "negative_ip_adapter_image",
                "negative_ip_adapter_image_embeds")


def plan_flux_ip_adapter(pipe: Any, args: dict[str, Any]) -> IPAdapterState | None:
    """Validate a FluxPipeline call's IP-Adapter inputs; None when the transformer has no IP-Adapter."""
    has_image = any(args.get(name) is not None for name in _FLUX_INPUTS)
    processors = ip_processors(pipe.transformer)
    if not processors:
        if has_image:
            raise ValueError("ip_adapter_image(_embeds) / negative_ip_adapter_image(_embeds) need an IP-Adapter on "
                             "the transformer: pipe.load_ip_adapter(...) first")
        return None
    count = pipe.transformer.encoder_hid_proj.num_ip_adapters
    for name in _FLUX_INPUTS:
        value = args.get(name)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if len(values) != count:
            raise ValueError(f"{name} has {len(values)} entries for {count} IP-Adapters; pass one per IP-Adapter")
        if name.endswith("_embeds"):
            for i, tensor in enumerate(values):
                if tensor.ndim != 3 or tensor.shape[0] != 1:
                    raise ValueError(f"{name}[{i}] has shape {tuple(tensor.shape)}; pass [1, images, embed dim]")
        elif getattr(pipe, "image_encoder", None) is None:
            raise ValueError(f"{name} needs pipe.image_encoder; or pass {name}_embeds")
    return IPAdapterState(processors, _snapshot_scales(processors, has_image), has_image)


def flux_ip_image_embeds(pipe: Any, view: Any, state: IPAdapterState, args: dict[str, Any], device: Any,
                         num_images: int, height: int, width: int) -> Generator[WorkItem, Any, tuple[list, list]]:
    """(positive, negative) image embeddings as FluxPipeline prepares them, one tensor per adapter each.

    As the pipeline does, a missing side gets a black image; images are encoded in batched work items.
    """
    layers = pipe.transformer.encoder_hid_proj.image_projection_layers
    if not state.has_image:  # zero embeddings at scale 0: the model without its image branch
        zeros = [torch.zeros(num_images, 1, layer.image_embeds.in_features, device=device,
                             dtype=pipe.transformer.dtype) for layer in layers]
        return zeros, zeros
    black = [np.zeros((width, height, 3), dtype=np.uint8)] * len(layers)
    sides = []
    for prefix in ("", "negative_"):
        images, embeds = args.get(f"{prefix}ip_adapter_image"), args.get(f"{prefix}ip_adapter_image_embeds")
        if images is None and embeds is None:
            images = black
        if embeds is None:
            images = images if isinstance(images, list) else [images]
            embeds = []
            for single in images:
                rows = single if isinstance(single, (torch.Tensor, list)) else [single]
                count = rows.shape[0] if isinstance(rows, torch.Tensor) else len(rows)
                key = _image_key("flux.ip_image", rows, device)
                run = functools.partial(_encode_flux_images, pipe, device)
                embeds.append((yield WorkItem("encode", key, {"image": rows}, run, rows=count))[None])
        sides.append(view.prepare_ip_adapter_image_embeds(None, embeds, device, num_images))
    return sides[0], sides[1]


def _encode_flux_images(pipe: Any, device: Any, image: Any) -> torch.Tensor:
    return pipe.encode_image(image, device, 1)


class _RowScale:
    """An IP processor's scale for one adapter, one value per row: `scale == 0` only when every row's is."""

    def __init__(self, values: Sequence[float]):
        self.values = list(values)

    def __eq__(self, other: object) -> bool:
        return all(v == other for v in self.values)

    __hash__ = None

    def __mul__(self, tensor: torch.Tensor) -> torch.Tensor:
        coef = torch.tensor(self.values, dtype=tensor.dtype, device=tensor.device)
        return tensor * coef.view(-1, *([1] * (tensor.dim() - 1)))

    __rmul__ = __mul__


def _row_scale(values: list) -> Any:
    if all(not isinstance(v, list) for v in values):
        return _RowScale(values)
    count = max(len(v) for v in values if isinstance(v, list))
    per_image = [v if isinstance(v, list) else [v] * count for v in values]
    return [_RowScale([row[i] for row in per_image]) for i in range(count)]


@contextlib.contextmanager
def per_row_ip_scales(rows: Sequence[tuple[tuple, list] | None]) -> Iterator[None]:
    """Inside, each IP processor applies row r's own scales (`IPAdapterState.row()` per row)."""
    first = next((row for row in rows if row is not None), None)
    if first is None:
        yield
        return
    processors = first[0]
    with _SCALES_LOCK:  # NOTE: submit-time reads never see the per-row stand-ins
        saved = [p.scale for p in processors]
        swapped = []
        try:
            for k, processor in enumerate(processors):
                if isinstance(saved[k], list):
                    processor.scale = [_row_scale([row[1][k][i] for row in rows]) for i in range(len(saved[k]))]
                else:  # SD3: one scale per processor
                    processor.scale = _RowScale([row[1][k] for row in rows])
                swapped.append(processor.scale)
            yield
        finally:
            # NOTE: diffusers' set_ip_adapter_scale writes items in place; one that ran meanwhile (from another
            # thread) wrote into the stand-in list: keep what it wrote (SD3's replaces the float: keep that).
            for processor, values, stand_in in zip(processors, saved, swapped):
                if isinstance(stand_in, list):
                    processor.scale = [old if _is_stand_in(new) else new for old, new in zip(values, stand_in)]
                elif _is_stand_in(processor.scale):
                    processor.scale = values
            for processor, values in zip(processors[len(swapped):], saved[len(swapped):]):
                processor.scale = values


def _is_stand_in(value: Any) -> bool:
    return isinstance(value, _RowScale) or (isinstance(value, list) and bool(value) and
                                            isinstance(value[0], _RowScale))
