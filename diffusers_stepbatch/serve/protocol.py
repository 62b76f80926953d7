"""The OpenAI Images API as this server speaks it: the request body, error objects and the checks that need
no model. Field names and event types are OpenAI's; `negative_prompt` ... `deadline_s` are our extras."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

OUTPUT_FORMATS = ("png", "jpeg", "webp")
MAX_IMAGES = 10
MAX_PARTIAL_IMAGES = 3


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`. Unknown fields are ignored, as OpenAI's server does for other models'.

    Extras: `negative_prompt`, `num_inference_steps`, `guidance_scale`, `true_cfg_scale`, `seed` (pipeline
    arguments), `priority` (the "priority" policy) and `deadline_s` (seconds from now; SLO admission).
    """

    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_IMAGES)
    size: str | None = None
    response_format: str | None = None
    output_format: str = "png"
    output_compression: int | None = Field(None, ge=0, le=100)
    quality: str | None = None
    background: str | None = None
    user: str | None = None
    stream: bool = False
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES)
    negative_prompt: str | None = None
    num_inference_steps: int | None = None  # NOTE: checked by the pipeline, as in the Python API
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    priority: int = 0
    deadline_s: float | None = Field(None, gt=0)


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


def check_request(body: ImageGenerationRequest) -> None:
    """The checks OpenAI's API makes that need no model (the pipeline's own come at submit)."""
    if body.response_format not in (None, "b64_json"):
        raise bad_request(f"response_format={body.response_format!r} is not supported: this server returns images "
                          f"inline only; use response_format='b64_json' (the default)", "response_format")
    if body.output_format not in OUTPUT_FORMATS:
        raise bad_request(f"output_format={body.output_format!r} is not one of {OUTPUT_FORMATS}", "output_format")
    if body.partial_images and not body.stream:
        raise bad_request(f"partial_images={body.partial_images} needs stream=true", "partial_images")
    if not body.prompt.strip():
        raise bad_request("prompt='' is empty; describe the image", "prompt")


# Pipeline argument -> the request field a client set it with (for the `param` of a 400).
_PARAM_OF_ARGUMENT = {
    "height": "size", "width": "size", "num_images_per_prompt": "n", "prompt": "prompt",
    "negative_prompt": "negative_prompt", "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale", "true_cfg_scale": "true_cfg_scale", "generator": "seed",
    "deadline": "deadline_s", "priority": "priority",
}
_ARGUMENT = re.compile(r"`?\b([a-z_]+)`?\s*(?:=|has to be|must be|should be|is )")


def param_of_error(message: str) -> str | None:
    """The request field a pipeline's validation message names, if any ("height=500 must be ..." -> "size")."""
    for name in _ARGUMENT.findall(message):
        if name in _PARAM_OF_ARGUMENT:
            return _PARAM_OF_ARGUMENT[name]
    return None
