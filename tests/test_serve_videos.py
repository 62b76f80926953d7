"""The videos API (`POST /v1/videos` and friends) around the tiny Wan 2.1 pipelines, driven by the official
`openai` client over loopback. Videos are checked against the unwrapped diffusers pipeline (same seed), both
encoded by the server's MP4 writer and decoded with PyAV.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("av", reason="the videos API needs `pip install -e .[video]`")

from PIL import Image

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.serve.video_encoding import read_mp4, to_uint8, write_mp4
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import engine_held
from .serve_helpers import ServerThread, wait_for

# NOTE: the openai client marks its videos methods deprecated (the hosted API's end); the wire format stays
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
FPS = 4  # NOTE: seconds -> frames is seconds * 4 + 1 here, so 1 s and 2 s are frame counts Wan takes (5, 9)
CONFIG = {"video_fps": FPS, "max_video_frames": 33}


@pytest.fixture(scope="module")
def wan():
    model = load_model(ServeConfig(model="tiny-wan", max_batch_size=16))
    yield model
    model.close()


@pytest.fixture(scope="module")
def app(wan):
    return create_app(ServeConfig(**CONFIG), model=wan)


@pytest.fixture(scope="module")
def url(app):
    with ServerThread(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain():
    return tiny_wan_pipeline()


def reference(pipe, prompt: str, seed: int, **call) -> np.ndarray:
    """The plain pipeline's frames (uint8) for what the server was asked."""
    call = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 4, **call}
    frames = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call).frames[0]
    return to_uint8(frames)


def encoded(frames: np.ndarray) -> np.ndarray:
    """`frames` through the server's MP4 writer and back."""
    buffer = io.BytesIO()
    write_mp4(frames, buffer, FPS)
    return read_mp4(buffer.getvalue())


def finished(client, video_id: str, timeout: float = 60.0):
    video = wait_for(lambda: (v := client.videos.retrieve(video_id)).status in ("completed", "failed") and v,
                     timeout=timeout)
    assert video, f"{video_id} did not finish in {timeout} s"
    return video


def content(client, video_id: str) -> np.ndarray:
    return read_mp4(client.videos.download_content(video_id).read())


def diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


def assert_same_video(got: np.ndarray, want: np.ndarray) -> None:
    """`got` (a decoded MP4 of the server) is `want` (the plain pipeline's uint8 frames) through the same encoder.

    fp32 noise (a batched forward) may flip a level of a few pixels; the encoder then decides a few blocks
    differently. Another seed's video differs by ~6 levels on average after encoding, 60x this bound.
    """
    error = diff(got, encoded(want))
    assert error.mean() < 0.1 and error.max() <= 16, (error.mean(), error.max())


def events(url: str, video_id: str) -> list[dict]:
    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------ lifecycle
