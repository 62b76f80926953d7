"""Position encodings of the PiD network: 2D RoPE on the patch grid, 1D RoPE on text, sin/cos on pixels; in the
released network's precisions (float32, float64 for pixels), so the same weights give the same outputs."""

from __future__ import annotations

import torch

# NOTE: patch-grid positions are spread over [0, 16] whatever the grid size; this is the network's convention.
_GRID_POSITION_SPAN = 16.0
_IMAGE_ROPE_THETA = 10000.0
_PIXEL_SINCOS_BASE = 10000.0
ROPE_MODES = ("ntk_aware", "original")

RopeTable = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [N, head_dim // 2]


def grid_rope(
    head_dim: int,
    height: int,
    width: int,
    *,
    mode: str = "ntk_aware",
    ref_height: int = 64,
    ref_width: int = 64,
    device: torch.device | None = None,
) -> RopeTable:
    """2D RoPE table for a `height` x `width` patch grid, row-major; pair `2k` turns with x, `2k + 1` with y.
    `mode="ntk_aware"` rescales the base per axis off the reference grid; `"original"` keeps it."""
    theta_h = theta_w = _IMAGE_ROPE_THETA
    if mode == "ntk_aware":
        axis_dim = head_dim // 2
        if axis_dim > 2:
            exponent = axis_dim / (axis_dim - 2)
            theta_h = _IMAGE_ROPE_THETA * (height / ref_height) ** exponent
            theta_w = _IMAGE_ROPE_THETA * (width / ref_width) ** exponent
    elif mode != "original":
        raise ValueError(f"rope_mode={mode!r} is not supported; use 'ntk_aware' or 'original'")

    exponents = torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim
    freqs_w = 1.0 / (theta_w**exponents)
    freqs_h = 1.0 / (theta_h**exponents)
    cols = torch.linspace(0, _GRID_POSITION_SPAN, width, device=device)
    rows = torch.linspace(0, _GRID_POSITION_SPAN, height, device=device)
    rows, cols = torch.meshgrid(rows, cols, indexing="ij")
    angles_x = torch.outer(cols.reshape(-1), freqs_w)
    angles_y = torch.outer(rows.reshape(-1), freqs_h)
    angles = torch.stack([angles_x, angles_y], dim=-1).reshape(height * width, -1)
    return torch.cos(angles), torch.sin(angles)


def text_rope(head_dim: int, length: int, *, theta: float = 10000.0, device: torch.device | None = None) -> RopeTable:
    """1D RoPE table for `length` text tokens."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.arange(length, device=device).float()[:, None] * freqs[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate adjacent channel pairs of `x` ([B, N, heads, head_dim]) by the angles in `table`."""
    cos, sin = (t.to(x.device)[None, :, None, :] for t in table)
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def pixel_sincos(dim: int, height: int, width: int, *, device: torch.device | None = None) -> RopeTable:
    """Separable sin/cos embedding of pixel coordinates: ([width, dim // 2], [height, dim // 2]), float64; pixel
    (i, j) is `cat(cols[j], rows[i])`, kept apart so no H x W x dim table exists at 4K."""
    if dim % 4:
        raise ValueError(f"pixel_hidden_size={dim} must be divisible by 4 for the pixel sin/cos embedding")
    half = dim // 4
    omega = 1.0 / (_PIXEL_SINCOS_BASE ** (torch.arange(half, dtype=torch.float64, device=device) / half))

    def embed(length: int) -> torch.Tensor:
        angles = torch.arange(length, dtype=torch.float64, device=device)[:, None] * omega[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return embed(width), embed(height)
