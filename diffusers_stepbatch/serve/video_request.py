"""`POST /v1/videos` as this server reads it: the request body (OpenAI's fields and our extras) and its plan,
the video pipeline's `__call__` arguments, checked before anything is queued.

`seconds` maps to frames as `seconds * fps + 1` (a first frame, then `fps` frames a second); `num_frames` sets
the count directly. Both must give a count the pipeline's VAE takes (Wan: 4k + 1).
"""

from __future__ import annotations

import inspect
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .config import ServeConfig
from .extra_fields import extra_arguments
from .generation import check_steps, lora_arguments
from .model import ServingModel
from .protocol import ImageReference, bad_request, lora_from_text, parse_size

# Pipeline argument -> the request field a client sets it with (the `param` of a 400 about that argument).
VIDEO_FIELD_OF_ARGUMENT = {"prompt": "prompt", "height": "size", "width": "size", "num_frames": "num_frames",
                           "image": "input_reference", "negative_prompt": "negative_prompt",
                           "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale",
                           "generator": "seed", "priority": "priority"}
_EXTRA_ARGUMENTS = ("negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2")


class VideoCreateRequest(BaseModel):
    """`POST /v1/videos`: a multipart form (OpenAI's client sends one; `input_reference` a file) or this JSON
    (`input_reference` an image reference). Another field must be an argument of the pipeline's `__call__`
    (passed on), else a 400."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(description="What the video shows (at most the server's --max-prompt-chars characters)")
    model: str | None = Field(None, description="The served model's name; another is a 404")
    seconds: float | None = Field(None, gt=0, description="Clip length; frames = seconds * fps + 1")
    size: str | None = Field(None, description="'WIDTHxHEIGHT'; /v1/models gives the default")
    input_reference: ImageReference | str | None = Field(
        None, description="JSON form: the first frame of an image-to-video model, as a data URL")
    num_frames: int | None = Field(None, ge=1, description="Extra: the frame count (instead of seconds)")
    negative_prompt: str | None = Field(None, description="Extra: the pipeline's negative_prompt")
    num_inference_steps: int | None = Field(None, ge=1, description="Extra: denoising steps")
    guidance_scale: float | None = Field(None, description="Extra: the pipeline's guidance_scale")
    guidance_scale_2: float | None = Field(None, description="Extra: Wan 2.2's low-noise expert guidance")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Extra: a CPU torch.Generator seed")
    fps: float | None = Field(None, gt=0, le=240, description="Extra: frames per second (default: the model's "
                                                               "frame rate, else the server's --video-fps)")
    priority: int = Field(0, description="Extra: admission order under the 'priority' policy")
    user: str | None = Field(None, description="An end-user id; the web page's live panel names requests by it")
    lora: dict[str, float] | None = Field(None, description="Extra: LoRA adapters by name -> weight (/v1/models)")

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_from_form(cls, value: Any) -> Any:
        return lora_from_text(value)


@dataclass
class VideoPlan:
    """One planned video job: the pipeline's arguments and what its video object reports."""

    kwargs: dict[str, Any]
    prompt: str
    width: int
    height: int
    num_frames: int
    num_steps: int
    fps: float
    seed: int
    priority: int
    user: str | None

    @property
    def seconds(self) -> str:
        """OpenAI's `seconds` (a string): the clip's length after its first frame."""
        return f"{(self.num_frames - 1) / self.fps:g}"

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def plan_video(model: ServingModel, body: VideoCreateRequest, image: Any, config: ServeConfig) -> VideoPlan:
    """Map a `POST /v1/videos` request onto the video pipeline's `__call__`; a 400 for what it can't take.

    `image`: the decoded `input_reference` (PIL) or None.
    """
    pipe_name = type(model.sb.pipe).__name__
    for name in ("prompt", "negative_prompt"):
        text = getattr(body, name)
        if text is not None and len(text) > config.max_prompt_chars:
            raise bad_request(f"{name} has {len(text)} characters; the most this server takes is "
                              f"{config.max_prompt_chars}", name, code="string_above_max_length")
    if not body.prompt.strip():
        raise bad_request("prompt='' is empty; describe the video", "prompt")
    if image is not None and not model.image_to_video:
        raise bad_request(f"input_reference: {model.name} ({pipe_name}) makes videos from text only; leave "
                          f"input_reference out", "input_reference", code="unsupported_parameter")
    if image is None and model.image_to_video:
        raise bad_request(f"input_reference is missing: {model.name} ({pipe_name}) makes a video from an image; "
                          f"send one (the first frame)", "input_reference", code="missing_required_parameter")
    width, height = parse_size(body.size, default_video_size(model))
    check_size(model, width, height, config)
    fps = body.fps or default_fps(model, config)
    num_frames = frames_of(model, body, config, fps)
    kwargs = {k: v for k, v in model.call_defaults.items() if model.accepts(k)}
    kwargs.update(prompt=body.prompt, height=height, width=width, num_frames=num_frames, output_type="np")
    if model.accepts("frame_rate"):  # NOTE: LTX(-2) condition on it (positions in time, the audio's length)
        kwargs["frame_rate"] = fps
    if image is not None:
        kwargs["image"] = image
    for name in _EXTRA_ARGUMENTS:
        value = getattr(body, name)
        if value is None:
            continue
        if not model.accepts(name):
            raise bad_request(f"{name}={value!r} is not an argument of {pipe_name}; leave it out", name,
                              code="unsupported_parameter")
        kwargs[name] = value
    kwargs.update(extra_arguments(body.model_extra, type(model.sb.pipe), set(VideoCreateRequest.model_fields)))
    kwargs.update(lora_arguments(model, body.lora, body.model))
    check_steps(model, kwargs.get("num_inference_steps"))
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    import torch

    # NOTE: a CPU generator gives the same video for a seed on every device (diffusers' randn_tensor moves it).
    kwargs["generator"] = torch.Generator().manual_seed(seed)
    steps = kwargs.get("num_inference_steps") or _default(model, "num_inference_steps") or 1
    return VideoPlan(kwargs=kwargs, prompt=body.prompt, width=width, height=height, num_frames=num_frames,
                     num_steps=steps, fps=fps, seed=seed, priority=body.priority, user=body.user)


