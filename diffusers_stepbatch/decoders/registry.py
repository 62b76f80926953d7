"""Decoders a `StepBatched` engine can use instead of VAE decode, by object or by registered name.

A name's factory runs once per engine, with the pipeline it will serve (to pick a checkpoint for it).

>>> register_decoder("my-pid", lambda pipe: PiDDecoding(PiDDecoder.from_pretrained("my-org/pid"), "pipeline"))
>>> sb = StepBatched(pipe, decoder="my-pid", pid_exit_step=0.9)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pid.model import PiDDecoder
from .pid.sampler import PiDSamplerConfig
from .pid.text import PiDTextEncoder

__all__ = ["PIPELINE_TEXT", "PiDDecoding", "register_decoder", "registered_decoders", "resolve_decoder"]

# `PiDDecoding.text_encoder` value: reuse the pipeline's own prompt embeddings (Flux: the T5 `prompt_embeds`).
PIPELINE_TEXT = "pipeline"

TOY_ADAPTER_DIR = Path(__file__).resolve().parents[1] / "toy" / "pid_adapter"
# NOTE: the reference's default per backbone ("2k" where one exists; Z-Image reuses FLUX.1's, klein FLUX.2's); the
# RAE decoders have releases but no early-exit program here.
_OFFICIAL_FOR = {
    "FluxPipeline": "PiD_res2k_sr4x_official_flux_distill_4step",
    "StableDiffusion3Pipeline": "PiD_res2k_sr4x_official_sd3_distill_4step",
    "StableDiffusionXLPipeline": "PiD_res2kto4k_sr4x_official_sdxl_distill_4step",
    "QwenImagePipeline": "PiD_v1pt5_res2kto4k_sr4x_official_qwenimage_distill_4step",
    "Flux2Pipeline": "PiD_res2k_sr4x_official_flux2_distill_4step",
    "Flux2KleinPipeline": "PiD_res2k_sr4x_official_flux2_distill_4step",
    "ZImagePipeline": "PiD_res2k_sr4x_official_flux_distill_4step",
}


@dataclass(frozen=True)
class PiDDecoding:
    """A PiD decoder as an engine runs it: the network, where its caption embeddings come from (`text_encoder`: a
    `PiDTextEncoder`, Gemma-2, the default; `"pipeline"` for the pipeline's own prompt embeddings; or any object
    with `encode(list[str]) -> [B, L, D]`) and its sampler (default: the released 4-step schedule)."""

    decoder: PiDDecoder
    text_encoder: Any = None
    sampler: PiDSamplerConfig = field(default_factory=PiDSamplerConfig)

    def __post_init__(self):
        if not isinstance(self.decoder, PiDDecoder):
            raise ValueError(f"decoder={type(self.decoder).__name__} must be a PiDDecoder")
        if self.text_encoder is None:
            object.__setattr__(self, "text_encoder", PiDTextEncoder())
        elif self.text_encoder != PIPELINE_TEXT and not callable(getattr(self.text_encoder, "encode", None)):
            raise ValueError(
                f"text_encoder={self.text_encoder!r} must be a PiDTextEncoder, an object with encode(prompts), "
                f"or {PIPELINE_TEXT!r} for the pipeline's own prompt embeddings"
            )
        if not isinstance(self.sampler, PiDSamplerConfig):
            raise ValueError(f"sampler={self.sampler!r} must be a PiDSamplerConfig")

    @property
    def uses_pipeline_text(self) -> bool:
        return isinstance(self.text_encoder, str) and self.text_encoder == PIPELINE_TEXT

    @property
    def txt_embed_dim(self) -> int:
        return self.decoder.y_embedder.proj.in_features


DecoderFactory = Callable[[Any], "PiDDecoder | PiDDecoding"]  # called once per engine built with its name
_DECODERS: dict[str, DecoderFactory] = {}


def register_decoder(name: str, factory: DecoderFactory | None = None):
    """Register `factory(pipe)` under `name` for `StepBatched(pipe, decoder=name)`; usable as a decorator.

    >>> @register_decoder("pid-v1.5")
    ... def _(pipe):
    ...     return PiDDecoder.from_pretrained("nvidia/PiD", checkpoint="PiD_v1pt5_res2kto4k_sr4x_official_flux_distill_4step")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} must be a non-empty string")

    def decorate(fn: DecoderFactory) -> DecoderFactory:
        if not callable(fn):
            raise ValueError(f"factory={fn!r} must be callable as factory(pipe)")
        _DECODERS[name] = fn
        return fn

    return decorate if factory is None else decorate(factory)


def registered_decoders() -> list[str]:
    return sorted(_DECODERS)


def resolve_decoder(decoder: Any, pipe: Any) -> PiDDecoding:
    """A `PiDDecoding` from what `StepBatched(decoder=...)` was given: a name, a `PiDDecoder` or a `PiDDecoding`."""
    if isinstance(decoder, str):
        if decoder not in _DECODERS:
            raise ValueError(f"decoder={decoder!r} is not registered; registered: {registered_decoders()}")
        decoder = _DECODERS[decoder](pipe)
    if isinstance(decoder, PiDDecoder):
        decoder = PiDDecoding(decoder)
    if not isinstance(decoder, PiDDecoding):
        raise ValueError(
            f"decoder={decoder!r} must be a PiDDecoder, a PiDDecoding or a name registered with register_decoder"
        )
    return decoder


def official_checkpoint_for(pipe: Any) -> str | None:
    """The released checkpoint name `decoder="pid"` picks for the pipeline's class; None where there is none."""
    return next((_OFFICIAL_FOR[c.__name__] for c in type(pipe).__mro__ if c.__name__ in _OFFICIAL_FOR), None)


@register_decoder("pid")
def _official_pid(pipe: Any) -> PiDDecoding:
    """The released nvidia/PiD checkpoint for the pipeline's family, with its Gemma-2 text encoder."""
    checkpoint = official_checkpoint_for(pipe)
    if checkpoint is None:
        raise ValueError(
            f"nvidia/PiD has no released checkpoint for {type(pipe).__name__} (released for: "
            f"{', '.join(_OFFICIAL_FOR)}; and DINOv2 / SigLIP RAEs, which StepBatched has no early-exit program "
            "for); pass decoder=PiDDecoder(...) trained on its latents"
        )
    return PiDDecoding(PiDDecoder.from_pretrained("nvidia/PiD", checkpoint=checkpoint).eval())


@register_decoder("toy-pid")
def _toy_pid(pipe: Any) -> PiDDecoding:
    """The tiny PiD trained for the toy-shapes pipeline (`diffusers_stepbatch.toy`); it reads the pipeline's T5 text."""
    if not (TOY_ADAPTER_DIR / "config.json").is_file():
        raise ValueError(f"the toy PiD adapter is missing from {TOY_ADAPTER_DIR}; run diffusers_stepbatch.toy.train_pid")
    return PiDDecoding(PiDDecoder.from_pretrained(TOY_ADAPTER_DIR).eval(), text_encoder=PIPELINE_TEXT)
