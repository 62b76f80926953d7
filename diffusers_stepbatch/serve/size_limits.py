"""The image sizes a pipeline can take at all: sides a multiple of its VAE factor times its patch (the
pipeline's own divisibility check) and, where the denoiser's position embeddings are a table, no longer than
the table reaches (beyond it the model fails inside its forward). `model_sizes` narrows them to a preset's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .sizes import SizeRange


def size_multiple(pipe: Any) -> int:
    """Sides must be multiples of this: the VAE's factor times the patch the pipeline or its denoiser packs."""
    vae = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None) or 8
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    patch = getattr(config, "patch_size", None) or (getattr(config, "all_patch_size", None) or (1,))[0]
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    if hasattr(pipe, "_pack_latents"):  # NOTE: FLUX-style pipelines pack 2x2 latent patches themselves
        patch = max(patch, 2)
    return int(vae) * int(patch)


def _z_image_max_side(pipe: Any, multiple: int) -> int:
    # NOTE: image tokens take RoPE rows 0..axes_lens[1]-1 along each side (one token per `multiple` pixels)
    return int(pipe.transformer.config.axes_lens[1]) * multiple


def _sd3_max_side(pipe: Any, multiple: int) -> int:
    size = pipe.transformer.config.pos_embed_max_size
    return int(size) * multiple if size else 0


# Denoiser class name -> the longest side its position-embedding table reaches (0: no table).
_MAX_SIDE_OF: dict[str, Callable[[Any, int], int]] = {
    "ZImageTransformer2DModel": _z_image_max_side,
    "SD3Transformer2DModel": _sd3_max_side,
}


def model_max_side(pipe: Any, multiple: int) -> int | None:
    """The longest side the denoiser's position embeddings reach, or None where they are computed per size."""
    denoiser = getattr(pipe, "transformer", None)
    limit = _MAX_SIDE_OF.get(type(denoiser).__name__)
    side = limit(pipe, multiple) if limit is not None else 0
    return side or None


def model_sizes(pipe: Any, default: tuple[int, int], *, min_side: int | None = None, max_side: int | None = None,
                max_aspect: float = 3.0) -> SizeRange:
    """A preset's range (else one `multiple` to twice the default side) within what the pipeline takes; a range
    the model can't reach (a tiny local model) gives way."""
    multiple = size_multiple(pipe)
    longest = model_max_side(pipe, multiple)
    side = max(default)
    low = min_side or multiple
    high = max_side or max(2 * side, multiple)
    if longest is not None:
        high = min(high, longest)
    low = -(-low // multiple) * multiple
    high = high // multiple * multiple
    if low > high:  # NOTE: the card's smallest size is beyond this model: any size it can take
        low = multiple
    return SizeRange(low, max(high, low), multiple, max_aspect)
