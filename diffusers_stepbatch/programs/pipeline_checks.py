"""A pipeline's own `check_inputs`, its error naming the argument it is about (`InvalidArgument.argument`).

Found by what the check does, not by its words: the one argument that, put back to the pipeline's `__call__`
default, makes the check pass. An error no single argument explains (a size) stays the pipeline's `ValueError`.

>>> run_check_inputs(pipe, prompt, strength, None, negative_prompt=None)  # as pipe.check_inputs(...)
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import InvalidArgument


def run_check_inputs(pipe: Any, *args: Any, **kwargs: Any) -> None:
    """Call `pipe.check_inputs(*args, **kwargs)`; its `ValueError` comes back as `InvalidArgument` when one
    argument explains it."""
    check = pipe.check_inputs
    try:
        check(*args, **kwargs)
    except InvalidArgument:
        raise
    except ValueError as exc:
        argument = culprit(pipe, inspect.signature(check).bind(*args, **kwargs))
        if argument is None:
            raise
        raise InvalidArgument(argument, str(exc)) from exc


def culprit(pipe: Any, bound: inspect.BoundArguments) -> str | None:
    """The one argument of a `check_inputs` call whose `__call__` default makes the check pass."""
    defaults = _call_defaults(type(pipe))
    regular = {name for name, p in bound.signature.parameters.items()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for name, value in list(bound.arguments.items()):
        if name not in regular or name not in defaults or _same(value, defaults[name]):
            continue
        default = defaults[name]
        if _passes(pipe, inspect.BoundArguments(bound.signature, {**bound.arguments, name: default})):
            return name
    return None


def _passes(pipe: Any, trial: inspect.BoundArguments) -> bool:
    try:
        pipe.check_inputs(*trial.args, **trial.kwargs)
    except Exception:  # noqa: BLE001 - still failing (or failing otherwise): not this argument alone
        return False
    return True


def _call_defaults(cls: type) -> dict[str, Any]:
    parameters = inspect.signature(cls.__call__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not p.empty}


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - tensors, arrays: not a plain default
        return False
