"""Cheap previews while a request denoises: the predicted clean latent, shown through a linear projection.

For flow matching, after a step from sigma_i to sigma_j the velocity is v = (x_j - x_i) / (sigma_j - sigma_i)
and the predicted clean latent is x0 = x_j - sigma_j * v. Decoding it with the VAE would cost as much as
the final decode; instead a 3 x C linear map from latent channels to RGB, fitted once per VAE by least
squares on encoded smooth random images, gives a thumbnail at latent resolution in microseconds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

_PROJECTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROJECTIONS_LOCK = threading.Lock()


@dataclass
class StreamPreview:
    """A preview yielded by `StepBatched.stream`: `latents` is the predicted clean latent in the VAE's
    layout [images, channels, h, w] (VAE-scaled, as `vae.decode` takes it), after `step` of `num_steps`."""

    step: int
    num_steps: int
    latents: torch.Tensor
    projection: torch.Tensor

    @property
    def images(self) -> list[PIL.Image.Image]:
        """Thumbnails at latent resolution through the fitted linear latent-to-RGB map."""
        with torch.no_grad():
            flat = self.latents.float().permute(0, 2, 3, 1)
            rgb = torch.cat([flat, torch.ones_like(flat[..., :1])], dim=-1) @ self.projection
        pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        return [PIL.Image.fromarray(np.ascontiguousarray(image)) for image in pixels]


def latent_rgb_projection(vae: Any, samples: int = 8, size: int | None = None, seed: int = 0) -> torch.Tensor:
    """A (channels + 1) x 3 least-squares map from VAE latents to RGB in [-1, 1], fitted once per VAE."""
    with _PROJECTIONS_LOCK:
        if vae in _PROJECTIONS:
            return _PROJECTIONS[vae]
    scale = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    frames = not hasattr(vae.config, "block_out_channels")  # NOTE: Qwen-Image's video-style VAE: [B, C, 1, H, W]

    def encode(images: torch.Tensor) -> torch.Tensor:
        images = images.to(vae.device, vae.dtype)
        latents = vae.encode(images.unsqueeze(2) if frames else images).latent_dist.mean
        return latents[:, :, 0] if frames else latents

    projection = fit_rgb_projection(encode, scale, samples, size, seed)
    with _PROJECTIONS_LOCK:
        _PROJECTIONS[vae] = projection
    return projection


def fit_rgb_projection(encode: Callable[[torch.Tensor], torch.Tensor], scale: int, samples: int = 8,
                       size: int | None = None, seed: int = 0) -> torch.Tensor:
    """The (channels + 1) x 3 least-squares map from latents to RGB, fitted on smooth random images:
    `encode(images [N, 3, S, S] in [-1, 1])` gives their latents [N, C, S / scale, S / scale]."""
    size = size or 8 * scale
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(samples, 3, 4, 4, generator=generator) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    with torch.no_grad():
        latents = encode(images).float().cpu()
    pooled = torch.nn.functional.avg_pool2d(images, scale)  # the pixels each latent cell stands for
    x = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    y = pooled.permute(0, 2, 3, 1).reshape(-1, 3)
    return torch.linalg.lstsq(x, y).solution


def to_vae_layout(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed transformer latents (Flux, Qwen-Image) to [B, C, h, w] and into the VAE's raw latent scale."""
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    if latents.ndim == 5:  # Qwen-Image's video-style VAE: [B, C, frames, h, w]
        latents = latents[:, :, 0]
    config = pipe.vae.config
    shift = getattr(config, "shift_factor", None) or 0.0
    return latents / getattr(config, "scaling_factor", 1.0) + shift


class FlowPreviewer:
    """Turns successive post-step latents of one request into predicted-clean-latent previews."""

    def __init__(self, pipe: Any, height: int, width: int):
        self.pipe, self.height, self.width = pipe, height, width
        self.previous: torch.Tensor | None = None

    def __call__(self, step_pipe: Any, index: int, latents: torch.Tensor) -> torch.Tensor:
        """The predicted clean latent after step `index` (the latents themselves when it can't be derived)."""
        previous, self.previous = self.previous, latents
        sigmas = getattr(step_pipe.scheduler, "sigmas", None)
        x0 = latents
        if previous is not None and sigmas is not None and index + 1 < len(sigmas):
            sigma_from, sigma_to = float(sigmas[index]), float(sigmas[index + 1])
            if sigma_to != sigma_from:
                velocity = (latents - previous) / (sigma_to - sigma_from)
                x0 = latents - sigma_to * velocity
        return to_vae_layout(self.pipe, x0, self.height, self.width)
