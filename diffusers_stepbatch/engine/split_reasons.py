"""Why work items that could have shared one call did not: key fields with names, and per-round counts.

Each engine round, calls of one kind and program that ran separately are compared field by field with the
round's first; the differing fields count under `"<kind>: <field names>"` in `stats()["splits"]`:

>>> key = named_key(program="unet", **{"latent size": (4, 8, 8), "ip_adapter: image embedding shapes": ((1, 16),)})
>>> key == ("unet", (4, 8, 8), ((1, 16),))   # grouping sees a plain tuple
True

Equal keys cut apart by the cost model or a memory cap count under `SAME_KEY`; fields that vary inside one
packed call never count. A merged call that runs its requests apart inside (the model layer's fallback) reports
them with `split_inside`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

SAME_KEY = "same key: the cost model or a memory cap cut one group into several forwards"


class NamedKey(tuple):
    """A compatibility key with a name per field; hashes and compares as the plain tuple of its values."""

    names: tuple[str, ...]

    def __new__(cls, values: Iterable[Hashable], names: Sequence[str]) -> NamedKey:
        key = super().__new__(cls, values)
        if len(names) != len(key):
            raise ValueError(f"a NamedKey needs one name per field: {len(names)} names for {len(key)} fields")
        key.names = tuple(names)
        return key

    def __add__(self, other: tuple) -> NamedKey:  # NOTE: `key += (...)` keeps the names (unnamed: by position)
        names = other.names if isinstance(other, NamedKey) else [f"key field {len(self) + i}" for i in
                                                                 range(len(other))]
        return NamedKey(tuple(self) + tuple(other), self.names + tuple(names))

    def __reduce__(self):
        return NamedKey, (tuple(self), self.names)


def named_key(**fields: Hashable) -> NamedKey:
    """A work item key from named fields, in order (`program=` first, by convention)."""
    return NamedKey(fields.values(), list(fields))


def _fields(key: Any) -> dict[str, Any]:
    if isinstance(key, NamedKey):
        return dict(zip(key.names, key))
    if isinstance(key, tuple):
        return {f"key field {i}": value for i, value in enumerate(key)}
    return {"key": key}


def _program(key: Any) -> Any:
    return key[0] if isinstance(key, tuple) and key else None


def differing_fields(first: dict[str, Any], other: dict[str, Any], ignored: set[str]) -> list[str]:
    """Field names whose values differ (a field only one key has differs too), in `first`'s order."""
    names = list(first) + [name for name in other if name not in first]
    return [name for name in names if name not in ignored and first.get(name, _MISSING) != other.get(name, _MISSING)]


_MISSING = object()


@functools.lru_cache(maxsize=256)
def _cached_differing(first: Any, other: Any, ignored: frozenset, names: tuple) -> tuple[str, ...]:
    # NOTE: cached: the same pairs of keys meet every step; small, since a key may hold a tensor
    return tuple(differing_fields(_fields(first), _fields(other), ignored))


def _differing(first: Any, other: Any, ignored: frozenset = frozenset()) -> tuple[str, ...]:
    # NOTE: a NamedKey equals the plain tuple of its values: the names join the cache key
    names = (getattr(first, "names", None), getattr(other, "names", None))
    return _cached_differing(first, other, ignored, names)


def split_reasons(calls: Iterable[Sequence[tuple[str, Any]]]) -> Counter:
    """Reasons the calls of one round were not merged; `calls`: per call, its shapes' (kind, key) pairs."""
    by_program: dict[tuple, list[list[Any]]] = defaultdict(list)
    for shapes in calls:
        kind, key = shapes[0]
        by_program[(kind, _program(key))].append([shape_key for _, shape_key in shapes])
    reasons: Counter = Counter()
    for (kind, _), group in by_program.items():
        if kind == "wait" or len(group) < 2:  # NOTE: idle turns (programs/cache_hooks.py) run nothing
            continue
        inside = frozenset(name for shapes in group for other in shapes[1:] for name in _differing(shapes[0], other))
        first = group[0][0]
        for shapes in group[1:]:
            names = _differing(first, shapes[0], inside)  # fields varying inside a packed call kept no one apart
            reasons[f"{kind}: " + ("; ".join(names) if names else SAME_KEY)] += 1
    return reasons


class SplitCounter:
    """Running counts of split reasons over all engine rounds (thread-safe; `snapshot()` for `stats()`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def observe(self, calls: Iterable[Any]) -> None:
        """One round's planned calls: each a list of requests, or a packed call with `.shapes` (lists of them)."""
        planned = []
        for call in calls:
            groups = getattr(call, "shapes", None) or [call]
            planned.append([(members[0].pending.kind, members[0].pending.key) for members in groups])
        if len(planned) < 2:
            return
        reasons = split_reasons(planned)
        if reasons:
            with self._lock:
                self._counts.update(reasons)

    def add(self, reason: str, calls: int) -> None:
        with self._lock:
            self._counts[reason] += calls

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts.most_common())


_running = threading.local()


@contextlib.contextmanager
def running(counter: SplitCounter, kind: str) -> Iterator[None]:
    """While a merged call of `kind` runs on this thread, `split_inside` counts into `counter`."""
    _running.call = (counter, kind)
    try:
        yield
    finally:
        _running.call = None


def split_inside(reason: str, calls: int) -> None:
    """`calls` more calls ran apart inside the running merged call, for `reason` (nothing outside one)."""
    running_call = getattr(_running, "call", None)
    if running_call is not None and calls > 0:
        counter, kind = running_call
        counter.add(f"{kind}: {reason}", calls)
