"""From a validated request to images: pipeline arguments, the engine call, and the streamed events.

A request is submitted through the engine's public API (`submit`, `stream`), so it is validated exactly as a
Python call is, in the caller, before it is queued. A client that goes away aborts its request between two
denoising steps: the non-streaming path aborts the `Future`; the streaming path stops iterating `stream()`.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import PIL.Image

from .encoding import encode_image, preview_image, size_of
from .extra_fields import extra_arguments
from .model import ServingModel
from .protocol import ImageEditRequest, ImageOptions, bad_request, check_request, parse_size

# Pipeline argument -> the request field a client sets it with (the `param` of a 400 about that argument).
FIELD_OF_ARGUMENT = {
    "prompt": "prompt", "height": "size", "width": "size", "num_images_per_prompt": "n",
    "negative_prompt": "negative_prompt", "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale", "true_cfg_scale": "true_cfg_scale", "generator": "seed",
    "strength": "strength", "image": "image", "mask_image": "mask", "deadline": "deadline_s", "priority": "priority",
}
_EXTRA_ARGUMENTS = ("negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale")


class ClientDisconnected(Exception):
    """The HTTP client went away before its request finished."""


class RequestFailed(Exception):
    """A queued request ended in an error (`cause`): not the client's input, which `submit` checked already."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Generation:
    """One planned request: the engine it goes to, the pipeline's arguments and how the answer is shaped.

    `kind` is "generation" or "edit" (the names of the streamed events); `task` what served it ("generate",
    "inpaint", "img2img", "reference").
    """

    sb: Any
    kwargs: dict[str, Any]
    priority: int
    deadline: float | None
    width: int
    height: int
    num_steps: int
    output_format: str
    compression: int | None
    partial_images: int
    seed: int
    kind: str = "generation"
    task: str = "generate"
    user: str | None = None
    tenant: str | None = None  # the key's tenant (fair share, the live panel's privacy); None: an open server
    stream: bool = False
    overlay: tuple[Any, Any] | None = None  # (mask, original): an inpainting edit keeps the unmasked pixels
    request_ids: list[int] = field(default_factory=list)  # the engine requests it submitted (the live panel)

    def finish(self, images: list[Any]) -> list[Any]:
        """The answer's images: an inpainting edit's outside its mask are the original's (as OpenAI's edits)."""
        if self.overlay is None:
            return images
        mask, original = self.overlay
        return [self.sb.pipe.image_processor.apply_overlay(mask, original, image) for image in images]

    def partial_steps(self) -> list[int]:
        """The steps after which a partial image is sent: `partial_images` evenly spread, none at the end."""
        k = self.partial_images
        steps = {round(self.num_steps * (i + 1) / (k + 1)) for i in range(k)}
        return sorted(s for s in steps if 1 <= s < self.num_steps)

    @property
    def event_prefix(self) -> str:
        return "image_edit" if self.kind == "edit" else "image_generation"


def plan_generation(model: ServingModel, body: ImageOptions, max_prompt_chars: int) -> Generation:
    """Map an OpenAI generation request onto the pipeline's `__call__` arguments; 400 for what it can't take."""
    _check_makes_images(model)
    check_request(body, max_prompt_chars)
    width, height = parse_size(body.size, model.default_size)
    if model.sizes is not None:
        model.sizes.check(width, height, model.name)
    return _plan(model, model.generation_engine(), body, width, height, {})


def plan_edit(model: ServingModel, body: ImageEditRequest, inputs: Any, max_prompt_chars: int) -> Generation:
    """Map an edit (its images already decoded and checked) onto the edit pipeline that serves it."""
    from .edits import check_reference_images, pick_edit, takes_several_images

    _check_makes_images(model)
    check_request(body, max_prompt_chars)
    task, sb = pick_edit(model.edits, inputs.mask is not None, model.name)
    first = inputs.images[0]
    if body.size in (None, "auto"):
        width, height = first.size
        if model.sizes is not None and not model.sizes.accepts(width, height):
            width, height = model.sizes.nearest(width, height)  # NOTE: "auto": the closest size the model draws
    else:
        width, height = parse_size(body.size, first.size)
        if model.sizes is not None:
            model.sizes.check(width, height, model.name)
    if task == "reference":  # NOTE: reference-edit pipelines size (and crop) their input images themselves
        images = list(inputs.images)
        check_reference_images(sb.pipe, images)
    else:
        images = [image if image.size == (width, height) else
                  image.resize((width, height), PIL.Image.Resampling.LANCZOS) for image in inputs.images]
    if len(images) > 1 and not takes_several_images(type(sb.pipe)):
        raise bad_request(f"image: {len(images)} images sent, but {type(sb.pipe).__name__} edits one image "
                          f"({task}); send one", "image", code="too_many_images")
    arguments: dict[str, Any] = {"image": images if len(images) > 1 else images[0]}
    if task == "inpaint":
        mask = inputs.mask or PIL.Image.new("L", first.size, 255)  # NOTE: no mask: the whole image is redrawn
        arguments["mask_image"] = mask if mask.size == (width, height) else mask.resize((width, height))
    if body.strength is None and task == "inpaint" and model.accepts("strength", sb):
        arguments["strength"] = 1.0  # NOTE: OpenAI's edits redraw the masked part entirely
    elif body.strength is not None:
        if not model.accepts("strength", sb):
            raise bad_request(f"strength={body.strength} is not an argument of {type(sb.pipe).__name__} ({task} "
                              f"edits); leave it out", "strength", code="unsupported_parameter")
        arguments["strength"] = body.strength
    generation = _plan(model, sb, body, width, height, arguments)
    generation.kind, generation.task = "edit", task
    if task == "inpaint" and inputs.mask is not None and hasattr(sb.pipe, "image_processor"):
        generation.overlay = (arguments["mask_image"], images[0])
    strength = generation.kwargs.get("strength", _default(sb, "strength"))
    if isinstance(strength, (int, float)):  # NOTE: img2img-style pipelines run only the last strength * N steps
        steps = generation.num_steps
        generation.num_steps = steps - int(max(steps - min(steps * strength, steps), 0))
    return generation


