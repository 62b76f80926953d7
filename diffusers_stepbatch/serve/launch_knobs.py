"""The launch knobs a server applies to its pipeline before wrapping it: offloading, the attention backend,
VAE tiling and torch.compile of the denoiser (quantization is `StepBatched(quantize=)`), each through
diffusers' or torch's own switch, each refused with a clear error where it can't run. And the warm-up
requests that prime the engine's cost model before the server says it is ready.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import ServeConfig

logger = logging.getLogger(__name__)

OFFLOADS = ("model", "sequential", "group")
# NOTE: diffusers' dispatcher names whose kernels exist only on CUDA (flash-attention, sage, xformers, cuDNN)
_CUDA_ONLY = ("flash", "_flash", "sage", "_sage", "xformers", "_native_cudnn", "_native_efficient", "_native_flash",
              "aiter", "_native_npu", "_native_xla")


def denoiser_of(pipe: Any) -> Any:
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if denoiser is None:
        raise ValueError(f"{type(pipe).__name__} has neither a transformer nor a unet for this knob")
    return denoiser


def check_attention_backend(name: str, device: str) -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [backend.value for backend in AttentionBackendName]
    if name not in names:
        raise ValueError(f"attention_backend={name!r} is not one of diffusers' attention backends: {names}")
    if name.startswith(_CUDA_ONLY) and not device.startswith("cuda"):
        raise ValueError(f"attention_backend={name!r} needs a CUDA device (--device cuda); on {device!r} use "
                         f"'native' or 'flex'")


def apply_knobs(pipe: Any, config: ServeConfig) -> None:
    """Quantization, attention backend, VAE tiling, offload and compile, as `config` says (in place)."""
    import torch

    if config.quantize is not None:  # NOTE: before compile, which must trace the quantized layers
        from ..quantize import quantize_transformer

        quantize_transformer(pipe, weights=config.quantize)

    if config.attention_backend is not None:
        check_attention_backend(config.attention_backend, config.device)
        denoiser_of(pipe).set_attention_backend(config.attention_backend)
    if config.vae_tiling:
        vae = getattr(pipe, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            raise ValueError(f"vae_tiling: {type(pipe).__name__}'s VAE ({type(vae).__name__}) has no tiling")
        vae.enable_tiling()
    if config.offload == "model":
        pipe.enable_model_cpu_offload(device=config.device)
    elif config.offload == "sequential":
        if not config.device.startswith("cuda"):  # NOTE: on the CPU its meta-device weights fail in the first call
            raise ValueError(f"offload='sequential' streams weights from the CPU to an accelerator; --device "
                             f"{config.device!r} has none: use --device cuda, or offload='model' / 'group'")
        pipe.enable_sequential_cpu_offload(device=config.device)
    elif config.offload == "group":
        pipe.enable_group_offload(onload_device=torch.device(config.device), offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1)
    if config.compile:
        # NOTE: dynamic: one graph serves every row count the engine batches (docs/guides: compile)
        denoiser_of(pipe).compile(dynamic=True, backend=config.compile_backend)
    logger.info("launch knobs: quantize=%s offload=%s attention_backend=%s vae_tiling=%s compile=%s (%s)",
                config.quantize, config.offload, config.attention_backend, config.vae_tiling, config.compile,
                config.compile_backend)


def warm_up(model: Any, requests: int) -> None:
    """Run `requests` requests of the model's default call (concurrently) to prime the cost model, then zero the
    engine's counters so that `stats()` and `/metrics` show real traffic only."""
    import PIL.Image
    import torch

    kwargs = {k: v for k, v in model.call_defaults.items() if model.accepts(k)}
    kwargs["prompt"] = "warm-up"
    if model.makes_videos and model.image_to_video:
        width, height = kwargs.get("width", 64), kwargs.get("height", 64)
        kwargs["image"] = PIL.Image.new("RGB", (width, height), "gray")
    if model.lora is not None:
        kwargs["adapters"] = {}
    handles = [model.sb.submit(generator=torch.Generator().manual_seed(i), **kwargs) for i in range(requests)]
    for handle in handles:
        handle.result()
    model.sb.reset_stats()
    logger.info("warm-up: %d requests done", requests)
