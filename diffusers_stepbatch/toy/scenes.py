"""Procedural toy scenes: one coloured shape on a plain background, with a fixed caption grammar.

A scene is a small dataclass of discrete attributes (caption) plus continuous jitter (size and offset), so
the same scene renders at any resolution and aspect ratio: `render_scene(scene, 64)` for training,
`render_scene(scene, 256)` as 4x ground truth and `render_scene(scene, (128, 64))` (width, height) draw the same
picture. Positions are fractions of each side; the object's size is a fraction of the shorter side.

>>> import numpy as np
>>> scene = sample_scene(np.random.default_rng(0))
>>> parse_caption(caption(scene)).color == scene.color
True
>>> render_scene(scene, 64).size
(64, 64)
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (30, 180, 30),
    "blue": (30, 60, 230),
    "yellow": (250, 230, 30),
    "orange": (250, 140, 0),
    "purple": (140, 40, 200),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle", "cross")
# Object centres as fractions of the image side (x, y), y pointing down.
POSITIONS: dict[str, tuple[float, float]] = {
    "at the top left": (0.25, 0.25),
    "at the top right": (0.75, 0.25),
    "at the bottom left": (0.25, 0.75),
    "at the bottom right": (0.75, 0.75),
    "in the center": (0.5, 0.5),
}
SCALE_RANGE = (0.25, 1 / 3)  # object side as a fraction of the image's shorter side
MAX_OFFSET = 0.03  # centre jitter, fraction of the image side
NATIVE_SIZE = 64  # training resolution of the shipped model
SUPERSAMPLE = 4  # anti-aliasing: draw at 4x, then box-filter down

_CAPTION_RE = re.compile(
    r"^a (?P<color>\w+) (?P<shape>\w+) (?P<position>at the (?:top|bottom) (?:left|right)|in the center)"
    r" on a (?P<background>\w+) background$"
)


@dataclasses.dataclass(frozen=True)
class Scene:
    """One object on a plain background.

    Args:
        color: key of `COLORS`.
        shape: one of `SHAPES`.
        position: key of `POSITIONS`.
        background: key of `BACKGROUNDS`, never equal to `color`.
        scale: object side as a fraction of the image side, within `SCALE_RANGE`.
        dx, dy: offset of the object centre from its anchor, fractions of the image side.
    """

    color: str
    shape: str
    position: str
    background: str
    scale: float = 0.29
    dx: float = 0.0
    dy: float = 0.0

    def __post_init__(self):
        for name, allowed in (
            ("color", COLORS),
            ("shape", SHAPES),
            ("position", POSITIONS),
            ("background", BACKGROUNDS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
        if self.color == self.background:
            raise ValueError(f"color={self.color!r} equals background={self.background!r}; pick another background")
        lo, hi = SCALE_RANGE
        if not lo - 1e-9 <= self.scale <= hi + 1e-9:
            raise ValueError(f"scale={self.scale} is outside {SCALE_RANGE}")
        if max(abs(self.dx), abs(self.dy)) > MAX_OFFSET + 1e-9:
            raise ValueError(f"offset ({self.dx}, {self.dy}) exceeds MAX_OFFSET={MAX_OFFSET}")


def caption(scene: Scene) -> str:
    """The scene's caption: `a {color} {shape} {position} on a {background} background`."""
    return f"a {scene.color} {scene.shape} {scene.position} on a {scene.background} background"


def parse_caption(text: str) -> Scene:
    """Inverse of `caption`; the returned scene has nominal size and no jitter."""
    match = _CAPTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"caption {text!r} does not follow 'a {{color}} {{shape}} {{position}} on a {{background}} background'")
    return Scene(**match.groupdict())


def all_captions() -> list[str]:
    """Every caption of the grammar (440), in a fixed order."""
    return [
        caption(Scene(c, s, p, b))
        for c, s, p, b in itertools.product(COLORS, SHAPES, POSITIONS, BACKGROUNDS)
        if c != b
    ]


def heldout_captions() -> list[str]:
    """Captions never used in training: two (shape, background) combinations per (color, position) pair."""
    rng = np.random.default_rng(20240606)
    held = []
    for color, position in itertools.product(COLORS, POSITIONS):
        combos = [(s, b) for s, b in itertools.product(SHAPES, BACKGROUNDS) if b != color]
        for i in rng.choice(len(combos), size=2, replace=False):
            shape, background = combos[i]
            held.append(caption(Scene(color, shape, position, background)))
    return held


def train_captions() -> list[str]:
    held = set(heldout_captions())
    return [c for c in all_captions() if c not in held]


def sample_scene(rng: np.random.Generator, text: str | None = None) -> Scene:
    """A random scene; with `text`, the attributes come from that caption and only size/offset are random."""
    if text is None:
        color = str(rng.choice(list(COLORS)))
        background = str(rng.choice([b for b in BACKGROUNDS if b != color]))
        base = Scene(color, str(rng.choice(SHAPES)), str(rng.choice(list(POSITIONS))), background)
    else:
        base = parse_caption(text)
    lo, hi = SCALE_RANGE
    return dataclasses.replace(
        base,
        scale=float(rng.uniform(lo, hi)),
        dx=float(rng.uniform(-MAX_OFFSET, MAX_OFFSET)),
        dy=float(rng.uniform(-MAX_OFFSET, MAX_OFFSET)),
    )


def image_size(size: int | tuple[int, int]) -> tuple[int, int]:
    """`size` as (width, height): an int is a square side."""
    width, height = (size, size) if isinstance(size, int) else size
    if min(width, height) < 8:
        raise ValueError(f"size={size} is too small; use at least 8 pixels per side")
    return width, height


def render_scene(scene: Scene, size: int | tuple[int, int]) -> Image.Image:
    """Draw `scene` as a `size` x `size` (or `(width, height)`) RGB image, anti-aliased, resolution independent."""
    width, height = image_size(size)
    big_w, big_h = width * SUPERSAMPLE, height * SUPERSAMPLE
    image = Image.new("RGB", (big_w, big_h), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    ax, ay = POSITIONS[scene.position]
    cx, cy = (ax + scene.dx) * big_w, (ay + scene.dy) * big_h
    half = scene.scale * min(big_w, big_h) / 2
    fill = COLORS[scene.color]
    if scene.shape == "circle":
        draw.ellipse([cx - half, cy - half, cx + half, cy + half], fill=fill)
    elif scene.shape == "square":
        draw.rectangle([cx - half, cy - half, cx + half, cy + half], fill=fill)
    elif scene.shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    else:  # cross: a plus sign with arms one third of the side thick
        arm = half / 3
        draw.rectangle([cx - half, cy - arm, cx + half, cy + arm], fill=fill)
        draw.rectangle([cx - arm, cy - half, cx + arm, cy + half], fill=fill)
    return image.resize((width, height), Image.Resampling.BOX)


def object_mask(scene: Scene, size: int | tuple[int, int]) -> np.ndarray:
    """Fractional coverage of the object per pixel, float32 in [0, 1], shape (height, width)."""
    shadow = dataclasses.replace(scene, color="white", background="black")
    return np.asarray(render_scene(shadow, size), dtype=np.float32)[..., 0] / 255.0