def test_a_job_goes_from_queued_to_completed_and_its_mp4_is_the_plain_pipelines(client, plain):
    prompt = "a boat on a lake"
    video = client.videos.create(model="tiny-wan", prompt=prompt, size="48x32",
                                 extra_body={"num_frames": 9, "num_inference_steps": 3, "seed": 5})
    assert video.object == "video" and video.status in ("queued", "in_progress") and video.progress < 100
    assert video.size == "48x32" and video.seconds == "2" and video.model == "tiny-wan"
    assert video.completed_at is None and video.expires_at is None
    done = finished(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at >= done.created_at and done.expires_at == pytest.approx(done.completed_at + 3600, abs=1)
    got = content(client, video.id)
    assert got.shape == (9, 32, 48, 3)
    want = reference(plain, prompt, seed=5, width=48, num_inference_steps=3)
    assert_same_video(got, want)
    other = reference(plain, prompt, seed=6, width=48, num_inference_steps=3)
    assert diff(got, encoded(other)).mean() > 3  # a wrong video fails the check above
    thumbnail = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumbnail.format == "WEBP" and thumbnail.size == (48, 32)
    sheet = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").read()))
    assert sheet.format == "JPEG" and sheet.size == (3 * 48, 3 * 32)  # 9 frames: a 3 x 3 grid, row by row
    tiles = np.asarray(sheet).reshape(3, 32, 3, 48, 3).transpose(0, 2, 1, 3, 4).reshape(9, 32, 48, 3)
    for index, tile in enumerate(tiles):
        closest = min(range(9), key=lambda frame: diff(tile[None], got[frame:frame + 1]).mean())
        assert closest == index  # each tile is its frame (JPEG-compressed)


def test_seconds_become_frames_at_the_servers_fps(client, url):
    video = client.videos.create(prompt="rain", seconds="1", extra_body={"num_inference_steps": 2})
    assert video.seconds == "1" and video.num_frames == 1 * FPS + 1
    finished(client, video.id)
    data = client.videos.download_content(video.id).read()
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == FPS and stream.codec_context.name == "h264"
        assert len(list(container.decode(video=0))) == 5


def test_events_stream_progress_previews_and_the_completed_video(client, url, app, wan):
    got: dict = {}
    # NOTE: the engine waits on a blocker until the stream is subscribed, so the stream sees every step
    with engine_held(wan.sb, dict(prompt="hold", num_frames=5, height=16, width=16, num_inference_steps=2,
                                  max_sequence_length=16, output_type="pt", seed=0)):
        video = client.videos.create(prompt="a red kite",
                                     extra_body={"num_frames": 9, "num_inference_steps": 4, "seed": 1})
        reader = threading.Thread(target=lambda: got.setdefault("stream", events(url, video.id)))
        reader.start()
        run = app.state.server.videos._runs[video.id]  # this server's run of the job
        deadline = time.time() + 30
        while not run.listeners and time.time() < deadline:
            time.sleep(0.01)
    reader.join(60)
    stream = got["stream"]
    kinds = [event["type"] for event in stream]
    assert kinds[-1] == "video.completed" and stream[-1]["video"]["progress"] == 100
    progress = [event["progress"] for event in stream if event["type"] == "video.progress"]
    assert progress == sorted(progress) and progress[-1] == 95
    steps = [event["step"] for event in stream if event["type"] == "video.progress"]
    assert steps[-3:] == [2, 3, 4]  # every step after the first event
    previews = [event for event in stream if event["type"] == "video.preview"]
    assert [p["step"] for p in previews] == [1, 2, 3]  # every step but the last (4 steps: every max(1, 4 // 10))
    gif = Image.open(io.BytesIO(base64.b64decode(previews[-1]["b64_json"])))
    assert gif.format == "GIF" and gif.size == (32, 32) and gif.n_frames == previews[-1]["frames"] == 3  # latent frames
    # a stream opened after the end gets the final event at once
    assert [e["type"] for e in events(url, video.id)] == ["video.completed"]


def test_list_pages_newest_first_and_delete_removes_a_finished_job(client, app):
    ids = [client.videos.create(prompt=f"clip {i}", extra_body={"num_frames": 5, "num_inference_steps": 2}).id
           for i in range(3)]
    for video_id in ids:
        finished(client, video_id)
    page = client.videos.list(limit=2)
    assert [v.id for v in page.data] == ids[::-1][:2] and page.has_more
    assert ids[0] in [v.id for v in client.videos.list(limit=2, after=page.data[-1].id).data]
    ascending = [v.id for v in client.videos.list(order="asc", limit=100).data]
    assert ascending.index(ids[0]) < ascending.index(ids[1]) < ascending.index(ids[2])
    folder = app.state.server.videos.root / ids[0]
    assert list(folder.glob("attempt-*/video.mp4"))  # the folder of the attempt that finished
    deleted = client.videos.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0] and not folder.exists()
    with pytest.raises(openai.NotFoundError) as caught:
        client.videos.retrieve(ids[0])
    assert caught.value.body["param"] == "video_id" and caught.value.body["code"] == "video_not_found"