def default_video_size(model: ServingModel) -> tuple[int, int]:
    """(width, height) of a request without `size`: the server's defaults, else the pipeline's own."""
    width = model.call_defaults.get("width") or _default(model, "width") or 832
    height = model.call_defaults.get("height") or _default(model, "height") or 480
    return width, height


def default_fps(model: ServingModel, config: ServeConfig) -> float:
    """A video's frame rate unless the request sets one: the model's (a pipeline with a `frame_rate` argument,
    LTX-2: 24), else the server's `--video-fps`."""
    if model.accepts("frame_rate"):
        return float(model.call_defaults.get("frame_rate") or _default(model, "frame_rate") or config.video_fps)
    return config.video_fps


def default_frames(model: ServingModel) -> int:
    return model.call_defaults.get("num_frames") or _default(model, "num_frames") or 1


def size_multiple(model: ServingModel) -> int:
    """Sides must be multiples of this: the VAE's spatial factor times the transformer's patch (Wan: 8 * 2)."""
    pipe = model.sb.pipe
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or 8
    patch = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "patch_size", None) or 1
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    return spatial * patch


def frame_multiple(model: ServingModel) -> int:
    """Frame counts must be `k * this + 1` (the VAE's temporal factor; Wan: 4)."""
    return getattr(model.sb.pipe, "vae_scale_factor_temporal", None) or 1


def check_size(model: ServingModel, width: int, height: int, config: ServeConfig) -> None:
    multiple = size_multiple(model)
    if width % multiple or height % multiple:
        near_width, near_height = (max(multiple, round(side / multiple) * multiple) for side in (width, height))
        near = f"{near_width}x{near_height}"
        raise bad_request(f"size='{width}x{height}': {model.name} takes widths and heights that are multiples of "
                          f"{multiple} (e.g. '{near}')", "size", code="unsupported_size")
    if width * height > config.max_image_pixels:
        raise bad_request(f"size='{width}x{height}' has {width * height} pixels a frame; the most this server takes "
                          f"is {config.max_image_pixels}", "size", code="unsupported_size")


def frames_of(model: ServingModel, body: VideoCreateRequest, config: ServeConfig, fps: float) -> int:
    """The frame count from `num_frames` or `seconds` (or the default), checked against the model's VAE."""
    k, most = frame_multiple(model), config.max_video_frames
    if body.num_frames is not None and body.seconds is not None:
        raise bad_request(f"num_frames={body.num_frames} and seconds={body.seconds:g} both set; send one",
                          "num_frames")
    if body.seconds is not None:
        frames = round(body.seconds * fps) + 1
        longest = (most - 1) / fps
        if frames > most:
            raise bad_request(f"seconds={body.seconds:g} is {frames} frames at {fps:g} fps; the most this server "
                              f"makes is {most} frames ({longest:g} seconds)", "seconds", code="invalid_value")
        if (frames - 1) % k:
            below, above = (frames - 1) // k * k, ((frames - 1) // k + 1) * k
            raise bad_request(f"seconds={body.seconds:g} is {frames} frames at {fps:g} fps; {model.name} takes "
                              f"k * {k} + 1 frames: try seconds={below / fps:g} or {above / fps:g}",
                              "seconds", code="invalid_value")
        return frames
    frames = default_frames(model) if body.num_frames is None else body.num_frames
    if frames > most:
        raise bad_request(f"num_frames={frames}: the most this server makes is {most}", "num_frames")
    if (frames - 1) % k:
        below, above = (frames - 1) // k * k + 1, ((frames - 1) // k + 1) * k + 1
        choices = f"{below} or {above}" if below >= 1 else f"{above}"
        raise bad_request(f"num_frames={frames}: {model.name} takes frame counts k * {k} + 1; try {choices}",
                          "num_frames", code="invalid_value")
    return frames


def _default(model: ServingModel, argument: str) -> Any:
    parameter = inspect.signature(type(model.sb.pipe).__call__).parameters.get(argument)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def video_card(model: ServingModel, config: ServeConfig) -> dict[str, Any]:
    """What `/v1/models` says about a video model beyond OpenAI's fields; `sizes`: what `check_size` takes."""
    width, height = default_video_size(model)
    multiple = size_multiple(model)
    sizes = {"min_side": multiple, "multiple": multiple, "max_pixels": config.max_image_pixels}
    return {"pipeline": type(model.sb.pipe).__name__, "kind": "video", "default_size": f"{width}x{height}",
            "sizes": sizes, "edits": {},
            "video": {"image_to_video": model.image_to_video, "size_multiple": size_multiple(model),
                      "frame_multiple": frame_multiple(model), "default_frames": default_frames(model)},
            **model.defaults_card()}
