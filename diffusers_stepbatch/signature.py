"""The wrapped pipeline's own call signature, plus StepBatched's keyword-only extras.

Code written for the plain pipeline inspects its call (diffusers' tests filter arguments by
`inspect.signature(pipe.__call__)`; `help(pipe)` documents them), so the wrapper's `__call__` and `submit`
carry the pipeline's parameters, with `priority`, `deadline` and `teacache` added as keyword-only ones.

>>> inspect.signature(StepBatched(pipe).__call__)
<Signature (prompt=None, ..., *, priority: int = 0, deadline: float | None = None, teacache=<engine default>)>
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class EngineDefault:
    """The sentinel for "not given": the engine's own setting (shown as such in signatures)."""

    def __repr__(self) -> str:
        return "<engine default>"


ENGINE_DEFAULT = EngineDefault()


def extra_parameters(stream: bool = False) -> list[inspect.Parameter]:
    keyword = inspect.Parameter.KEYWORD_ONLY
    extras = [
        inspect.Parameter("priority", keyword, default=0, annotation="int"),
        inspect.Parameter("deadline", keyword, default=None, annotation="float | None"),
        inspect.Parameter("teacache", keyword, default=ENGINE_DEFAULT, annotation="TeaCacheConfig | None"),
    ]
    if stream:
        extras.insert(0, inspect.Parameter("preview_every", keyword, default=4, annotation="int"))
    return extras


def wrapper_signature(pipeline_call: Callable[..., Any], stream: bool = False) -> inspect.Signature:
    """`pipeline_call`'s signature (with its `self`) plus the extras, placed before any `**kwargs`."""
    parameters = list(inspect.signature(pipeline_call).parameters.values())
    names = {parameter.name for parameter in parameters}
    extras = [extra for extra in extra_parameters(stream) if extra.name not in names]
    var_keyword = [p for p in parameters if p.kind == p.VAR_KEYWORD]
    others = [p for p in parameters if p.kind != p.VAR_KEYWORD]
    return inspect.Signature(others + extras + var_keyword, return_annotation=inspect.Signature.empty)


def signed(function: Callable[..., Any], signature: inspect.Signature, doc: str | None) -> Callable[..., Any]:
    function.__signature__ = signature
    function.__doc__ = doc
    return function
