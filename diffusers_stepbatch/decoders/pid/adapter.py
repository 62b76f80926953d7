"""The latent condition adapter: the only part of PiD tied to one latent diffusion model.

The low-resolution latent is aligned to the patch grid (nearest upsample, or folding when it is finer than
the grid), run through conv 3x3 -> SiLU -> conv 3x3 -> residual blocks, and projected per token by one linear
head per injection point. A sigma-aware gate adds each projection to the patch tokens:

    x + sigmoid(content_proj([x, lq]) - exp(log_alpha) * sigma) * lq

so a noisier latent (an earlier exit) is trusted less.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

GATE_TYPES = ("sigma_aware_per_token", "sigma_aware_per_token_per_dim")
PADDING_MODES = ("zeros", "reflect", "replicate")
_RESBLOCK_GROUPS = 4


class SigmaAwareGate(nn.Module):
    """Gated residual injection; the gate is one scalar per token, or one per token and channel."""

    def __init__(self, dim: int, per_dim: bool):
        super().__init__()
        self.content_proj = nn.Linear(2 * dim, dim if per_dim else 1)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(5.0)))
        nn.init.trunc_normal_(self.content_proj.weight, std=0.01)
        nn.init.constant_(self.content_proj.bias, 2.0)

    def forward(self, x: torch.Tensor, lq: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """`x`, `lq` [B, N, dim]; `sigma` [B], the noise level of each row's latent (0 = clean)."""
        logit = self.content_proj(torch.cat([x, lq], dim=-1)) - self.log_alpha.exp() * sigma.float().view(-1, 1, 1)
        return x + torch.sigmoid(logit) * lq


def build_gate(gate_type: str, dim: int) -> SigmaAwareGate:
    if gate_type not in GATE_TYPES:
        raise ValueError(f"lq_gate_type={gate_type!r} is not supported; use one of {GATE_TYPES}")
    return SigmaAwareGate(dim, per_dim=gate_type == "sigma_aware_per_token_per_dim")


def _conv3x3(cin: int, cout: int, padding_mode: str) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, padding=1, padding_mode=padding_mode)


