"""Running a request's `callback_on_step_end` as the pipelines do, with the request's view active.

>>> outputs = run_step_callback(callback, view, i, t, callback_kwargs)
>>> latents = outputs.pop("latents", latents)
"""

from __future__ import annotations

from typing import Any

from .request_state import active_view


def run_step_callback(callback: Any, view: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
    """Call `callback(view, step, timestep, callback_kwargs)`; the wrapper reads the view's state meanwhile.

    diffusers pops tensors from what the callback returns, so anything but a dict is the caller's bug: it fails
    that request with a TypeError that says so (instead of "'NoneType' object has no attribute 'pop'").
    """
    with active_view(view):
        outputs = callback(view, step, timestep, callback_kwargs)
    if not isinstance(outputs, dict):
        raise TypeError(
            f"callback_on_step_end returned {type(outputs).__name__}; it must return a dict (the callback_kwargs "
            "it was given, with any tensors it changed)"
        )
    return outputs
