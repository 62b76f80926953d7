"""Which engine a thread works for: the engine thread itself, and helper threads it hands control to.

A step callback runs in the engine thread (family programs) or in a request's helper thread (the generic
program, which runs the pipeline's own `__call__` there). Either way, a synchronous call of the same
`StepBatched` from it would wait for an engine that waits for it; `StepBatched.submit` asks `works_for`
and raises instead.

>>> owner = current_owner()              # in the engine thread, when starting a helper
>>> threading.Thread(target=run_for(owner, work)).start()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_local = threading.local()


def current_owner() -> Any:
    """The engine the calling thread works for, or None."""
    return getattr(_local, "owner", None)


def set_owner(owner: Any) -> None:
    _local.owner = owner


def run_for(owner: Any, target: Callable[..., Any]) -> Callable[..., Any]:
    """`target` wrapped to run as working for `owner` (for helper threads an engine starts)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        set_owner(owner)
        return target(*args, **kwargs)

    return run
