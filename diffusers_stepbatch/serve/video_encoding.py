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


def write_mp4(frames: np.ndarray, target: Any, fps: float, audio: Any = None, audio_sample_rate: int | None = None
              ) -> None:
    """uint8 frames [F, H, W, 3] as a deterministic H.264 MP4 (yuv420p: what browsers play), to a path or file;
    with `audio` (a waveform [channels, samples] or [samples], floats in [-1, 1]) an AAC stereo track too, made
    as diffusers' `encode_video` makes it (LTX-2's audio path)."""
    import av

    _, height, width, _ = frames.shape
    # NOTE: faststart (the index first, so a browser plays while it downloads) rewrites the file: paths only
    options = {"movflags": "+faststart"} if isinstance(target, (str, os.PathLike)) else {}
    with av.open(target, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # NOTE: with MB-tree, 8 encodes of the same small frames gave 3 different files once torch had run in
        # the process; without it, on one thread (cheap next to denoising), an MP4 is a function of its frames
        stream.options = {"crf": str(MP4_CRF), "preset": "medium", "threads": "1", "x264-params": "mbtree=0"}
        sound = None
        if audio is not None:  # NOTE: every stream is added before the first packet is muxed
            if not audio_sample_rate:
                raise ValueError("audio needs its audio_sample_rate")
            sound = container.add_stream("aac", rate=int(audio_sample_rate))
            sound.codec_context.sample_rate, sound.codec_context.layout = int(audio_sample_rate), "stereo"
            sound.codec_context.time_base = Fraction(1, int(audio_sample_rate))
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            _write_aac(container, sound, audio)


def _write_aac(container: Any, stream: Any, audio: Any) -> None:
    """The waveform as AAC: stereo (mono duplicated), clipped to [-1, 1] and quantized to int16 first, then
    resampled to the encoder's format, as diffusers' `encode_video` does."""
    import av

    samples = np.asarray(audio.detach().float().cpu() if hasattr(audio, "detach") else audio, dtype=np.float32)
    if samples.ndim == 1 or 1 in samples.shape:
        samples = np.repeat(samples.reshape(-1, 1), 2, axis=1)
    elif samples.shape[0] == 2 and samples.shape[1] != 2:
        samples = samples.T  # [channels, samples] -> [samples, channels]
    if samples.ndim != 2 or samples.shape[1] != 2:
        raise ValueError(f"audio of shape {tuple(samples.shape)}: expected [channels, samples] with 1 or 2 channels")
    packed = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)  # NOTE: truncates, as torch's .to(int16)
    rate = stream.codec_context.sample_rate
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(packed.reshape(1, -1)), format="s16", layout="stereo")
    frame.sample_rate = rate
    resampler = av.audio.resampler.AudioResampler(format=stream.codec_context.format or "fltp",
                                                  layout=stream.codec_context.layout or "stereo", rate=rate)
    next_pts = 0
    for resampled in resampler.resample(frame):
        if resampled.pts is None:
            resampled.pts = next_pts
        next_pts += resampled.samples
        resampled.sample_rate = rate
        container.mux(stream.encode(resampled))
    for packet in stream.encode():
        container.mux(packet)


def read_audio(source: Any) -> tuple[np.ndarray, int]:
    """The audio track of an MP4 (path, file or bytes): float samples [channels, samples] and the sample rate."""
    import av

    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    with av.open(source) as container:
        stream = container.streams.audio[0]
        chunks = [frame.to_ndarray() for frame in container.decode(stream)]
        return np.concatenate(chunks, axis=1), stream.codec_context.sample_rate


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