def _check_makes_images(model: ServingModel) -> None:
    if model.makes_videos:
        raise bad_request(f"{model.name} ({type(model.sb.pipe).__name__}) makes videos, not images; use POST "
                          f"/v1/videos", "model", code="images_not_supported")


def _plan(model: ServingModel, sb: Any, body: ImageOptions, width: int, height: int,
          arguments: dict[str, Any]) -> Generation:
    pipe_name = type(sb.pipe).__name__
    kwargs = {k: v for k, v in model.call_defaults.items() if model.accepts(k, sb)}
    kwargs.update(prompt=body.prompt, height=height, width=width, output_type="pil", **arguments)
    if body.n != 1:
        if not model.accepts("num_images_per_prompt", sb):
            raise bad_request(f"n={body.n}: {pipe_name} makes one image per call; use n=1", "n")
        kwargs["num_images_per_prompt"] = body.n
    for name in _EXTRA_ARGUMENTS:
        value = getattr(body, name)
        if value is None:
            continue
        if not model.accepts(name, sb):
            raise bad_request(f"{name}={value!r} is not an argument of {pipe_name}; leave it out", name,
                              code="unsupported_parameter")
        kwargs[name] = value
    kwargs.update(extra_arguments(body.model_extra, type(sb.pipe), set(type(body).model_fields)))
    kwargs.update(lora_arguments(model, body.lora, body.model))
    check_steps(model, kwargs.get("num_inference_steps"))
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    import torch

    # NOTE: a CPU generator gives the same image for a seed on every device (diffusers' randn_tensor moves it).
    kwargs["generator"] = torch.Generator().manual_seed(seed)
    return Generation(
        sb=sb, kwargs=kwargs, priority=body.priority, deadline=body.deadline_s, width=width, height=height,
        num_steps=kwargs.get("num_inference_steps") or _default_steps(sb), output_format=body.output_format,
        compression=body.output_compression, partial_images=body.partial_images or 0, seed=seed, user=body.user,
        stream=body.stream,
    )


def lora_arguments(model: ServingModel, lora: Any, requested: str | None = None) -> dict[str, Any]:
    """`adapters=` for the request's `lora` ({} is the base model: the pipe's active adapters never apply); a
    request for an adapter's name as its `model` (vLLM's way) gets that adapter at weight 1."""
    if lora is None and requested is not None and requested != model.name:
        lora = {requested: 1.0}
    if model.lora is None:
        if lora:
            raise bad_request(f"lora: {model.name} serves no LoRA adapters (start the server with --lora-modules or "
                              f"--lora-dir)", "lora", code="lora_not_found")
        return {}
    return {"adapters": model.lora.weights(lora)}


def check_steps(model: ServingModel, steps: Any) -> None:
    """A 400 for more steps than the server's cap (`--max-steps`, the preset's), before queueing (fewer than 1
    is the pipeline's own check)."""
    if isinstance(steps, int) and steps > model.max_steps:
        raise bad_request(f"num_inference_steps={steps}: this server runs at most {model.max_steps} steps "
                          f"(--max-steps)", "num_inference_steps", code="invalid_value")


def _default(sb: Any, argument: str) -> Any:
    parameter = inspect.signature(type(sb.pipe).__call__).parameters.get(argument)
    return None if parameter is None else parameter.default


def _default_steps(sb: Any) -> int:
    steps = _default(sb, "num_inference_steps")
    return steps if isinstance(steps, int) else 1