# ------------------------------------------------------------------------------------- engine sharing
def test_delete_cancels_a_running_job_between_steps_and_the_engine_serves_on(client, wan):
    aborted_before = wan.sb.stats()["requests_finished"].get("FINISHED_ABORTED", 0)
    long = client.videos.create(prompt="a long one", size="16x16",
                                extra_body={"num_frames": 5, "num_inference_steps": 400})
    short = client.videos.create(prompt="a short one", extra_body={"num_frames": 5, "num_inference_steps": 3})
    assert wait_for(lambda: client.videos.retrieve(long.id).progress > 0, timeout=30)
    answer = client.videos.delete(long.id)
    assert answer.deleted is False and answer.cancelled is True
    cancelled = finished(client, long.id, timeout=10)
    assert cancelled.status == "failed" and cancelled.error.code == "cancelled"
    steps_run = client.videos.retrieve(long.id).num_inference_steps
    assert steps_run == 400 and cancelled.progress < 95  # it stopped before its last step
    assert finished(client, short.id).status == "completed"
    # the engine drops it at its next step boundary
    assert wait_for(lambda: wan.sb.stats()["requests_finished"].get("FINISHED_ABORTED", 0) == aborted_before + 1)
    with pytest.raises(openai.APIStatusError) as caught:  # a failed job has no content
        client.videos.download_content(long.id)
    assert caught.value.status_code == 409 and caught.value.body["code"] == "video_not_ready"
    after = client.videos.create(prompt="after the cancel", extra_body={"num_frames": 5, "num_inference_steps": 2})
    assert finished(client, after.id).status == "completed"
    assert client.videos.delete(long.id).deleted  # a second DELETE removes the cancelled job


def test_concurrent_jobs_share_denoising_forwards_and_stay_exact(client, url, plain):
    prompts = [f"scene {i}" for i in range(4)]

    def make(i: int):
        return client.videos.create(prompt=prompts[i], extra_body={
            "num_frames": 9, "num_inference_steps": 8, "seed": 20 + i, "user": f"job-{i}"})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        videos = list(pool.map(make, range(4)))
    for video in videos:
        assert finished(client, video.id).status == "completed"
    live = httpx.get(f"{url}/v1/engine/live", params={"seconds": 60}).json()
    mine = [f for f in live["forwards"] if set(f["users"]) & {f"job-{i}" for i in range(4)}]
    assert max(len(f["users"]) for f in mine) >= 2, mine  # rows of several jobs in one forward
    assert max(f["rows"] for f in mine) > 2  # more than one job's conditional + unconditional rows
    for i, video in enumerate(videos):
        want = reference(plain, prompts[i], seed=20 + i, num_inference_steps=8)
        assert_same_video(content(client, video.id), want)


