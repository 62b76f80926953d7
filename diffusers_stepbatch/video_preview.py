"""Cheap previews of a video request while it denoises: the predicted clean latent video through a linear
latent-to-RGB map, one preview frame per latent frame, at latent resolution (scaled up for display).

The image preview (`diffusers_stepbatch.preview`) fits its map on a 2-D VAE; a video VAE (Wan's
`AutoencoderKLWan`) encodes [B, 3, frames, H, W] and normalises its latents with per-channel `latents_mean` /
`latents_std`, so its map is fitted here on one-frame clips. Latents of another layout get no preview (the
job's progress events still come).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

from .preview import fit_rgb_projection

_PROJECTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_MAX_PREVIEW_SIDE = 256


@dataclass
class StreamVideoPreview:
    """A video preview yielded by `StepBatched.stream`: `frames` (uint8 [latent frames, H, W, 3]) after `step` of
    `num_steps`: a short, low-frame-rate clip of the predicted clean video."""

    step: int
    num_steps: int
    frames: np.ndarray

    @property
    def images(self) -> list[PIL.Image.Image]:
        return [PIL.Image.fromarray(frame) for frame in self.frames]


def video_rgb_projection(pipe: Any, samples: int = 8, seed: int = 0) -> torch.Tensor | None:
    """A (channels + 1) x 3 least-squares map from raw video-VAE latents to RGB in [-1, 1] (None: can't fit)."""
    vae = pipe.vae
    with _LOCK:
        if vae in _PROJECTIONS:
            return _PROJECTIONS[vae]
    scale = getattr(pipe, "vae_scale_factor_spatial", None) or 8
    try:
        projection = fit_rgb_projection(
            lambda images: vae.encode(images.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist.mean[:, :, 0], scale,
            samples, seed=seed)
    except Exception:  # noqa: BLE001 - a VAE of another kind: no previews, never a failed job
        return None
    with _LOCK:
        _PROJECTIONS[vae] = projection
    return projection


class VideoPreviewer:
    """Turns a job's post-step latents ([1, C, frames, h, w], the pipeline's normalised scale) into preview
    frames (uint8 [latent frames, H, W, 3]); `predict` runs in the engine thread and only does tensor math."""

    def __init__(self, pipe: Any, projection: torch.Tensor):
        config = pipe.vae.config
        self.projection = projection
        self.scale = getattr(pipe, "vae_scale_factor_spatial", None) or 8
        channels = projection.shape[0] - 1
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is not None and std is not None:
            self.mean = torch.tensor(mean, dtype=torch.float32).view(1, channels, 1, 1, 1)
            self.std = torch.tensor(std, dtype=torch.float32).view(1, channels, 1, 1, 1)
        else:
            self.mean = torch.full((1, channels, 1, 1, 1), float(getattr(config, "shift_factor", None) or 0.0))
            self.std = torch.full((1, channels, 1, 1, 1), 1 / float(getattr(config, "scaling_factor", None) or 1.0))
        self.previous: torch.Tensor | None = None

    def predict(self, scheduler: Any, index: int, latents: torch.Tensor, wanted: bool = True) -> torch.Tensor | None:
        """The predicted clean raw latent after step `index` (flow matching: x0 = x - sigma * v), on the CPU; call it
        every step (it keeps the previous latents), with `wanted=False` where no preview is due."""
        if latents.ndim != 5 or latents.shape[1] != self.mean.shape[1]:
            return None
        previous, self.previous = self.previous, latents.detach().clone()  # NOTE: a buffer may be reused in place
        if not wanted:
            return None
        x0 = latents
        sigmas = getattr(scheduler, "sigmas", None)
        if previous is not None and sigmas is not None and index + 1 < len(sigmas):
            sigma_from, sigma_to = float(sigmas[index]), float(sigmas[index + 1])
            if sigma_to != sigma_from:
                x0 = latents - sigma_to * (latents - previous) / (sigma_to - sigma_from)
        return x0[:1].detach().float().cpu() * self.std + self.mean

    def frames(self, raw: torch.Tensor) -> np.ndarray:
        """uint8 RGB preview frames [latent frames, H, W, 3], scaled up by the VAE's factor (at most 256 px)."""
        flat = raw[0].permute(1, 2, 3, 0)  # [frames, h, w, C]
        rgb = torch.cat([flat, torch.ones_like(flat[..., :1])], dim=-1) @ self.projection
        rgb = rgb.clamp(-1, 1).permute(0, 3, 1, 2)
        factor = max(1, min(self.scale, _MAX_PREVIEW_SIDE // max(rgb.shape[-2:])))
        rgb = torch.nn.functional.interpolate(rgb, scale_factor=factor, mode="nearest")
        return ((rgb + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
