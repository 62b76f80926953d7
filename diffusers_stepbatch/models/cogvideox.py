"""CogVideoX (`CogVideoXTransformer3DModel`: text-, image- and video-to-video, Fun Control).

Its 3D RoPE `image_rotary_emb` is a `(cos, sin)` pair of `[tokens, dim]` tensors the model applies to every row.
The default rule takes a tensor whose dim 0 equals the call's rows for a row input, so a video of as many latent
tokens as the call has rows (one token per frame at the smallest sizes) would have its RoPE concatenated across
the merged requests: it is shared instead, and calls merge where it is equal (one video shape).
"""

from __future__ import annotations

from diffusers import CogVideoXTransformer3DModel

from . import ModelSupport, register_model


@register_model(CogVideoXTransformer3DModel)
def _cogvideox() -> ModelSupport:
    return ModelSupport(shared=("image_rotary_emb",))
