"""`StepBatched.stream`: previews every k steps, then the final output; stopping early aborts the request.

Previews ride on the pipeline's own `callback_on_step_end`, composed with the caller's callback, so every
family with a step program streams without code of its own.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .preview import FlowPreviewer, StreamPreview, latent_rgb_projection

if TYPE_CHECKING:
    from .wrapper import StepBatched

_DONE = object()


def stream_call(sb: StepBatched, args: tuple, kwargs: dict, preview_every: int, **submit_options: Any
                ) -> Iterator[Any]:
    """Submit the call now (bad input raises here) and return the iterator over its previews and output."""
    if isinstance(preview_every, bool) or not isinstance(preview_every, int) or preview_every < 1:
        raise ValueError(f"preview_every={preview_every!r} must be an int >= 1")
    pipe = sb.pipe
    call_args = sb._bind(args, {k: v for k, v in kwargs.items() if k != "teacache"})
    default_size = getattr(pipe, "default_sample_size", 64) * pipe.vae_scale_factor
    height, width = call_args.get("height") or default_size, call_args.get("width") or default_size
    user_callback = call_args.get("callback_on_step_end")
    user_inputs = list(call_args.get("callback_on_step_end_tensor_inputs") or [])
    projection = latent_rgb_projection(pipe.vae)
    previewer = FlowPreviewer(pipe, height, width)
    previews: queue.Queue = queue.Queue()

    def on_step_end(step_pipe, index, timestep, tensors):
        outputs = {}
        if user_callback is not None:
            outputs = user_callback(step_pipe, index, timestep, {k: tensors[k] for k in user_inputs}) or {}
        latents = outputs.get("latents", tensors["latents"])
        total = step_pipe._num_timesteps
        x0 = previewer(step_pipe, index, latents)
        if (index + 1) % preview_every == 0 and index + 1 < total:
            previews.put(StreamPreview(step=index + 1, num_steps=total, latents=x0.detach().clone(),
                                       projection=projection))
        return outputs

    kwargs = dict(kwargs, callback_on_step_end=on_step_end,
                  callback_on_step_end_tensor_inputs=sorted(set(user_inputs) | {"latents"}))
    handle = sb.submit(*args, **submit_options, **kwargs)
    handle.add_done_callback(lambda _: previews.put(_DONE))
    return RequestStream(handle, previews)


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
