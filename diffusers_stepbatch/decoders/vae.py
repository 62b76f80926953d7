"""Batched VAE decode as a work item: decodes of several requests with the same latent size share a call."""

from __future__ import annotations

import functools

import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key


def vae_decode_item(vae, latents: torch.Tensor, *, to_vae_placement: bool = False) -> WorkItem:
    """A batched `vae.decode` of VAE-layout latents [B, C, h, w] (already unscaled).

    `to_vae_placement`: move the latents to `vae.device` and `vae.dtype` first (the SD and SDXL programs: SDXL's
    pipeline moves its latents to the VAE's device). Flux, SD3 and Qwen-Image decode their latents as they are,
    and so do their programs.

    NOTE: `vae.device` and `vae.dtype` each walk every VAE module (diffusers looks for group-offloading and
    layerwise-casting hooks): 0.85 ms a call on the tiny test VAE, 27 ms of a 32-image round where each image
    decodes alone. And with `enable_model_cpu_offload` `vae.device` is the CPU the weights wait on, so moving
    there copied CUDA latents to the host and the offload hook copied them back.
    """
    key = named_key(program="vae.decode", **{"latent size": tuple(latents.shape[1:]), "latent dtype": latents.dtype,
                                             "device": str(latents.device)})
    decode = _vae_decode_placed if to_vae_placement else _vae_decode
    return WorkItem("decode", key, {"latents": latents}, functools.partial(decode, vae), rows=latents.shape[0])


def _vae_decode(vae, latents):
    return vae.decode(latents, return_dict=False)[0]


def _vae_decode_placed(vae, latents):
    return vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]
