"""Video frames to files: H.264 MP4 (PyAV), a WebP thumbnail, a JPEG spritesheet and small animated GIF previews."""

from __future__ import annotations

import io
import math
import os
from fractions import Fraction
from typing import Any

import numpy as np
import PIL.Image

SPRITESHEET_TILES = 16
MP4_CRF = 12  # NOTE: near-transparent quality; tiny and test videos stay small either way


def to_uint8(frames: Any) -> np.ndarray:
    """A pipeline's frames ([frames, H, W, 3] floats in [0, 1], as `output_type="np"` gives) as uint8 RGB."""
    array = np.asarray(frames, dtype=np.float32)
    return (array * 255).round().clip(0, 255).astype(np.uint8)


def write_mp4(frames: np.ndarray, target: Any, fps: int) -> None:
    """uint8 frames [F, H, W, 3] as a deterministic H.264 MP4 (yuv420p: what browsers play), to a path or file."""
    import av

    _, height, width, _ = frames.shape
    # NOTE: faststart (the index first, so a browser plays while it downloads) rewrites the file: paths only
    options = {"movflags": "+faststart"} if isinstance(target, (str, os.PathLike)) else {}
    with av.open(target, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # NOTE: with MB-tree, 8 encodes of the same small frames gave 3 different files once torch had run in
        # the process; without it, on one thread (cheap next to denoising), an MP4 is a function of its frames
        stream.options = {"crf": str(MP4_CRF), "preset": "medium", "threads": "1", "x264-params": "mbtree=0"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_mp4(source: Any) -> np.ndarray:
    """The frames of an MP4 (path, file or bytes) as uint8 RGB [F, H, W, 3]."""
    import av

    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    with av.open(source) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def write_thumbnail(frames: np.ndarray, target: Any) -> None:
    """The first frame as WebP (OpenAI's `variant=thumbnail`)."""
    PIL.Image.fromarray(frames[0]).save(target, format="WEBP", quality=90)


def spritesheet_layout(num_frames: int, most: int = SPRITESHEET_TILES) -> tuple[list[int], int]:
    """(the frames a spritesheet shows: up to `most`, evenly spaced, first and last included; its columns)."""
    count = min(num_frames, most)
    picked = [round(i * (num_frames - 1) / max(count - 1, 1)) for i in range(count)]
    return picked, math.ceil(math.sqrt(count))


def write_spritesheet(frames: np.ndarray, target: Any) -> None:
    """Evenly spaced frames in a grid, row by row, as JPEG (OpenAI's `variant=spritesheet`)."""
    picked, columns = spritesheet_layout(len(frames))
    _, height, width, _ = frames.shape
    rows = math.ceil(len(picked) / columns)
    sheet = np.zeros((rows * height, columns * width, 3), dtype=np.uint8)
    for tile, index in enumerate(picked):
        row, column = divmod(tile, columns)
        sheet[row * height:(row + 1) * height, column * width:(column + 1) * width] = frames[index]
    PIL.Image.fromarray(sheet).save(target, format="JPEG", quality=90)


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 frames as a looping animated GIF (a preview: `<img>` plays it, no video element needed)."""
    images = [PIL.Image.fromarray(frame) for frame in frames]
    buffer = io.BytesIO()
    duration = max(20, round(1000 / max(fps, 0.1)))
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    return buffer.getvalue()
