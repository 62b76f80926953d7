"""How each family hands its early-exited x_t to PiD: as the denoiser holds it, not de-normalised, and its sigma.

>>> family = pid_family(pipe)                # None: no early-exit program for this pipeline
>>> lq_latent, sigma = family.to_pid(view, latents, exit_step, main_height, main_width)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinKVPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionXLPipeline,
    ZImagePipeline,
)

ToPiD = Callable[[Any, torch.Tensor, int, int, int], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class PiDFamily:
    """One family's early exit into PiD.

    Args:
        name: the reference's backbone tag ("flux", "sd3", "sdxl", "qwenimage").
        size_multiple: pipe -> the multiple (pixels) the main model's height and width must have.
        latent_channels: pipe -> channels of the VAE latent PiD reads.
        text_dim: pipe -> width of the pipeline's own prompt embeddings (for `text_encoder="pipeline"`); None
            where they can't be PiD's text (Z-Image: a list of per-prompt lengths).
        to_pid: (view, latents after K steps, K, main height, main width) -> (latent, sigma [B] float32).
        check_scheduler: raises ValueError when the pipeline's scheduler keeps latents PiD can't read; None: any.
        latent_down_factor: pipe -> pixels per latent pixel PiD reads (FLUX.2: its 2x2-patchified latent).
        default_size: pipe -> the height and width the pipeline's `__call__` uses when none is given.
    """

    name: str
    size_multiple: Callable[[Any], int]
    latent_channels: Callable[[Any], int]
    text_dim: Callable[[Any], int] | None
    to_pid: ToPiD
    check_scheduler: Callable[[Any], None] | None = None
    latent_down_factor: Callable[[Any], int] = lambda pipe: pipe.vae_scale_factor
    default_size: Callable[[Any], int] = lambda pipe: pipe.default_sample_size * pipe.vae_scale_factor


_FAMILIES: dict[type, PiDFamily] = {}


def register_pid_family(pipeline_class: type, family: PiDFamily) -> None:
    """Declare that `pipeline_class`'s step program implements the PiD early exit with `family`'s conventions."""
    _FAMILIES[pipeline_class] = family


def pid_family(pipe: Any) -> PiDFamily | None:
    """The family of the pipeline's class (or of the nearest registered base whose `__call__` it keeps)."""
    call = _own_call(type(pipe))
    for cls in type(pipe).__mro__:
        if cls in _FAMILIES and _own_call(cls) is call:
            return _FAMILIES[cls]
    return None


def pid_pipelines() -> list[str]:
    return [cls.__name__ for cls in _FAMILIES]


def _own_call(cls: type) -> Any:
    return next((vars(base)["__call__"] for base in cls.__mro__ if "__call__" in vars(base)), None)


def _sigma_rows(view: Any, exit_step: int, rows: int) -> torch.Tensor:
    return torch.full((rows,), float(view.scheduler.sigmas[exit_step]), dtype=torch.float32)


def _unpacked(view: Any, latents: torch.Tensor, exit_step: int, height: int, width: int):
    """Flux: packed [B, tokens, 4C] -> [B, C, h, w], still scaled and shifted (only the VAE decode undoes it)."""
    lq = view._unpack_latents(latents, height, width, view.vae_scale_factor)
    return lq, _sigma_rows(view, exit_step, lq.shape[0])


def _as_is(view: Any, latents: torch.Tensor, exit_step: int, height: int, width: int):
    """SD3, Z-Image: the denoiser's latent already is [B, C, h, w] (Z-Image's transformer sees 1 - sigma as its
    timestep and predicts -velocity, but its scheduler holds the usual x_t = (1 - sigma) x0 + sigma noise)."""
    return latents, _sigma_rows(view, exit_step, latents.shape[0])


def _unpacked_one_frame(view: Any, latents: torch.Tensor, exit_step: int, height: int, width: int):
    """Qwen-Image: packed [B, tokens, 4C] -> [B, C, 1, h, w] -> [B, C, h, w] (its single frame)."""
    lq = view._unpack_latents(latents, height, width, view.vae_scale_factor)
    return lq[:, :, 0], _sigma_rows(view, exit_step, lq.shape[0])


# SDXL schedulers by the frame of their latents: "ve" x0 + s eps (Euler), "vp" divided by sqrt(s^2 + 1) (DPM).
_SDXL_FRAMES = {
    "EulerDiscreteScheduler": "ve",
    "EulerAncestralDiscreteScheduler": "ve",
    "DPMSolverMultistepScheduler": "vp",
}


