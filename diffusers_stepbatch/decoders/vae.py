"""Batched VAE decode as a work item: decodes of several requests with the same latent size share a call."""

from __future__ import annotations

import functools

import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key


def vae_decode_item(vae, latents: torch.Tensor) -> WorkItem:
    """A batched `vae.decode` of VAE-layout latents [B, C, h, w] (already unscaled)."""
    key = named_key(program="vae.decode", **{"latent size": tuple(latents.shape[1:]), "latent dtype": latents.dtype,
                                             "device": str(latents.device)})
    return WorkItem("decode", key, {"latents": latents}, functools.partial(_vae_decode, vae), rows=latents.shape[0])


def _vae_decode(vae, latents):
    return vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]
