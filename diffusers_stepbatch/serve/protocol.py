"""The OpenAI Images API as this server speaks it: request bodies, error objects and the checks that need no
model. Field names and event types are OpenAI's; `negative_prompt` ... `deadline_s` and `strength` are our
extras."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

OUTPUT_FORMATS = ("png", "jpeg", "webp")
MAX_IMAGES = 10
MAX_PARTIAL_IMAGES = 3


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.extra = extra or {}  # more fields of the error object (a 500's `request_id`)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def lora_from_text(value: Any) -> Any:
    """A multipart form's `lora` (a JSON string) as the object JSON bodies send."""
    if isinstance(value, str):
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("lora must be a JSON object of adapter name -> weight") from None
    return value


def fold_brackets(fields: dict[str, Any]) -> dict[str, Any]:
    """A multipart form's `lora[pixel]=0.8` fields (how the openai client sends a nested object) as
    `{"lora": {"pixel": "0.8"}}`."""
    folded: dict[str, Any] = {}
    for key, value in fields.items():
        match = re.fullmatch(r"([A-Za-z_]\w*)\[([^\]]+)\]", key)
        if match and match.group(1) != "image":
            folded.setdefault(match.group(1), {})[match.group(2)] = value
        else:
            folded[key] = value
    return folded


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's error object (`param` names the request field at fault, when there is one)."""

    error: ErrorDetail


class ImageOptions(BaseModel):
    """The fields generations and edits share. Another field must be an argument of the pipeline's `__call__`
    (it is passed on) or the request is a 400 (`extra_fields.extra_arguments`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(description="What to draw (at most the server's --max-prompt-chars characters)")
    model: str | None = Field(None, description="The served model's name; another is a 404")
    n: int = Field(1, ge=1, le=MAX_IMAGES, description="Images to make (num_images_per_prompt)")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' or 'auto'; /v1/models lists what the model draws")
    response_format: str | None = Field(None, description="'b64_json' only: images are returned inline")
    output_format: str = Field("png", description="png, jpeg or webp")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg/webp quality, 0-100")
    quality: str | None = Field(None, description="Accepted and ignored")
    background: str | None = Field(None, description="Accepted and ignored")
    moderation: str | None = Field(None, description="Accepted and ignored")
    style: str | None = Field(None, description="Accepted and ignored")
    user: str | None = Field(None, description="An end-user id; the web page's live panel names requests by it")
    stream: bool = Field(False, description="Server-sent image_generation.* / image_edit.* events")
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES, description="Partial images to stream")
    negative_prompt: str | None = Field(None, description="Extra: the pipeline's negative_prompt")
    num_inference_steps: int | None = Field(None, description="Extra: denoising steps (checked by the pipeline)")
    guidance_scale: float | None = Field(None, description="Extra: the pipeline's guidance_scale")
    true_cfg_scale: float | None = Field(None, description="Extra: the pipeline's true_cfg_scale")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Extra: a CPU torch.Generator seed")
    priority: int = Field(0, description="Extra: admission order under the 'priority' policy")
    deadline_s: float | None = Field(None, gt=0, description="Extra: seconds from now (SLO admission)")
    lora: dict[str, float] | None = Field(None, description="Extra: LoRA adapters by name -> weight (/v1/models)")

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_from_form(cls, value: Any) -> Any:
        return lora_from_text(value)


class ImageGenerationRequest(ImageOptions):
    """`POST /v1/images/generations`."""


class ImageReference(BaseModel):
    """An input image of the JSON form of an edit: a data URL (or, with --allow-remote-images, an https URL)."""

    model_config = ConfigDict(extra="ignore")

    image_url: str | None = None
    file_id: str | None = Field(None, description="Not supported (this server keeps no files): a 400")


class ImageEditRequest(ImageOptions):
    """`POST /v1/images/edits`: multipart `image` (or `image[]`, one or several files) and `mask`, or this JSON
    form with `images` / `mask` as image references. The mask applies to the first image."""

    images: list[ImageReference | str] | None = Field(None, description="JSON form: the input images")
    mask: ImageReference | str | None = Field(None, description="JSON form: the mask of the first image")
    input_fidelity: str | None = Field(None, description="Accepted and ignored")
    strength: float | None = Field(None, gt=0, le=1, description="Extra: how much of the image is redrawn")


_SIZE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")


def parse_size(size: str | None, default: tuple[int, int]) -> tuple[int, int]:
    """"WIDTHxHEIGHT" (or None / "auto" for the model's default) -> (width, height)."""
    if size is None or size == "auto":
        return default
    match = _SIZE.match(size)
    if match is None:
        raise bad_request(f"size={size!r} must be 'WIDTHxHEIGHT', e.g. '{default[0]}x{default[1]}', or 'auto'", "size")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise bad_request(f"size={size!r}: width and height must be >= 1", "size")
    return width, height


def check_request(body: ImageOptions, max_prompt_chars: int) -> None:
    """The checks OpenAI's API makes that need no model (the pipeline's own come at submit)."""
    if body.response_format not in (None, "b64_json"):
        raise bad_request(f"response_format={body.response_format!r} is not supported: this server returns images "
                          f"inline only; use response_format='b64_json' (the default)", "response_format")
    if body.output_format not in OUTPUT_FORMATS:
        raise bad_request(f"output_format={body.output_format!r} is not one of {OUTPUT_FORMATS}", "output_format")
    if body.partial_images and not body.stream:
        raise bad_request(f"partial_images={body.partial_images} needs stream=true", "partial_images")
    for name in ("prompt", "negative_prompt"):
        text = getattr(body, name)
        if text is not None and len(text) > max_prompt_chars:
            raise bad_request(f"{name} has {len(text)} characters; the most this server takes is {max_prompt_chars}",
                              name, code="string_above_max_length")
    if not body.prompt.strip():
        raise bad_request("prompt='' is empty; describe the image", "prompt")