def usage(model: ServingModel, generation: Generation, images: list[Any]) -> dict[str, Any]:
    """OpenAI's usage object: prompt tokens from the pipeline's tokenizer; image tokens = 16x16-pixel patches of
    the input images (edits) and of the output images."""
    tokenizer = getattr(model.sb.pipe, "tokenizer", None)
    text_tokens = len(tokenizer(generation.kwargs["prompt"]).input_ids) if tokenizer is not None else 0
    inputs = generation.kwargs.get("image")
    inputs = [] if inputs is None else inputs if isinstance(inputs, list) else [inputs]
    image_tokens = sum((image.width // 16) * (image.height // 16) for image in inputs)
    output_tokens = sum((image.width // 16) * (image.height // 16) for image in images)
    return {"input_tokens": text_tokens + image_tokens,
            "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": image_tokens},
            "output_tokens": output_tokens, "total_tokens": text_tokens + image_tokens + output_tokens}


class DisconnectWatch:
    """Resolves when the ASGI client disconnects; `race(awaitable)` raises `ClientDisconnected` if it does first."""

    def __init__(self, receive: Any):
        self.task = asyncio.ensure_future(self._wait(receive))

    @staticmethod
    async def _wait(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def race(self, awaitable: Any) -> Any:
        work = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({work, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            if work.cancelled():  # the engine cancelled it (closed with cancel_pending)
                raise RequestFailed(asyncio.CancelledError("the engine cancelled this request"))
            return work.result()
        work.cancel()
        raise ClientDisconnected()

    def close(self) -> None:
        self.task.cancel()


async def generate(model: ServingModel, generation: Generation, watch: DisconnectWatch) -> list[Any]:
    """Run one request to its PIL images; a disconnect (or a cancelled task) aborts it in the engine."""
    # NOTE: submit only validates and plans (no model call): inline, a thread hop per request cost more here
    handle = generation.sb.submit(priority=generation.priority, deadline=generation.deadline,
                                  tenant=generation.tenant, **generation.kwargs)
    generation.request_ids.append(handle.request_id)
    try:
        output = await watch.race(asyncio.wrap_future(handle))
    except (ClientDisconnected, RequestFailed):
        raise
    except Exception as exc:
        raise RequestFailed(exc) from exc
    finally:
        handle.abort()  # no-op once finished; between two steps otherwise
    return generation.finish(output.images)


class StreamPump:
    """Iterates `StepBatched.stream()` (a blocking iterator) in its own thread into an asyncio queue.

    `stop()` makes the thread close the iterator at its next item, which aborts the request (previews come
    every step, so that is the next step boundary).
    """

    def __init__(self, iterator: Any, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), name="stepbatch-stream", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shut down): nobody is listening
            self._stop.set()

    def _run(self, iterator: Any) -> None:
        try:
            for item in iterator:
                if self._stop.is_set():
                    return
                self._put(("item", item))
            self._put(("end", None))
        except BaseException as exc:  # noqa: BLE001 - every outcome goes to the consumer
            self._put(("error", exc))
        finally:
            iterator.close()  # aborts the request if it has not finished

    def stop(self) -> None:
        self._stop.set()

    async def next(self) -> tuple[str, Any]:
        return await self.queue.get()


async def open_stream(model: ServingModel, generation: Generation) -> StreamPump:
    """Submit a streaming request (bad input raises here, before anything is sent) and start its pump."""
    iterator = generation.sb.stream(preview_every=1, priority=generation.priority, deadline=generation.deadline,
                                    tenant=generation.tenant, **generation.kwargs)
    generation.request_ids.append(iterator.request_id)
    return StreamPump(iterator, asyncio.get_running_loop())


def partial_events(generation: Generation, preview: Any, index: int, scale: int) -> list[dict[str, Any]]:
    """`image_generation.partial_image` (or `image_edit.partial_image`) events, one per image, for one preview."""
    created = int(time.time())
    events = []
    for i, thumbnail in enumerate(preview.images):
        image = preview_image(thumbnail, scale)
        events.append({
            "type": f"{generation.event_prefix}.partial_image", "partial_image_index": index, "image_index": i,
            "b64_json": encode_image(image, generation.output_format, generation.compression),
            "created_at": created, "size": size_of(image), "output_format": generation.output_format,
            "quality": "auto", "background": "opaque"})
    return events


def completed_events(generation: Generation, images: list[Any], usage_: dict[str, Any]) -> list[dict[str, Any]]:
    """`image_generation.completed` (or `image_edit.completed`) events, one per image."""
    created = int(time.time())
    return [
        {"type": f"{generation.event_prefix}.completed", "image_index": i,
         "b64_json": encode_image(image, generation.output_format, generation.compression),
         "created_at": created, "size": size_of(image), "output_format": generation.output_format,
         "quality": "auto", "background": "opaque", "usage": usage_}
        for i, image in enumerate(images)
    ]
