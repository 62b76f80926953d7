"""IP-Adapter masks (`cross_attention_kwargs={"ip_adapter_masks": ...}`, SD and SDXL) as per-row inputs, so
requests with different masks of equal shapes share a UNet forward:

>>> masks = plan_ip_masks(args, num_adapters=1, rows=2)      # at submit: validated, one tensor per adapter
>>> rows = mask_rows(masks, rows=2)                           # per row: one [1, images, H, W] slice per adapter
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def plan_ip_masks(args: dict[str, Any], num_adapters: int, rows: int) -> list | None:
    """The call's IP-Adapter masks as a list (one tensor or None per adapter), validated; None without masks."""
    masks = (args.get("cross_attention_kwargs") or {}).get("ip_adapter_masks")
    if masks is None:
        return None
    if num_adapters == 0:
        raise ValueError("cross_attention_kwargs['ip_adapter_masks'] needs an IP-Adapter: pipe.load_ip_adapter(...)")
    if isinstance(masks, torch.Tensor):  # NOTE: diffusers' legacy form, [adapters, 1, H, W]
        masks = list(masks.unsqueeze(1))
    if not isinstance(masks, (list, tuple)) or len(masks) != num_adapters:
        count = len(masks) if isinstance(masks, (list, tuple)) else type(masks).__name__
        raise ValueError(f"ip_adapter_masks has {count} entries for {num_adapters} IP-Adapters; pass one mask "
                         "tensor (IPAdapterMaskProcessor.preprocess) or None per IP-Adapter")
    for i, mask in enumerate(masks):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
            raise ValueError(f"ip_adapter_masks[{i}] must be a tensor [batch, images, height, width] (use "
                             "IPAdapterMaskProcessor.preprocess)")
        if mask.shape[0] not in (1, rows):
            raise ValueError(f"ip_adapter_masks[{i}] has batch {mask.shape[0]}; pass 1 (the same mask for every "
                             f"row) or {rows} (one per row of the call's UNet forward)")
    return list(masks)


def without_masks(kwargs: dict | None) -> dict | None:
    """`cross_attention_kwargs` without the masks (they are per-row inputs, not shared call state)."""
    if not kwargs or "ip_adapter_masks" not in kwargs:
        return kwargs
    return {name: value for name, value in kwargs.items() if name != "ip_adapter_masks"}


def mask_key(masks: list | None) -> tuple | None:
    """What rows of one forward share: each adapter's mask shape (images, height, width), or no masks."""
    return None if masks is None else tuple(None if m is None else tuple(m.shape[1:]) for m in masks)


def mask_rows(masks: list | None, rows: int, first_row: int = 0) -> list:
    """Per row of `first_row:first_row + rows` (a CFG cutoff keeps the conditional half): one mask per adapter."""
    if masks is None:
        return [None] * rows
    picked = []
    for r in range(first_row, first_row + rows):
        picked.append(tuple(None if m is None else m[r if m.shape[0] > 1 else 0][None] for m in masks))
    return picked


def batched_masks(rows: Sequence[tuple | None]) -> list | None:
    """The forward's `ip_adapter_masks`: each adapter's row masks concatenated (rows share mask shapes)."""
    if not rows or rows[0] is None:
        return None
    return [None if row_masks[0] is None else torch.cat(list(row_masks)) for row_masks in zip(*rows)]
