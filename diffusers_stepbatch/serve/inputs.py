"""Input images of an edit: read from a multipart form or from image references (data URLs; remote URLs only
when the server allows them), checked (format, count, pixels, mask size) before anything is queued."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import PIL.Image

from .config import ServeConfig
from .protocol import APIError, ImageEditRequest, ImageReference, bad_request, fold_brackets

INPUT_FORMATS = ("PNG", "JPEG", "WEBP")
_REMOTE_TIMEOUT_S = 10.0


@dataclass
class EditInputs:
    """The decoded images of an edit: `images` (RGB) and the first image's `mask` (L, white = repaint) or None."""

    images: list[PIL.Image.Image]
    mask: PIL.Image.Image | None


def decode_image(data: bytes, param: str, config: ServeConfig) -> PIL.Image.Image:
    """PNG / JPEG / WEBP bytes -> a loaded PIL image; a 400 naming `param` otherwise."""
    if not data:
        raise bad_request(f"{param}: the file is empty", param, code="invalid_image")
    try:
        image = PIL.Image.open(io.BytesIO(data))  # NOTE: reads the header only, so the pixel check comes first
    except (PIL.UnidentifiedImageError, OSError) as exc:
        raise bad_request(f"{param}: not an image this server reads ({exc}); send PNG, JPEG or WEBP", param,
                          code="invalid_image_format") from None
    if image.format not in INPUT_FORMATS:
        raise bad_request(f"{param}: {image.format} images are not supported; send PNG, JPEG or WEBP", param,
                          code="invalid_image_format")
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise bad_request(f"{param}: {width}x{height} has {width * height} pixels; the most this server takes is "
                          f"{config.max_image_pixels}", param, code="image_too_large")
    try:
        image.load()
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as exc:
        raise bad_request(f"{param}: the {image.format} data is damaged ({exc})", param,
                          code="invalid_image_format") from None
    return image


def mask_of(image: PIL.Image.Image) -> PIL.Image.Image:
    """OpenAI's mask (transparent = edit here) as diffusers' (white = repaint); an opaque mask is read as
    diffusers' own convention, white = repaint."""
    if "A" in image.getbands() or image.mode == "P" and "transparency" in image.info:
        alpha = image.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 - a)
    return image.convert("L")


async def read_form(request: Any, config: ServeConfig) -> tuple[ImageEditRequest, EditInputs]:
    """The multipart form of `POST /v1/images/edits`: `image` / `image[]` files, `mask`, and the other fields."""
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException

    try:
        form = await request.form(max_files=config.max_input_images + 8, max_fields=64)
    except HTTPException as exc:  # Starlette's own limits (too many files or fields, a malformed form)
        raise bad_request(f"multipart form: {exc.detail}", "image", code="invalid_form") from None
    try:
        uploads = form.getlist("image") + form.getlist("image[]")
        files = [item for item in uploads if isinstance(item, UploadFile)]
        if len(files) != len(uploads):
            raise bad_request("image must be a file upload (multipart), not a text field", "image")
        _check_count(len(files), config)
        mask_field = form.get("mask")
        if mask_field is not None and not isinstance(mask_field, UploadFile):
            raise bad_request("mask must be a file upload (multipart), not a text field", "mask")
        fields = {key: value for key, value in form.multi_items()
                  if key not in ("image", "image[]", "mask") and isinstance(value, str)}
        body = _validated(fields)
        images = [decode_image(await item.read(), _param(i), config) for i, item in enumerate(files)]
        mask = None if mask_field is None else decode_image(await mask_field.read(), "mask", config)
    finally:
        await form.close()
    return body, _checked(EditInputs([image.convert("RGB") for image in images], mask))


async def read_references(body: ImageEditRequest, config: ServeConfig) -> EditInputs:
    """The JSON form: `images` and `mask` as data URLs (or remote URLs, if the server allows them)."""
    references = body.images or []
    _check_count(len(references), config)
    images = [decode_image(await _fetch(ref, f"images[{i}]", config), f"images[{i}]", config)
              for i, ref in enumerate(references)]
    mask = None if body.mask is None else decode_image(await _fetch(body.mask, "mask", config), "mask", config)
    return _checked(EditInputs([image.convert("RGB") for image in images], mask))


def _param(index: int) -> str:
    return "image" if index == 0 else f"image[{index}]"


def _validated(fields: dict[str, str]) -> ImageEditRequest:
    from pydantic import ValidationError

    try:
        return ImageEditRequest.model_validate(fold_brackets(fields))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"{param}={first.get('input')!r}: {first['msg']}", param) from None


def _check_count(count: int, config: ServeConfig) -> None:
    if count == 0:
        raise bad_request("image is missing: send one or more image files (`image`, or `image[]` for several)",
                          "image", code="missing_required_parameter")
    if count > config.max_input_images:
        raise bad_request(f"image: {count} images sent; the most this server takes is {config.max_input_images}",
                          "image", code="too_many_images")


def _checked(inputs: EditInputs) -> EditInputs:
    if inputs.mask is not None:
        mask, first = inputs.mask, inputs.images[0]
        if mask.size != first.size:
            raise bad_request(f"mask is {mask.width}x{mask.height} but the first image is {first.width}x{first.height};"
                              f" the mask must have the first image's size", "mask", code="invalid_mask_size")
        inputs.mask = mask_of(mask)
    return inputs


async def _fetch(reference: ImageReference | str, param: str, config: ServeConfig) -> bytes:
    url = reference if isinstance(reference, str) else reference.image_url
    if url is None:
        raise bad_request(f"{param}: file_id references are not supported (this server keeps no files); send the "
                          f"image as a data URL in image_url", param, code="unsupported_parameter")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise bad_request(f"{param}: a data URL must be base64 ('data:image/png;base64,...')", param,
                              code="invalid_image_url")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{param}: the data URL's base64 is malformed", param, code="invalid_image_url") from None
    if not url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: {url[:40]!r} is neither a data URL nor an http(s) URL", param,
                          code="invalid_image_url")
    if not config.allow_remote_images:
        raise bad_request(f"{param}: this server does not fetch remote images (start it with "
                          f"--allow-remote-images); send the image as a data URL", param,
                          code="remote_images_disabled")
    return await _download(url, param, config)


async def _download(url: str, param: str, config: ServeConfig) -> bytes:
    import httpx

    limit = config.max_body_bytes
    try:
        async with (httpx.AsyncClient(timeout=_REMOTE_TIMEOUT_S, follow_redirects=True) as client,
                    client.stream("GET", url) as response):
            if response.status_code != 200:
                raise bad_request(f"{param}: GET {url} answered {response.status_code}", param,
                                  code="invalid_image_url")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"{param}: the remote image is larger than {limit} bytes",
                                   param=param, code="image_too_large")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise bad_request(f"{param}: fetching {url} failed ({type(exc).__name__})", param,
                          code="invalid_image_url") from None
    return b"".join(chunks)

