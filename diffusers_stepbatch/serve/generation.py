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
from dataclasses import dataclass
from typing import Any

from .encoding import encode_image, preview_image, size_of
from .model import ServingModel
from .protocol import ImageGenerationRequest, bad_request, check_request, parse_size

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
    """One planned request: the pipeline's arguments and how the answer is shaped."""

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

    def partial_steps(self) -> list[int]:
        """The steps after which a partial image is sent: `partial_images` evenly spread, none at the end."""
        k = self.partial_images
        steps = {round(self.num_steps * (i + 1) / (k + 1)) for i in range(k)}
        return sorted(s for s in steps if 1 <= s < self.num_steps)


def plan_generation(model: ServingModel, body: ImageGenerationRequest) -> Generation:
    """Map the OpenAI request onto the pipeline's `__call__` arguments; 400 for what the model can't take."""
    check_request(body)
    width, height = parse_size(body.size, model.default_size)
    pipe_name = type(model.sb.pipe).__name__
    kwargs = {k: v for k, v in model.call_defaults.items() if model.accepts(k)}
    kwargs.update(prompt=body.prompt, height=height, width=width, output_type="pil")
    if body.n != 1:
        if not model.accepts("num_images_per_prompt"):
            raise bad_request(f"n={body.n}: {pipe_name} makes one image per call; use n=1", "n")
        kwargs["num_images_per_prompt"] = body.n
    for name in _EXTRA_ARGUMENTS:
        value = getattr(body, name)
        if value is None:
            continue
        if not model.accepts(name):
            raise bad_request(f"{name}={value!r} is not an argument of {pipe_name}; leave it out", name,
                              code="unsupported_parameter")
        kwargs[name] = value
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    import torch

    # NOTE: a CPU generator gives the same image for a seed on every device (diffusers' randn_tensor moves it).
    kwargs["generator"] = torch.Generator().manual_seed(seed)
    return Generation(
        kwargs=kwargs, priority=body.priority, deadline=body.deadline_s, width=width, height=height,
        num_steps=kwargs.get("num_inference_steps") or _default_steps(model), output_format=body.output_format,
        compression=body.output_compression, partial_images=body.partial_images or 0, seed=seed,
    )


def _default_steps(model: ServingModel) -> int:
    parameter = inspect.signature(type(model.sb.pipe).__call__).parameters.get("num_inference_steps")
    return parameter.default if parameter is not None and isinstance(parameter.default, int) else 1


def usage(model: ServingModel, generation: Generation, images: list[Any]) -> dict[str, Any]:
    """OpenAI's usage object: prompt tokens from the pipeline's tokenizer, output = 16x16-pixel patches."""
    tokenizer = getattr(model.sb.pipe, "tokenizer", None)
    text_tokens = len(tokenizer(generation.kwargs["prompt"]).input_ids) if tokenizer is not None else 0
    output_tokens = sum((image.width // 16) * (image.height // 16) for image in images)
    return {"input_tokens": text_tokens, "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": 0},
            "output_tokens": output_tokens, "total_tokens": text_tokens + output_tokens}


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
    handle = model.sb.submit(priority=generation.priority, deadline=generation.deadline, **generation.kwargs)
    try:
        output = await watch.race(asyncio.wrap_future(handle))
    except (ClientDisconnected, RequestFailed):
        raise
    except Exception as exc:
        raise RequestFailed(exc) from exc
    finally:
        handle.abort()  # no-op once finished; between two steps otherwise
    return output.images


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
    iterator = model.sb.stream(preview_every=1, priority=generation.priority, deadline=generation.deadline,
                               **generation.kwargs)
    return StreamPump(iterator, asyncio.get_running_loop())


def partial_events(generation: Generation, preview: Any, index: int, scale: int) -> list[dict[str, Any]]:
    """`image_generation.partial_image` events (one per image of the request) for one preview."""
    created = int(time.time())
    events = []
    for i, thumbnail in enumerate(preview.images):
        image = preview_image(thumbnail, scale)
        events.append({
            "type": "image_generation.partial_image", "partial_image_index": index, "image_index": i,
            "b64_json": encode_image(image, generation.output_format, generation.compression),
            "created_at": created, "size": size_of(image), "output_format": generation.output_format,
            "quality": "auto", "background": "opaque"})
    return events


def completed_events(generation: Generation, images: list[Any], usage_: dict[str, Any]) -> list[dict[str, Any]]:
    """`image_generation.completed` events, one per image."""
    created = int(time.time())
    return [
        {"type": "image_generation.completed", "image_index": i,
         "b64_json": encode_image(image, generation.output_format, generation.compression),
         "created_at": created, "size": size_of(image), "output_format": generation.output_format,
         "quality": "auto", "background": "opaque", "usage": usage_}
        for i, image in enumerate(images)
    ]