class ResBlock(nn.Module):
    """Pre-activation residual block: (GroupNorm, SiLU, conv 3x3) twice, plus the skip."""

    def __init__(self, channels: int, padding_mode: str):
        super().__init__()
        self.block = nn.Sequential(
            nn.GroupNorm(_RESBLOCK_GROUPS, channels),
            nn.SiLU(),
            _conv3x3(channels, channels, padding_mode),
            nn.GroupNorm(_RESBLOCK_GROUPS, channels),
            nn.SiLU(),
            _conv3x3(channels, channels, padding_mode),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class LatentConditionAdapter(nn.Module):
    """Turns a [B, C, h, w] latent into per-token features on the [H / patch, W / patch] patch grid.

    Args:
        latent_channels: channels of the latent as the main model produces it (16 for Flux, SD3 and Qwen-Image,
            4 for SDXL, 128 for Flux.2's packed latent).
        hidden_dim: width of the conv trunk.
        out_dim: width of the patch tokens (the backbone's `hidden_size`).
        patch_size, sr_scale, latent_spatial_down_factor, unpatchify_factor: fix how many patches one latent
            pixel covers: `sr_scale * latent_spatial_down_factor / unpatchify_factor / patch_size`.
        num_res_blocks: residual blocks after the two convs.
        num_outputs: projection heads for the patch blocks (one per injection point).
        gate_type: one of `GATE_TYPES`.
        padding_mode: padding of every conv.
        pixel_output: add a head (and gate, owned by the decoder) for the pixel blocks (v1.5).
        aux_rgb_head: keep the training-only head that predicts the low-resolution RGB image (v1.5); it is in
            the released state dicts but never runs at inference.
    """

    def __init__(
        self,
        *,
        latent_channels: int,
        hidden_dim: int,
        out_dim: int,
        patch_size: int,
        sr_scale: int,
        latent_spatial_down_factor: int,
        unpatchify_factor: int = 1,
        num_res_blocks: int = 4,
        num_outputs: int = 1,
        gate_type: str = "sigma_aware_per_token_per_dim",
        padding_mode: str = "zeros",
        pixel_output: bool = False,
        aux_rgb_head: bool = False,
    ):
        super().__init__()
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"lq_conv_padding_mode={padding_mode!r} is not supported; use one of {PADDING_MODES}")
        if latent_spatial_down_factor % unpatchify_factor or latent_channels % (unpatchify_factor**2):
            raise ValueError(
                f"lq_latent_unpatchify_factor={unpatchify_factor} must divide latent_spatial_down_factor="
                f"{latent_spatial_down_factor} and its square must divide lq_latent_channels={latent_channels}"
            )
        self.unpatchify_factor = unpatchify_factor
        channels = latent_channels // unpatchify_factor**2
        patches_per_latent_pixel = sr_scale * (latent_spatial_down_factor // unpatchify_factor) / patch_size
        self.fold_factor = 1
        if patches_per_latent_pixel < 1:
            self.fold_factor = round(1 / patches_per_latent_pixel)
            if self.fold_factor * patches_per_latent_pixel != 1:
                raise ValueError(
                    f"patch_size={patch_size} must be a whole multiple of sr_scale * latent pixel size "
                    f"({patches_per_latent_pixel * patch_size}) when the latent is finer than the patch grid"
                )
        self.patches_per_latent_pixel = patches_per_latent_pixel

        layers: list[nn.Module] = [
            _conv3x3(channels * self.fold_factor**2, hidden_dim, padding_mode),
            nn.SiLU(),
            _conv3x3(hidden_dim, hidden_dim, padding_mode),
        ]
        layers += [ResBlock(hidden_dim, padding_mode) for _ in range(num_res_blocks)]
        self.latent_proj = nn.Sequential(*layers)
        self.output_heads = nn.ModuleList(nn.Linear(hidden_dim, out_dim) for _ in range(num_outputs))
        self.pit_head = nn.Linear(hidden_dim, out_dim) if pixel_output else None
        if aux_rgb_head:
            rgb_patch = patch_size // sr_scale
            self.lq_aux_rgb_head = nn.Sequential(
                nn.LayerNorm(hidden_dim),
                nn.Linear(hidden_dim, hidden_dim),
                nn.SiLU(),
                nn.Linear(hidden_dim, 3 * rgb_patch * rgb_patch),
            )
        self.gate_modules = nn.ModuleList(build_gate(gate_type, out_dim) for _ in range(num_outputs))

    def align(self, latent: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Bring the latent onto the patch grid: [B, C, h, w] -> [B, C', rows, cols]."""
        f = self.unpatchify_factor
        if f > 1:
            # NOTE: a packed (Flux.2-style) latent stores f x f spatial neighbours as channels; undo that first.
            b, c, h, w = latent.shape
            latent = latent.reshape(b, c // (f * f), f, f, h, w).permute(0, 1, 4, 2, 5, 3)
            latent = latent.reshape(b, c // (f * f), h * f, w * f)
        rows, cols = grid
        if self.patches_per_latent_pixel > 1:
            return F.interpolate(latent, size=(rows, cols), mode="nearest")
        k = self.fold_factor
        if latent.shape[-2:] != (rows * k, cols * k):
            latent = F.interpolate(latent, size=(rows * k, cols * k), mode="bilinear", align_corners=False)
        if k == 1:
            return latent
        b, c = latent.shape[:2]
        latent = latent.reshape(b, c, rows, k, cols, k).permute(0, 1, 3, 5, 2, 4)
        return latent.reshape(b, c * k * k, rows, cols)

    def forward(self, latent: torch.Tensor, grid: tuple[int, int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Features for each injection point ([B, rows * cols, out_dim] each) and for the pixel blocks."""
        features = self.latent_proj(self.align(latent, grid))
        tokens = features.flatten(2).transpose(1, 2)
        heads = [head(tokens) for head in self.output_heads]
        return heads, (self.pit_head(tokens) if self.pit_head is not None else None)

    def inject(self, index: int, x: torch.Tensor, features: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.gate_modules[index](x, features, sigma)
