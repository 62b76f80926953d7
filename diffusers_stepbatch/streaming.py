"""`StepBatched.stream`: previews every k steps, then the final output; stopping early aborts the request.

Previews ride on the pipeline's own `callback_on_step_end`, composed with the caller's callback, so every
family with a step program streams without code of its own.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .preview import FlowPreviewer, StreamPreview, latent_rgb_projection
from .video_preview import StreamVideoPreview, VideoPreviewer, video_rgb_projection

if TYPE_CHECKING:
    from .wrapper import StepBatched

_DONE = object()


def stream_call(sb: StepBatched, args: tuple, kwargs: dict, preview_every: int, **submit_options: Any
                ) -> Iterator[Any]:
    """Submit the call now (bad input raises here) and return the iterator over its previews and output."""
    if isinstance(preview_every, bool) or not isinstance(preview_every, int) or preview_every < 1:
        raise ValueError(f"preview_every={preview_every!r} must be an int >= 1")
    pipe = sb.pipe
    # NOTE: the call options `submit` takes besides the pipeline's arguments
    call_args = sb._bind(args, {k: v for k, v in kwargs.items() if k not in ("teacache", "adapters", "decoder")})
    user_callback = call_args.get("callback_on_step_end")
    user_inputs = list(call_args.get("callback_on_step_end_tensor_inputs") or [])
    preview = _video_previews(pipe) if "num_frames" in sb._signature.parameters else _image_previews(pipe, call_args)
    previews: queue.Queue = queue.Queue()

    def on_step_end(step_pipe, index, timestep, tensors):
        outputs = {}
        if user_callback is not None:
            outputs = user_callback(step_pipe, index, timestep, {k: tensors[k] for k in user_inputs}) or {}
        latents = outputs.get("latents", tensors["latents"])
        total = step_pipe._num_timesteps
        due = (index + 1) % preview_every == 0 and index + 1 < total
        made = preview(step_pipe, index, latents, due)
        if due and made is not None:
            previews.put(dataclasses.replace(made, step=index + 1, num_steps=total))
        return outputs

    kwargs = dict(kwargs, callback_on_step_end=on_step_end,
                  callback_on_step_end_tensor_inputs=sorted(set(user_inputs) | {"latents"}))
    handle = sb.submit(*args, **submit_options, **kwargs)
    handle.add_done_callback(lambda _: previews.put(_DONE))
    return RequestStream(handle, previews)


def _image_previews(pipe: Any, call_args: dict):
    default_size = getattr(pipe, "default_sample_size", 64) * pipe.vae_scale_factor
    height, width = call_args.get("height") or default_size, call_args.get("width") or default_size
    projection = latent_rgb_projection(pipe.vae)
    previewer = FlowPreviewer(pipe, height, width)

    def preview(step_pipe, index, latents, due):
        x0 = previewer(step_pipe, index, latents)  # NOTE: every step: it keeps the previous latents
        return StreamPreview(0, 0, x0.detach().clone(), projection) if due else None

    return preview


def _video_previews(pipe: Any):
    projection = video_rgb_projection(pipe)
    previewer = None if projection is None else VideoPreviewer(pipe, projection)

    def preview(step_pipe, index, latents, due):
        if previewer is None:  # NOTE: a VAE the map can't be fitted on: no previews, the output still comes
            return None
        raw = previewer.predict(step_pipe.scheduler, index, latents, due)
        return None if raw is None else StreamVideoPreview(0, 0, previewer.frames(raw))

    return preview


class RequestStream:
    """A request's previews, then its output; closing it early aborts the request."""

    def __init__(self, handle: Any, previews: queue.Queue):
        self.request_id = handle.request_id
        self._items = _iterate(handle, previews)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Any:
        return next(self._items)

    def close(self) -> None:
        self._items.close()


def _iterate(handle, previews: queue.Queue) -> Iterator[Any]:
    try:
        while (item := previews.get()) is not _DONE:
            yield item
        yield handle.result()
    finally:
        handle.abort()  # the consumer stopped early (no-op once finished)