def test_a_client_that_leaves_does_not_lose_the_job(client, url, app):
    video = client.videos.create(prompt="patience", extra_body={"num_frames": 5, "num_inference_steps": 100})
    with httpx.stream("GET", f"{url}/v1/videos/{video.id}/events", timeout=60) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
    # the connection closed mid-stream, after one event
    assert first["type"] == "video.progress" and first["step"] < 100
    run = app.state.server.videos._runs.get(video.id)
    assert run is None or wait_for(lambda: not run.listeners, timeout=10)  # its stream let go of the job
    left_at = client.videos.retrieve(video.id)
    assert left_at.status != "completed"
    done = finished(client, video.id)
    assert done.status == "completed" and done.num_inference_steps == 100
    assert content(client, video.id).shape == (5, 32, 32, 3)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("fields", "param"), [
    ({"size": "30x32"}, "size"),
    ({"size": "wide"}, "size"),
    ({"num_frames": 6}, "num_frames"),
    ({"num_frames": 41}, "num_frames"),  # more than the server's max_video_frames
    ({"num_frames": "many"}, "num_frames"),
    ({"seconds": "0.5"}, "seconds"),  # 3 frames: not 4k + 1
    ({"seconds": "20"}, "seconds"),  # 81 frames: over the limit
    ({"seconds": "soon"}, "seconds"),
    ({"seconds": "1", "num_frames": 5}, "num_frames"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"seed": -3}, "seed"),
    ({"prompt": " "}, "prompt"),
    ({"guidance_scale": "strong"}, "guidance_scale"),
])
def test_bad_input_is_a_400_naming_the_field(client, wan, fields, param):
    before = wan.sb.stats()["requests_finished"]
    body = {"prompt": "a valid prompt", **fields}
    with pytest.raises(openai.BadRequestError) as caught:  # multipart, as the client sends create()
        client.videos.create(prompt=body.pop("prompt"), extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:  # and the JSON form
        client.post("/videos", body={"prompt": "a valid prompt", **fields}, cast_to=object)
    assert caught.value.body["param"] == param
    assert wan.sb.stats()["requests_finished"] == before  # nothing was queued


def test_an_image_for_a_text_to_video_model_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.videos.create(prompt="a cat", input_reference=("cat.png", _png((32, 32)), "image/png"))
    assert caught.value.body["param"] == "input_reference" and caught.value.body["code"] == "unsupported_parameter"


def test_other_models_variants_and_images_routes_are_refused(client, url):
    with pytest.raises(openai.NotFoundError) as caught:
        client.videos.create(prompt="a cat", model="sora-2")
    assert caught.value.body["param"] == "model"
    video = client.videos.create(prompt="a cat", extra_body={"num_frames": 5, "num_inference_steps": 2})
    with pytest.raises(openai.APIStatusError) as caught:
        client.videos.download_content(video.id, variant="poster")
    assert caught.value.status_code == 400 and caught.value.body["param"] == "variant"
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt="a cat")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "images_not_supported"
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content",
            "/v1/videos/{video_id}/events"} <= set(paths)
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["kind"] == "video" and card["video"] == {"image_to_video": False, "size_multiple": 16,
                                                         "frame_multiple": 4, "default_frames": 9}
    # the sizes it takes: sides a multiple of 16 (from 16), at most --max-image-pixels a frame
    assert card["sizes"] == {"min_side": 16, "multiple": 16, "max_pixels": ServeConfig().max_image_pixels}
    finished(client, video.id)


