"""Transformer blocks of the PiD backbone.

- `PatchBlock`: an MMDiT block on patch tokens; image and text streams have their own weights and attend jointly.
- `PixelBlock`: a pixel-level block; every pixel of a patch is modulated by its patch token, and the pixels
  of a patch are compressed to one token for attention across patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import GeluMLP, RMSNorm, SwiGLU, modulate
from .rope import RopeTable, apply_rope, grid_rope


def _split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, N, 3 * D] -> three [B, N, heads, D // heads]."""
    b, n, three_d = qkv.shape
    q, k, v = qkv.view(b, n, 3, heads, three_d // (3 * heads)).unbind(dim=2)
    return q, k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over [B, N, heads, head_dim] inputs; returns [B, N, heads * head_dim]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


class JointAttention(nn.Module):
    """Joint attention of text (`y`) and image (`x`) tokens with per-stream projections and QK norms."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.qkv_x = nn.Linear(dim, 3 * dim, bias=False)
        self.qkv_y = nn.Linear(dim, 3 * dim, bias=False)
        self.q_norm_x = RMSNorm(head_dim)
        self.k_norm_x = RMSNorm(head_dim)
        self.q_norm_y = RMSNorm(head_dim)
        self.k_norm_y = RMSNorm(head_dim)
        self.proj_x = nn.Linear(dim, dim)
        self.proj_y = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, rope_x: RopeTable, rope_y: RopeTable | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qx, kx, vx = _split_heads(self.qkv_x(x), self.heads)
        qy, ky, vy = _split_heads(self.qkv_y(y), self.heads)
        qx, kx = apply_rope(self.q_norm_x(qx), rope_x), apply_rope(self.k_norm_x(kx), rope_x)
        qy, ky = self.q_norm_y(qy), self.k_norm_y(ky)
        if rope_y is not None:
            qy, ky = apply_rope(qy, rope_y), apply_rope(ky, rope_y)
        # NOTE: text comes first in the joint sequence; no mask, as the released sampler passes none.
        out = _attend(torch.cat([qy, qx], 1), torch.cat([ky, kx], 1), torch.cat([vy, vx], 1))
        n_text = y.shape[1]
        return self.proj_x(out[:, n_text:]), self.proj_y(out[:, :n_text])


class PatchBlock(nn.Module):
    """MMDiT block: adaLN-modulated joint attention and SwiGLU MLPs for the image and text streams."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm_x1 = RMSNorm(dim)
        self.norm_y1 = RMSNorm(dim)
        self.attn = JointAttention(dim, heads)
        self.norm_x2 = RMSNorm(dim)
        self.norm_y2 = RMSNorm(dim)
        self.mlp_x = SwiGLU(dim, int(dim * mlp_ratio))
        self.mlp_y = SwiGLU(dim, int(dim * mlp_ratio))
        self.adaLN_modulation_img = nn.Sequential(nn.Linear(dim, 6 * dim))
        self.adaLN_modulation_txt = nn.Sequential(nn.Linear(dim, 6 * dim))

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, cond: torch.Tensor, rope_x: RopeTable, rope_y: RopeTable | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cond` is [B, 1, dim]: one modulation per row, so rows may sit at different timesteps."""
        sx1, cx1, gx1, sx2, cx2, gx2 = self.adaLN_modulation_img(cond).chunk(6, dim=-1)
        sy1, cy1, gy1, sy2, cy2, gy2 = self.adaLN_modulation_txt(cond).chunk(6, dim=-1)
        attn_x, attn_y = self.attn(
            modulate(self.norm_x1(x), sx1, cx1), modulate(self.norm_y1(y), sy1, cy1), rope_x, rope_y
        )
        x = x + gx1 * attn_x
        y = y + gy1 * attn_y
        x = x + gx2 * self.mlp_x(modulate(self.norm_x2(x), sx2, cx2))
        y = y + gy2 * self.mlp_y(modulate(self.norm_y2(y), sy2, cy2))
        return x, y


class PatchAttention(nn.Module):
    """Self-attention with QK norms and 2D RoPE over the compressed per-patch tokens."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_norm = RMSNorm(dim // heads)
        self.k_norm = RMSNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        q, k, v = _split_heads(self.qkv(x), self.heads)
        q, k = apply_rope(self.q_norm(q), rope), apply_rope(self.k_norm(k), rope)
        return self.proj(_attend(q, k, v))


class PixelBlock(nn.Module):
    """Pixel-level block conditioned per patch on the patch-token stream."""

    def __init__(
        self,
        pixel_dim: int,
        cond_dim: int,
        patch_size: int,
        attn_dim: int,
        attn_heads: int,
        *,
        rope_mode: str,
        rope_ref_grid: tuple[int, int],
    ):
        super().__init__()
        p2 = patch_size * patch_size
        self.pixel_dim = pixel_dim
        self.attn_dim = attn_dim
        self.rope_mode = rope_mode
        self.rope_ref_grid = rope_ref_grid
        self.compress_to_attn = nn.Linear(p2 * pixel_dim, attn_dim)
        self.expand_from_attn = nn.Linear(attn_dim, p2 * pixel_dim)
        self.norm1 = RMSNorm(pixel_dim)
        self.attn = PatchAttention(attn_dim, attn_heads)
        self.norm2 = RMSNorm(pixel_dim)
        self.mlp = GeluMLP(pixel_dim)
        self.adaLN_modulation = nn.Sequential(nn.Linear(cond_dim, 6 * pixel_dim * p2))

    def forward(self, pixels: torch.Tensor, cond: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """`pixels` [B * L, P^2, pixel_dim], `cond` [B * L, cond_dim], `grid` = (rows, cols) of patches."""
        bl, p2, _ = pixels.shape
        n_patches = grid[0] * grid[1]
        mod = self.adaLN_modulation(cond).view(bl, p2, 6 * self.pixel_dim)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        tokens = self.compress_to_attn(modulate(self.norm1(pixels), shift1, scale1).reshape(bl, -1))
        rope = grid_rope(
            self.attn_dim // self.attn.heads,
            *grid,
            mode=self.rope_mode,
            ref_height=self.rope_ref_grid[0],
            ref_width=self.rope_ref_grid[1],
            device=pixels.device,
        )
        attended = self.attn(tokens.view(bl // n_patches, n_patches, self.attn_dim), rope)
        pixels = pixels + gate1 * self.expand_from_attn(attended.reshape(bl, self.attn_dim)).view(bl, p2, -1)
        return pixels + gate2 * self.mlp(modulate(self.norm2(pixels), shift2, scale2))
