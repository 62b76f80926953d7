"""Batched VAE decode as a work item: decodes of several requests with the same latent size share a call."""

from __future__ import annotations

import functools

import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key
from ..models.row_kernels import solo_kernels


def vae_decode_item(vae, latents: torch.Tensor, *, to_vae_placement: bool = False) -> WorkItem:
    """A batched `vae.decode` of VAE-layout latents [B, C, h, w] (already unscaled); `to_vae_placement` moves them
    to `vae.device` / `vae.dtype` first, as the SD and SDXL pipelines do.

    NOTE: only where the pipeline does: `vae.device` walks every VAE module, and under model offload it is the
    CPU, so moving there would copy CUDA latents to the host and back.
    """
    key = named_key(program="vae.decode", **{"latent size": tuple(latents.shape[1:]), "latent dtype": latents.dtype,
                                             "device": str(latents.device)})
    decode = _vae_decode_placed if to_vae_placement else _vae_decode
    return WorkItem("decode", key, {"latents": latents}, functools.partial(decode, vae), rows=latents.shape[0],
                    row_kernels=functools.partial(solo_kernels, vae))


def _vae_decode(vae, latents):
    return vae.decode(latents, return_dict=False)[0]


def _vae_decode_placed(vae, latents):
    return vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]
