"""The few-step sampler of the distilled PiD checkpoints, batched with per-row inputs.

The released flow convention: x_t = (1 - t) x0 + t noise, velocity v = noise - x0 at network time `t * 1000`.
"sde" (the default) re-noises the x0 prediction between steps, "ode" takes Euler steps. Every row has its own
latent, sigma, text, timestep and random stream, so requests decode together exactly as alone.

>>> image = decode(decoder, lq_latent, sigma=[0.0, 0.12], text_embeds=embeds, generator=[g1, g2])  # [-1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

if TYPE_CHECKING:
    from .model import PiDDecoder

__all__ = [
    "PID_DISTILLED_TIMESTEPS",
    "PiDSamplerConfig",
    "decode",
    "initial_noise",
    "sampler_step",
    "to_unit_range",
    "velocity_to_x0",
]

PID_DISTILLED_TIMESTEPS = (0.999, 0.866, 0.634, 0.342, 0.0)
SAMPLE_TYPES = ("sde", "ode")

Generators = torch.Generator | Sequence[torch.Generator | None] | None


@dataclass(frozen=True)
class PiDSamplerConfig:
    """How `decode` samples: `timesteps` from noise to clean (strictly decreasing, ending at 0), `sample_type`
    ("sde" or "ode") and `timescale` (network time units per unit of flow time)."""

    timesteps: tuple[float, ...] = PID_DISTILLED_TIMESTEPS
    sample_type: str = "sde"
    timescale: float = 1000.0

    def __post_init__(self):
        ts = tuple(float(t) for t in self.timesteps)
        if len(ts) < 2 or ts[-1] != 0.0 or not all(a > b for a, b in zip(ts, ts[1:])) or not 0 < ts[0] <= 1:
            raise ValueError(f"timesteps={self.timesteps} must decrease strictly from (0, 1] and end at 0.0")
        if self.sample_type not in SAMPLE_TYPES:
            raise ValueError(f"sample_type={self.sample_type!r} must be one of {SAMPLE_TYPES}")
        if self.timescale <= 0:
            raise ValueError(f"timescale={self.timescale} must be > 0")
        object.__setattr__(self, "timesteps", ts)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps) - 1


def _per_row(value: float | Sequence[float] | torch.Tensor, batch: int, name: str) -> torch.Tensor:
    """A [batch] float32 CPU tensor from a scalar, a sequence or a tensor of one value per row."""
    tensor = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1)
    if tensor.numel() == 1:
        return tensor.expand(batch).clone()
    if tensor.numel() != batch:
        raise ValueError(f"{name} has {tensor.numel()} values for a batch of {batch}; give one per row or a scalar")
    return tensor


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.device).view(-1, *([1] * (like.dim() - 1)))


def randn_rows(shape: Sequence[int], generator: Generators, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise [B, *shape[1:]], float32: one draw for one generator (as the reference), row i from
    generator i for a list (so a row's noise does not depend on the others)."""
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}; give one per row")
    shape, device = tuple(shape), torch.device(device)
    if isinstance(generator, (list, tuple)) and any(g is None for g in generator):
        # NOTE: a request without a generator shares a batch with seeded ones: its rows use the global RNG.
        return torch.cat([randn_rows((1, *shape[1:]), g, device) for g in generator])
    # NOTE: diffusers' helper draws on the generators' device and moves the noise, so CPU generators serve CUDA too.
    return randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)


def initial_noise(batch: int, height: int, width: int, generator: Generators, device="cpu") -> torch.Tensor:
    """The starting noise of `decode`: [batch, 3, height, width], float32."""
    return randn_rows((batch, 3, height, width), generator, device)


