"""LTX-2 through the videos API: the MP4 carries the model's audio track (AAC) and plays at the model's frame
rate (or the request's `fps`), equal to what diffusers' own `encode_video` makes of the plain pipeline's output
for the same seed."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
av = pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")

from diffusers.utils.export_utils import encode_video

from diffusers_stepbatch.serve.video_encoding import read_audio, read_mp4, to_uint8, write_mp4
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, tiny_ltx2_pipeline

from .serve_helpers import Served, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
CALL = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def served():
    with Served(tiny_ltx2_pipeline(), "tiny-ltx2", call_defaults={**LTX2_PLAIN, **CALL}) as served:
        yield served


def plain_output(seed: int, frame_rate: float):
    pipe = tiny_ltx2_pipeline()
    return pipe(prompt="a drum", generator=torch.Generator().manual_seed(seed), output_type="np",
                frame_rate=frame_rate, **LTX2_PLAIN, **CALL)


def video_rate(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as container:
        return float(container.streams.video[0].average_rate)


@pytest.mark.parametrize("fps", [None, 12])
def test_the_mp4_has_the_models_audio_and_frame_rate(served, tmp_path, fps):
    extra = {"seed": 3} if fps is None else {"seed": 3, "fps": fps}
    video = served.client.videos.create(prompt="a drum", model="tiny-ltx2", extra_body=extra)
    done = wait_for(lambda: (v := served.client.videos.retrieve(video.id)).status in ("completed", "failed") and v,
                    timeout=120)
    assert done and done.status == "completed", done
    rate = 24.0 if fps is None else 12.0  # LTX-2's own frame_rate default, or the request's
    assert done.fps == rate and done.seconds == f"{8 / rate:g}"
    data = served.client.videos.download_content(video.id).read()
    assert video_rate(data) == rate
    plain = plain_output(3, rate)
    reference = tmp_path / "diffusers.mp4"
    encode_video(plain.frames[0], fps=int(rate), output_path=str(reference), audio=plain.audio[0].float(),
                 audio_sample_rate=served.model.sb.pipe.vocoder.config.output_sampling_rate)
    got, got_rate = read_audio(data)
    want, want_rate = read_audio(str(reference))
    assert got_rate == want_rate == 16000 and got.shape == want.shape and got.shape[0] == 2
    assert np.abs(got - want).max() < 1e-3  # the same waveform through the same AAC path
    # the frames: the plain pipeline's, through the server's encoder
    buffer = io.BytesIO()
    write_mp4(to_uint8(plain.frames[0]), buffer, rate)
    error = np.abs(read_mp4(data).astype(np.int16) - read_mp4(buffer.getvalue()).astype(np.int16))
    assert error.mean() < 0.1 and error.max() <= 16, (error.mean(), error.max())


def test_the_requests_frame_rate_reaches_the_model(served):
    """LTX-2 conditions on `frame_rate` (the audio spans num_frames / frame_rate seconds): the same seed at 12
    and 24 fps gives another soundtrack, so the comparisons above would see a rate that never reached it."""
    tracks = {}
    for fps in (24, 12):
        video = served.client.videos.create(prompt="a bell", model="tiny-ltx2", extra_body={"seed": 1, "fps": fps})
        assert wait_for(lambda: served.client.videos.retrieve(video.id).status == "completed", timeout=120)
        tracks[fps] = read_audio(served.client.videos.download_content(video.id).read())[0]
    assert np.abs(tracks[12] - tracks[24]).max() > 0.01
