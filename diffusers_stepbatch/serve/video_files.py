"""`VideoFiles`: where video jobs keep their files: a local folder or any fsspec URL (`s3://...`, `memory://`).

Files are written into a local folder first (the MP4 writer rewrites its file for faststart), then a remote
store gets the whole folder in one `put`. Reading a local file serves it as it is; a remote one is read through
fsspec.

>>> files = VideoFiles("s3://bucket/videos")
>>> files.put_folder(Path("/tmp/attempt"), "video_123/attempt-1")
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .video_encoding import to_uint8, write_mp4, write_spritesheet, write_thumbnail


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class VideoFiles:
    def __init__(self, location: str | Path):
        location = str(location).removeprefix("file://")
        self.remote = is_url(location)
        if self.remote:
            import fsspec

            self.fs: Any
            self.fs, self.root = fsspec.core.url_to_fs(location)
            self.fs.makedirs(self.root, exist_ok=True)
        else:
            self.root = Path(location)
            self.root.mkdir(parents=True, exist_ok=True)

    def _remote(self, relative: str) -> str:
        return f"{str(self.root).rstrip('/')}/{relative}"

    def local_path(self, relative: str) -> Path | None:
        """The file as a local path, or None for a remote store (read it with `read`)."""
        return None if self.remote else self.root / relative

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self._remote(relative)) if self.remote else (self.root / relative).exists()

    def read(self, relative: str) -> bytes:
        return self.fs.cat_file(self._remote(relative)) if self.remote else (self.root / relative).read_bytes()

    def write(self, relative: str, data: bytes) -> None:
        if self.remote:
            self.fs.pipe_file(self._remote(relative), data)
        else:
            target = self.root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def put_folder(self, local: Path, relative: str) -> None:
        """Move a folder written locally to `relative` in the store."""
        if self.remote:
            self.fs.put(f"{local}/", self._remote(relative) + "/", recursive=True)
            shutil.rmtree(local, ignore_errors=True)
        else:
            target = self.root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(local), str(target))

    def remove(self, relative: str) -> None:
        if not self.remote:
            shutil.rmtree(self.root / relative, ignore_errors=True)
        elif self.fs.exists(self._remote(relative)):
            self.fs.rm(self._remote(relative), recursive=True)


def write_outputs(output: Any, folder: Path, fps: float, pipe: Any) -> None:
    """A finished job's files into `folder`: the MP4 (with the pipeline's audio, if it makes any), its thumbnail
    and its spritesheet. Names as `video_run.VIDEO_FILE`, ..."""
    from .video_run import SPRITESHEET_FILE, THUMBNAIL_FILE, VIDEO_FILE

    folder.mkdir(parents=True, exist_ok=True)
    frames = to_uint8(output.frames[0])
    audio = getattr(output, "audio", None)  # NOTE: LTX-2's waveforms [batch, channels, samples]
    write_mp4(frames, folder / VIDEO_FILE, fps, audio=None if audio is None else audio[0],
              audio_sample_rate=_audio_sample_rate(pipe))
    write_thumbnail(frames, folder / THUMBNAIL_FILE)
    write_spritesheet(frames, folder / SPRITESHEET_FILE)


def _audio_sample_rate(pipe: Any) -> int | None:
    """The rate of a pipeline's audio waveforms: its vocoder's output rate (LTX-2), else what it declares."""
    vocoder = getattr(pipe, "vocoder", None)
    rate = getattr(getattr(vocoder, "config", None), "output_sampling_rate", None)
    return rate or getattr(pipe, "audio_sampling_rate", None)
