"""Video autoencoders whose merged encode and decode calls are proven row-wise by the equivalence tests.

Wan's VAE (`AutoencoderKLWan`: Wan 2.1 / 2.2, SkyReels-V2) runs its causal 3-D convolutions with a feature cache
that lives inside one call, per frame chunk, for all rows alike; its tiling splits every row's frames the same
way. Trusting it skips the first-merge check, which would decode a new video shape's first merged call twice.
"""

from __future__ import annotations

from diffusers import AutoencoderKLWan

from . import ModelSupport, register_model


@register_model(AutoencoderKLWan)
def _wan_vae() -> ModelSupport:
    return ModelSupport(trusted=True)
