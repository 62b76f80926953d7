"""Images to base64 in the requested format, and previews scaled up to the requested size."""

from __future__ import annotations

import base64
import io

import PIL.Image

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(image: PIL.Image.Image, output_format: str = "png", compression: int | None = None) -> str:
    """Base64 of `image` as png / jpeg / webp; `compression` 0-100 (OpenAI's `output_compression`, 100 = best)."""
    buffer = io.BytesIO()
    options = {}
    if output_format in ("jpeg", "webp"):
        options["quality"] = 100 if compression is None else max(1, compression)
    image.convert("RGB").save(buffer, format=_PIL_FORMATS[output_format], **options)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def preview_image(thumbnail: PIL.Image.Image, scale: int) -> PIL.Image.Image:
    """A latent-resolution preview shown at image size (`scale`: the VAE's; bilinear: a preview, not a decode)."""
    return thumbnail.resize((thumbnail.width * scale, thumbnail.height * scale), PIL.Image.Resampling.BILINEAR)


def size_of(image: PIL.Image.Image) -> str:
    """OpenAI's "WIDTHxHEIGHT" of an image (the pipeline may round the requested size, e.g. to 16)."""
    return f"{image.width}x{image.height}"
