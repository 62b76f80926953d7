"""Batched VAE decode as a work item: decodes of several requests with the same latent size share a call.

On the CPU each request decodes alone: a merged decode rounds some images apart from their solo decode (torch picks
a norm's kernel by a layout that a one-image tensor leaves ambiguous), and a CPU VAE gains little from batching.
"""

from __future__ import annotations

import functools

import torch

from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key

CPU_DECODES_APART = "each request's own decode on the CPU (bit-identical images)"  # its `stats()["splits"]` field


def vae_decode_item(vae, latents: torch.Tensor, *, to_vae_placement: bool = False) -> WorkItem:
    """A batched `vae.decode` of VAE-layout latents [B, C, h, w] (already unscaled); `to_vae_placement` moves them
    to `vae.device` / `vae.dtype` first, as the SD and SDXL pipelines do.

    NOTE: only where the pipeline does: `vae.device` walks every VAE module, and under model offload it is the
    CPU, so moving there would copy CUDA latents to the host and back.
    """
    key = named_key(program="vae.decode", **{"latent size": tuple(latents.shape[1:]), "latent dtype": latents.dtype,
                                             "device": str(latents.device)})
    key += decode_alone_on_cpu(latents)
    decode = _vae_decode_placed if to_vae_placement else _vae_decode
    return WorkItem("decode", key, {"latents": latents}, functools.partial(decode, vae), rows=latents.shape[0])


def decode_alone_on_cpu(latents: torch.Tensor) -> tuple:
    """A key field that keeps a CPU decode to its own request (empty elsewhere)."""
    if latents.device.type != "cpu":
        return ()
    return named_key(**{CPU_DECODES_APART: id(latents)})


def _vae_decode(vae, latents):
    return vae.decode(latents, return_dict=False)[0]


def _vae_decode_placed(vae, latents):
    return vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]
