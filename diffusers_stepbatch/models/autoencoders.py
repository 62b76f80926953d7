"""Causal 3-D autoencoders whose merged encode and decode calls are proven row-wise by the equivalence tests.

Wan's VAE (`AutoencoderKLWan`: Wan 2.1 / 2.2, SkyReels-V2) and Qwen-Image's (`AutoencoderKLQwenImage`, built on
it) run their causal 3-D convolutions with a feature cache that lives inside one call, per frame chunk, for all
rows alike; their attention is per frame and row, and their tiling splits every row the same way. Trusting them
skips the first-merge check, which would run a new shape's first merged encode or decode twice (a Qwen-Image edit
reference is encoded at about a megapixel).
"""

from __future__ import annotations

from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from . import ModelSupport, register_model


@register_model(AutoencoderKLWan)
def _wan_vae() -> ModelSupport:
    return ModelSupport(trusted=True)


@register_model(AutoencoderKLQwenImage)
def _qwenimage_vae() -> ModelSupport:
    return ModelSupport(trusted=True)