def velocity_to_x0(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x0 = x_t - t * v per row, computed in float64 as the reference does."""
    return (x_t.double() - _expand(t.double(), x_t) * velocity.double()).to(x_t.dtype)


def sampler_step(
    x_t: torch.Tensor,
    velocity: torch.Tensor,
    t: torch.Tensor,
    t_next: torch.Tensor,
    noise: torch.Tensor | None = None,
    *,
    sample_type: str = "sde",
) -> torch.Tensor:
    """Advance each row from its `t` to its `t_next` ([B] each); rows reaching 0 return their x0 prediction
    (`noise`: the "sde" sampler's fresh noise)."""
    x0 = velocity_to_x0(x_t, velocity, t)
    if sample_type == "sde":
        if noise is None:
            if bool((t_next > 0).any()):
                raise ValueError("sample_type='sde' needs fresh noise for every step that does not end at t=0")
            return x0
        t_next_b = _expand(t_next.to(x_t.dtype), x_t)
        moved = (1.0 - t_next_b) * x0 + t_next_b * noise.to(x_t)
    elif sample_type == "ode":
        moved = x_t + _expand((t_next - t).to(x_t.dtype), x_t) * velocity.to(x_t.dtype)
    else:
        raise ValueError(f"sample_type={sample_type!r} must be one of {SAMPLE_TYPES}")
    return torch.where(_expand(t_next == 0, x_t), x0, moved)


def to_unit_range(image: torch.Tensor) -> torch.Tensor:
    """Map a decoded image from [-1, 1] to [0, 1]."""
    return ((image + 1) / 2).clamp(0, 1)


@torch.no_grad()
def decode(
    decoder: "PiDDecoder",
    lq_latent: torch.Tensor,
    sigma: float | Sequence[float] | torch.Tensor,
    text_embeds: torch.Tensor,
    *,
    generator: Generators = None,
    noise: torch.Tensor | None = None,
    height: int | None = None,
    width: int | None = None,
    config: PiDSamplerConfig | None = None,
) -> torch.Tensor:
    """Decode a batch of low-resolution latents to images in [-1, 1] (float32, clamped; `to_unit_range` for [0, 1]).

    Args:
        decoder: the PiD network.
        lq_latent: [B, C, h, w] latents in the main model's latent space (as its transformer sees them).
        sigma: the noise level of each row's latent: the scheduler sigma of an early-exited x_t, 0 for a clean x0.
        text_embeds: [B, L, txt_embed_dim] caption embeddings (`text.PiDTextEncoder`).
        generator: one generator for the batch, or one per row (rows then match decoding alone).
        noise: starting noise [B, 3, H, W], or [num_steps, B, 3, H, W] to fix the re-noising too.
        height, width: output size; default `h * decoder.latent_scale` x `w * decoder.latent_scale`.
        config: the sampler; default the released 4-step distilled schedule.
    """
    config = config or PiDSamplerConfig()
    batch = lq_latent.shape[0]
    if text_embeds.shape[0] != batch:
        raise ValueError(f"text_embeds has {text_embeds.shape[0]} rows for {batch} latents; give one per latent")
    height = height or lq_latent.shape[-2] * decoder.latent_scale
    width = width or lq_latent.shape[-1] * decoder.latent_scale
    param = next(decoder.parameters())
    device, dtype = param.device, param.dtype
    sigma_rows = _per_row(sigma, batch, "sigma").to(device)

    noises = _split_noise(noise, config.num_steps, (batch, 3, height, width))
    x = noises[0].to(device, torch.float32) if noises else initial_noise(batch, height, width, generator, device)
    latent, text = lq_latent.to(device, dtype), text_embeds.to(device, dtype)
    for i, (t, t_next) in enumerate(zip(config.timesteps[:-1], config.timesteps[1:])):
        t_rows = torch.full((batch,), t, dtype=torch.float32, device=device)
        velocity = decoder(x.to(dtype), t_rows * config.timescale, text, lq_latent=latent, degrade_sigma=sigma_rows)
        eps = None
        if config.sample_type == "sde" and t_next > 0:
            eps = noises[i + 1] if i + 1 < len(noises) else randn_rows(x.shape, generator, device)
        x = sampler_step(
            x, velocity.float(), t_rows, torch.full_like(t_rows, t_next), eps, sample_type=config.sample_type
        )
    return x.clamp(-1, 1)


def _split_noise(noise: torch.Tensor | None, num_steps: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    if noise is None:
        return []
    if noise.dim() == 4:
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}; expected {shape}")
        return [noise]
    if noise.dim() != 5 or tuple(noise.shape[1:]) != shape or noise.shape[0] != num_steps:
        raise ValueError(f"noise has shape {tuple(noise.shape)}; expected {shape} or ({num_steps}, *{shape})")
    return list(noise.unbind(0))
