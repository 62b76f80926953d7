"""The turn-taking between a generic request's step program (engine thread) and its pipeline call (a helper
thread): the call runs until a proxied model call, which the program yields as a work item; exactly one of them
runs at a time."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from typing import Any

import torch

from ...engine.batch import WorkItem
from ...engine.ownership import current_owner, run_for
from ..request_state import active_view
from .proxies import ProxyPlan


class _Aborted(BaseException):
    """Raised inside a request's pipeline call to unwind it when the request was aborted or failed."""


class _Turns:
    """The turn-taking between a request's step program (engine thread) and its pipeline call (a helper thread):
    exactly one of them runs at a time.

    NOTE: a thread, not a greenlet of the engine thread: a C++ exception that torch raises and catches inside
    the call (transformers' processors provoke some) walks the C stack for its backtrace, and on a resumed
    greenlet that walk leaves the greenlet's stack and crashes the process.
    """

    def __init__(self, view, positional: list, keywords: dict):
        self._to_call: queue.SimpleQueue = queue.SimpleQueue()
        self._to_program: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=run_for(current_owner(), self._run), args=(view, positional, keywords),
                                        daemon=True, name=f"StepBatched-{type(view).__name__}-request")
        self.waiting = False  # the call waits at a model call for the step program

    def resume(self, value: Any = None) -> tuple[str, Any]:
        """From the step program: run the call until its next model call ("call", item) or its end."""
        if self._thread.ident is None:
            self._thread.start()
        else:
            self._to_call.put(value)
        message = self._to_program.get()
        self.waiting = message[0] == "call"
        if not self.waiting:
            self._thread.join()
        return message

    def submit(self, item: WorkItem) -> None:
        """From the pipeline call: hand `item` to the step program and wait until its result is in its holder."""
        self._to_program.put(("call", item))
        if self._to_call.get() is _Aborted:
            raise _Aborted()

    def _run(self, view, positional, keywords) -> None:
        try:
            message = _run_call(view, positional, keywords)
        except BaseException as exc:  # KeyboardInterrupt / SystemExit from a step callback: the request's error
            message = ("error", exc)
        self._to_program.put(message)


def generic_program(view, positional: list, keywords: dict, proxies: ProxyPlan) -> Generator[WorkItem, Any, Any]:
    """The request's pipeline call on `view`, its model calls (`proxies`) yielded as work items."""
    turns = _Turns(view, positional, keywords)
    proxies.install(view, turns.submit)
    try:
        kind, payload = turns.resume()
        while kind == "call":
            yield payload
            kind, payload = turns.resume(None)
        if kind == "error":
            raise payload
        return payload
    finally:
        while turns.waiting:  # closed (aborted, or its batch failed) at a model call: unwind the call
            turns.resume(_Aborted)


def _run_call(view, positional, keywords) -> tuple[str, Any]:
    """The request's pipeline call, in its thread: ("done", output), ("error", exception) or ("aborted", None)."""
    try:
        with torch.no_grad(), active_view(view):
            output = view(*positional, **keywords)
    except _Aborted:
        return "aborted", None
    except Exception as exc:  # the pipeline's own error: it becomes the request's error
        return "error", exc
    return "done", output
