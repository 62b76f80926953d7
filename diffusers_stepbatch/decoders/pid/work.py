"""PiD as engine work: one batched "pid" work item per request, and the batched caption encode it needs.

Decodes of several requests share one `sampler.decode` call when their items have equal keys (same decoder,
sampler, output size, latent and text shapes, dtype and device). Every row keeps its own sigma, text and random
generator, so a request decodes the same alone or batched (`sampler.decode` with one generator per row).

>>> image = yield pid_decode_item(decoding, lq_latent, sigma, text_embeds, generators, height=256, width=256)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...engine.batch import WorkItem
from .sampler import PiDSamplerConfig, decode

if TYPE_CHECKING:
    from ..registry import PiDDecoding
    from .model import PiDDecoder


def pid_decode_item(
    decoding: "PiDDecoding",
    lq_latent: torch.Tensor,
    sigma: torch.Tensor,
    text_embeds: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    *,
    height: int,
    width: int,
) -> WorkItem:
    """A batched PiD decode of one request's rows: latent [B, C, h, w], sigma [B], text [B, L, D], B generators.

    Its output is [B, 3, height, width] in [-1, 1].
    """
    rows = lq_latent.shape[0]
    if sigma.shape != (rows,) or text_embeds.shape[0] != rows or len(generators) != rows:
        raise ValueError(
            f"a PiD item needs one sigma, text row and generator per latent row: latent {tuple(lq_latent.shape)}, "
            f"sigma {tuple(sigma.shape)}, text {tuple(text_embeds.shape)}, {len(generators)} generators"
        )
    key = (
        "pid", id(decoding.decoder), decoding.sampler, (height, width), tuple(lq_latent.shape[1:]),
        tuple(text_embeds.shape[1:]), lq_latent.dtype, text_embeds.dtype, str(lq_latent.device),
    )  # fmt: skip
    inputs = {"lq_latent": lq_latent, "sigma": sigma, "text_embeds": text_embeds, "generator": list(generators)}
    run = functools.partial(_decode, decoding.decoder, decoding.sampler, height, width)
    return WorkItem("pid", key, inputs, run, rows=rows)


def _decode(decoder: "PiDDecoder", sampler: PiDSamplerConfig, height: int, width: int, lq_latent, sigma,
            text_embeds, generator):
    return decode(decoder, lq_latent, sigma, text_embeds, generator=generator, height=height, width=width,
                  config=sampler)


def pid_text_item(encoder: Any, prompts: list[str]) -> WorkItem:
    """A batched caption encode for PiD (e.g. Gemma-2 through `PiDTextEncoder`); one row per prompt."""
    key = ("pid.encode", id(encoder))
    return WorkItem("encode", key, {"prompt": list(prompts)}, functools.partial(_encode, encoder), rows=len(prompts))


def _encode(encoder: Any, prompt: list[str]) -> torch.Tensor:
    return encoder.encode(prompt)


def pid_text_namespace(encoder: Any) -> tuple:
    """Prompt-cache namespace of a PiD text encoder: its configuration and identity (embeddings differ per model)."""
    return ("pid.text", type(encoder).__qualname__, repr(getattr(encoder, "config", None)), id(encoder))