def _sdxl_frame(scheduler: Any) -> str:
    name = type(scheduler).__name__
    frame = _SDXL_FRAMES.get(name)
    if frame is None or getattr(scheduler.config, "use_flow_sigmas", False):
        raise ValueError(
            f"PiD early exit on SDXL reads the latent's noise level from the scheduler, and knows "
            f"{sorted(_SDXL_FRAMES)} (without use_flow_sigmas); got {name}. Set pipe.scheduler to one of them "
            "(the released SDXL PiD was trained with EulerDiscreteScheduler)"
        )
    return frame


def _sdxl_check_scheduler(pipe: Any) -> None:
    _sdxl_frame(pipe.scheduler)


def _vp_frame(view: Any, latents: torch.Tensor, exit_step: int, height: int, width: int):
    """SDXL: to the variance-preserving frame the SDXL PiD was trained in, in float32 (as the VAE decode)."""
    sigma = float(view.scheduler.sigmas[exit_step])
    scale = (sigma**2 + 1.0) ** 0.5
    lq = latents.float()
    if _sdxl_frame(view.scheduler) == "ve":
        lq = lq / scale
    return lq, torch.full((lq.shape[0],), sigma / scale, dtype=torch.float32)


def _flux2_grid(view: Any, latents: torch.Tensor, exit_step: int, height: int, width: int):
    """FLUX.2: packed [B, h*w, 4C] -> [B, 4C, h, w] by position ids, still 2x2-patchified and batch-normalised
    (only the pipeline's tail de-normalises and unpatchifies, for the VAE; PiD's unpatchify factor does the latter)."""
    down = view.vae_scale_factor * 2
    grid = latents.new_zeros(latents.shape[0], 1, height // down, width // down)
    lq = view._unpack_latents_with_ids(latents, view._prepare_latent_ids(grid).to(latents.device))
    return lq, _sigma_rows(view, exit_step, lq.shape[0])


def _flow_euler_check(pipe: Any) -> None:
    """Generic-program families exit through the pipeline's step callback: step K must be sigmas[K]."""
    if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
        raise ValueError(
            f"PiD early exit on {type(pipe).__name__} reads the latent's noise level as scheduler.sigmas[K], which "
            f"holds for FlowMatchEulerDiscreteScheduler (one sigma per step); got {type(pipe.scheduler).__name__}"
        )


def _transformer_text_dim(pipe: Any) -> int:
    return pipe.transformer.config.joint_attention_dim


register_pid_family(FluxPipeline, PiDFamily(
    "flux", lambda pipe: pipe.vae_scale_factor * 2, lambda pipe: pipe.vae.config.latent_channels,
    _transformer_text_dim, _unpacked,
))  # fmt: skip
register_pid_family(StableDiffusion3Pipeline, PiDFamily(
    "sd3", lambda pipe: pipe.vae_scale_factor * pipe.transformer.config.patch_size,
    lambda pipe: pipe.vae.config.latent_channels, _transformer_text_dim, _as_is,
))  # fmt: skip
register_pid_family(StableDiffusionXLPipeline, PiDFamily(
    "sdxl", lambda pipe: pipe.vae_scale_factor, lambda pipe: pipe.vae.config.latent_channels,
    lambda pipe: pipe.unet.config.cross_attention_dim, _vp_frame, _sdxl_check_scheduler,
))  # fmt: skip
register_pid_family(QwenImagePipeline, PiDFamily(
    "qwenimage", lambda pipe: pipe.vae_scale_factor * 2, lambda pipe: pipe.vae.config.z_dim,
    _transformer_text_dim, _unpacked_one_frame,
))  # fmt: skip

# NOTE: served by the generic program: the pipeline's own loop, stopped after K steps (programs/pid/generic.py)
for _flux2 in (Flux2Pipeline, Flux2KleinPipeline, Flux2KleinKVPipeline):
    register_pid_family(_flux2, PiDFamily(
        "flux2", lambda pipe: pipe.vae_scale_factor * 2, lambda pipe: pipe.vae.config.latent_channels * 4,
        _transformer_text_dim, _flux2_grid, _flow_euler_check,
        latent_down_factor=lambda pipe: pipe.vae_scale_factor * 2,
    ))  # fmt: skip
register_pid_family(ZImagePipeline, PiDFamily(
    "zimage", lambda pipe: pipe.vae_scale_factor * 2, lambda pipe: pipe.vae.config.latent_channels,
    None, _as_is, _flow_euler_check, default_size=lambda pipe: 1024,  # ZImagePipeline.__call__'s default
))  # fmt: skip
