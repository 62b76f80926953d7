"""Small layers of the PiD network: norms, feed-forwards, embedders and the output head.

Attribute names are those of the released checkpoints (`proj`, `mlp.0`, `w1`, `fc1`, ...), so state dicts load
without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .rope import pixel_sincos


class RMSNorm(nn.Module):
    """RMS norm computed in float32, scaled by a learned weight (eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """Gated feed-forward of the patch blocks; the hidden width is 2/3 of `hidden_dim`."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        inner = int(2 * hidden_dim / 3)
        self.w1 = nn.Linear(dim, inner, bias=False)
        self.w3 = nn.Linear(dim, inner, bias=False)
        self.w2 = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """Two-layer GELU MLP of the pixel blocks."""

    def __init__(self, dim: int, ratio: float = 4.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, int(dim * ratio))
        self.fc2 = nn.Linear(int(dim * ratio), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of t (in the network's units, 0..1000) followed by an MLP."""

    def __init__(self, hidden_size: int, frequency_size: int = 256, max_period: float = 10.0):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.frequency_size = frequency_size
        self.max_period = max_period

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None, :]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class TokenEmbedder(nn.Module):
    """Linear projection, optionally followed by an RMS norm (the text embedder uses one)."""

    def __init__(self, in_dim: int, out_dim: int, *, norm: bool = False):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm = RMSNorm(out_dim) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class PixelEmbedder(nn.Module):
    """Per-pixel projection plus a sin/cos embedding of the pixel's image coordinates, grouped by patch."""

    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_channels, dim)
        self.dim = dim

    def forward(self, image: torch.Tensor, patch_size: int) -> torch.Tensor:
        """[B, C, H, W] -> [B * num_patches, patch_size**2, dim], patches row-major, pixels row-major."""
        b, _, h, w = image.shape
        x = self.proj(image.permute(0, 2, 3, 1))
        cols, rows = pixel_sincos(self.dim, h, w, device=image.device)
        half = self.dim // 2
        x = torch.cat(
            [x[..., :half] + cols.to(x.dtype)[None, None], x[..., half:] + rows.to(x.dtype)[None, :, None]], dim=-1
        )
        hs, ws = h // patch_size, w // patch_size
        x = x.view(b, hs, patch_size, ws, patch_size, self.dim).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b * hs * ws, patch_size * patch_size, self.dim)


class FinalLayer(nn.Module):
    """RMS norm and a linear map from pixel features to RGB."""

    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, num_patches, C * patch_size**2], channel-major inside a patch (as `F.unfold`)."""
    b, c, h, w = image.shape
    x = image.view(b, c, h // patch_size, patch_size, w // patch_size, patch_size).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch_size) * (w // patch_size), c * patch_size * patch_size)


def unpatchify_pixels(pixels: torch.Tensor, batch: int, height: int, width: int, patch_size: int) -> torch.Tensor:
    """[B * num_patches, patch_size**2, C] -> [B, C, H, W]."""
    hs, ws = height // patch_size, width // patch_size
    c = pixels.shape[-1]
    x = pixels.view(batch, hs, ws, patch_size, patch_size, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(batch, c, height, width)
