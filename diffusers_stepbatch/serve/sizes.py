"""`SizeRange`: the image sizes a served model draws well, advertised in `/v1/models` and enforced per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import bad_request


@dataclass(frozen=True)
class SizeRange:
    """Sides that are multiples of `multiple` in [`min_side`, `max_side`], the longer at most `max_aspect` times
    the shorter.

    >>> SizeRange(48, 128, 16, 2.0).check(96, 48)     # ok; (96, 32) or (144, 144) raise a 400 naming the range
    """

    min_side: int
    max_side: int
    multiple: int = 16
    max_aspect: float = 2.0

    def __post_init__(self):
        if not 0 < self.min_side <= self.max_side:
            raise ValueError(f"min_side={self.min_side}, max_side={self.max_side}: need 0 < min_side <= max_side")
        if self.multiple < 1 or self.max_aspect < 1:
            raise ValueError(f"multiple={self.multiple} must be >= 1 and max_aspect={self.max_aspect} >= 1")

    def sizes(self) -> list[tuple[int, int]]:
        """Every accepted (width, height)."""
        first = -(-self.min_side // self.multiple) * self.multiple
        sides = range(first, self.max_side + 1, self.multiple)
        return [(w, h) for h in sides for w in sides if self.accepts(w, h)]

    def accepts(self, width: int, height: int) -> bool:
        return (all(self.min_side <= side <= self.max_side and side % self.multiple == 0 for side in (width, height))
                and max(width, height) <= self.max_aspect * min(width, height))

    def describe(self) -> str:
        return (f"sides that are multiples of {self.multiple} from {self.min_side} to {self.max_side} pixels, "
                f"aspect ratio from 1:{self.max_aspect:g} to {self.max_aspect:g}:1")

    def check(self, width: int, height: int, model: str) -> None:
        if not self.accepts(width, height):
            raise bad_request(f"size='{width}x{height}' is not a size {model} draws; it takes {self.describe()} "
                              f"(e.g. '{self.min_side}x{self.min_side}', '{self.max_side}x{self.max_side // 2}')",
                              "size", code="unsupported_size")

    def nearest(self, width: int, height: int) -> tuple[int, int]:
        """The accepted size closest to (width, height) in aspect ratio, then in area."""
        import math

        def distance(size: tuple[int, int]) -> tuple[float, float]:
            w, h = size
            return abs(math.log((w / h) / (width / height))), abs(math.log((w * h) / (width * height)))

        return min(self.sizes(), key=distance)

    def listed(self, most: int = 160) -> list[tuple[int, int]]:
        """Accepted sizes to offer (the page's menu): all of them, or those on a coarser grid where there are more
        than `most` (every accepted size is still taken)."""
        step = self.multiple
        while True:
            first = -(-self.min_side // step) * step
            sides = range(first, self.max_side + 1, step)
            listed = [(w, h) for h in sides for w in sides if self.accepts(w, h)]
            if len(listed) <= most or len(sides) <= 2:
                return listed
            step *= 2

    def card(self) -> dict[str, Any]:
        """The `/v1/models` metadata."""
        return {"min_side": self.min_side, "max_side": self.max_side, "multiple": self.multiple,
                "max_aspect_ratio": self.max_aspect, "sizes": [f"{w}x{h}" for w, h in self.listed()]}
