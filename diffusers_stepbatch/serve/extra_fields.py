"""Body fields beyond an endpoint's own: a plain argument of the pipeline's `__call__` (`max_sequence_length`,
`cfg_normalization`, ...) goes to the pipeline; anything else is a 400 that names it and suggests close matches
(`num_inference_step` -> `num_inference_steps`), as OpenAI's API refuses unknown parameters.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from .protocol import bad_request

# Pipeline arguments the server sets itself (-> the field a client uses instead, or None: not settable).
SERVER_SET = {
    "prompt": "prompt", "height": "size", "width": "size", "num_images_per_prompt": "n", "generator": "seed",
    "image": "image", "mask_image": "mask", "num_frames": "num_frames", "output_type": None, "return_dict": None,
    "latents": None, "callback_on_step_end": None, "callback_on_step_end_tensor_inputs": None, "callback": None,
    "callback_steps": None, "attention_kwargs": None, "joint_attention_kwargs": None,
    "cross_attention_kwargs": None,
}
_SCALAR = (bool, int, float, str)


def pipeline_arguments(pipe_class: type) -> dict[str, inspect.Parameter]:
    """The `__call__` arguments a body may set directly: JSON scalars (or lists of them), not set by the server."""
    parameters = inspect.signature(pipe_class.__call__).parameters
    return {name: p for name, p in parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in SERVER_SET
            and not name.endswith(("_embeds", "_embeds_mask", "_embeds_masks")) and "ip_adapter" not in name}


def extra_arguments(extra: dict[str, Any] | None, pipe_class: type, endpoint_fields: set[str]) -> dict[str, Any]:
    """The pipeline arguments among a body's unknown fields (`extra`); a 400 for any other field."""
    if not extra:
        return {}
    allowed = pipeline_arguments(pipe_class)
    arguments = {}
    for name, value in extra.items():
        if name in allowed:
            arguments[name] = _typed(name, value, allowed[name].default)
            continue
        if name in SERVER_SET and name in inspect.signature(pipe_class.__call__).parameters:
            instead = SERVER_SET[name]
            hint = f"send `{instead}` instead" if instead and instead != name else "the server sets it"
            raise bad_request(f"{name}: this server sets {pipe_class.__name__}'s `{name}` itself; {hint}", name,
                              code="unsupported_parameter")
        close = difflib.get_close_matches(name, sorted(endpoint_fields | set(allowed)), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise bad_request(f"{name}: unknown parameter (neither a field of this endpoint nor an argument of "
                          f"{pipe_class.__name__}){hint}", name, code="unknown_parameter")
    return arguments


def _typed(name: str, value: Any, default: Any) -> Any:
    """`value` checked against the type of the argument's default; a string (a multipart form's) converted."""
    kind = type(default) if isinstance(default, _SCALAR) else None
    if kind not in (None, str) and isinstance(value, str):
        try:
            value = {"true": True, "false": False}[value.strip().lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            raise bad_request(f"{name}={value!r} must be a {kind.__name__}", name) from None
    if isinstance(value, list) and all(isinstance(item, _SCALAR) for item in value):
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = (value is None or kind is None and isinstance(value, _SCALAR) or kind is bool and isinstance(value, bool)
            or kind is float and number or kind is int and number and isinstance(value, int)
            or kind is str and isinstance(value, str))
    if not fits:
        expected = kind.__name__ if kind is not None else "number, string or boolean"
        raise bad_request(f"{name}={value!r} must be a {expected} (the pipeline's default is {default!r})", name)
    return value