def test_an_image_model_refuses_the_videos_api(base_url):
    """The toy image model (conftest's server): 400 naming `model`."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.videos.create(prompt="a cat")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "videos_not_supported"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_unknown")


# --------------------------------------------------------------------------------- retention and bounds
def test_expired_jobs_and_their_files_are_removed(wan):
    app = create_app(ServeConfig(video_retention_s=0.5, **CONFIG), model=wan)
    with ServerThread(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        video = client.videos.create(prompt="short-lived", extra_body={"num_frames": 5, "num_inference_steps": 2})
        done = finished(client, video.id)
        assert done.expires_at - done.completed_at <= 1
        folder = app.state.server.videos.root / video.id
        assert list(folder.glob("attempt-*/video.mp4"))  # the folder of the attempt that finished
        # nobody asks: the sweeper deletes it
        assert wait_for(lambda: not folder.exists(), timeout=5)
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        assert client.videos.list().data == []
        root = app.state.server.videos.root
    assert not root.exists()  # shutdown removes the server's video folder


def test_the_job_count_is_bounded(wan):
    app = create_app(ServeConfig(max_video_jobs=2, **CONFIG), model=wan)
    with ServerThread(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        slow = {"num_frames": 5, "num_inference_steps": 400}
        first, second = (client.videos.create(prompt=f"slow {i}", size="16x16", extra_body=slow) for i in range(2))
        with pytest.raises(openai.RateLimitError) as caught:
            client.videos.create(prompt="one too many", extra_body=slow)
        assert caught.value.body["code"] == "too_many_video_jobs"
        client.videos.delete(first.id)  # cancelled: finished, so it can make room
        third = client.videos.create(prompt="fits now", extra_body={"num_frames": 5, "num_inference_steps": 2})
        ids = [v.id for v in client.videos.list().data]
        assert first.id not in ids and {second.id, third.id} == set(ids)
        client.videos.delete(second.id)
        assert finished(client, third.id).status == "completed"


def test_shutdown_cancels_running_jobs(wan):
    app = create_app(ServeConfig(**CONFIG), model=wan)
    with ServerThread(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        video = client.videos.create(prompt="interrupted", size="16x16",
                                     extra_body={"num_frames": 5, "num_inference_steps": 400})
        assert wait_for(lambda: client.videos.retrieve(video.id).progress > 0, timeout=30)
        jobs = app.state.server.videos
        started = time.monotonic()
    assert time.monotonic() - started < 10
    assert not jobs._runs and not jobs.state_dir.exists()  # no --state-dir: its temporary state goes with it
    assert not any(r["status"] == "RUNNING" for r in wan.sb.stats()["requests"])


# ------------------------------------------------------------------------------------- image to video
@pytest.fixture(scope="module")
def wan_i2v():
    model = load_model(ServeConfig(model="tiny-wan-i2v"))
    yield model
    model.close()


def _png(size, colour=(200, 40, 40)) -> bytes:
    image = Image.new("RGB", size, colour)
    image.paste((20, 60, 220), (size[0] // 2, 0, size[0], size[1] // 2))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_to_video_takes_input_reference(wan_i2v):
    with ServerThread(create_app(ServeConfig(**CONFIG), model=wan_i2v)) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        png = _png((32, 32))
        video = client.videos.create(prompt="it moves", input_reference=("first.png", png, "image/png"),
                                     extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 3})
        assert finished(client, video.id).status == "completed"
        got = content(client, video.id)
        plain = tiny_wan_pipeline(image_to_video=True)
        frames = plain(image=Image.open(io.BytesIO(png)).convert("RGB"), prompt="it moves", height=32, width=32,
                       num_frames=5, num_inference_steps=2, generator=torch.Generator().manual_seed(3),
                       output_type="np").frames[0]
        assert_same_video(got, to_uint8(frames))
        # the JSON form, with the image as a data URL, makes the same video
        data_url = "data:image/png;base64," + base64.b64encode(png).decode()
        answer = httpx.post(f"{base_url}/v1/videos", json={
            "prompt": "it moves", "input_reference": {"image_url": data_url}, "num_frames": 5,
            "num_inference_steps": 2, "seed": 3}).json()
        assert finished(client, answer["id"]).status == "completed"
        assert diff(content(client, answer["id"]), got).max() == 0
        with pytest.raises(openai.BadRequestError) as caught:
            client.videos.create(prompt="no image")
        assert caught.value.body["param"] == "input_reference"
        assert caught.value.body["code"] == "missing_required_parameter"
        with pytest.raises(openai.BadRequestError) as caught:
            client.videos.create(prompt="bad image", input_reference=("x.png", b"not an image", "image/png"))
        assert caught.value.body["param"] == "input_reference"


def test_concurrent_threads_do_not_race_on_one_job(client):
    """Many pollers while a job runs: every status they see is a valid step of the lifecycle."""
    video = client.videos.create(prompt="watched", extra_body={"num_frames": 5, "num_inference_steps": 20})
    seen: list[tuple[str, int]] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            v = client.videos.retrieve(video.id)
            seen.append((v.status, v.progress))
            if v.status in ("completed", "failed"):
                return

    threads = [threading.Thread(target=poll) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stop.set()
    assert {status for status, _ in seen} <= {"queued", "in_progress", "completed"}
    assert all((progress == 100) == (status == "completed") for status, progress in seen)


@pytest.mark.parametrize("frames, shown, columns", [(1, [0], 1), (5, [0, 1, 2, 3, 4], 3), (9, list(range(9)), 3),
                                                     (81, [0, 5, 11, 16, 21, 27, 32, 37, 43, 48, 53, 59, 64, 69, 75,
                                                           80], 4)])
def test_spritesheet_layout_spaces_up_to_16_frames_evenly(frames, shown, columns):
    from diffusers_stepbatch.serve.video_encoding import spritesheet_layout

    assert spritesheet_layout(frames) == (shown, columns)
