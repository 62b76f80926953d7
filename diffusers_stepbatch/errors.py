"""Errors that name the call argument they are about, so a server can answer with it (OpenAI's `param`)."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A call argument's value can't be run; `argument` names it.

    >>> raise InvalidArgument("height", "height=33 must be divisible by 16")
    """

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class InvalidArgumentType(TypeError):
    """A call argument has a type the pipeline can't take; `argument` names it."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument
