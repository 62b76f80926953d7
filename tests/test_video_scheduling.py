"""Long video requests and short ones: a short request joins the running batch at the next step, and the
admission policies (sjf, priority) order minutes-long requests as they do images. Tiny Wan 2.1 pipelines."""

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def wan():
    return tiny_wan_pipeline(heads=2, head_dim=8, layers=1)


def _video(seed: int, steps: int, frames: int = 5, side: int = 16, **extra) -> dict:
    return dict(prompt=f"a ball {seed}", negative_prompt="blur", num_frames=frames, height=16, width=side,
                num_inference_steps=steps, guidance_scale=4.0, output_type="pt", max_sequence_length=16, seed=seed,
                **extra)


@pytest.mark.parametrize("frames", [5, 9])
def test_a_short_request_joins_a_running_long_one_at_the_next_step(wan, frames):
    long_steps, started = [], threading.Event()

    def long_progress(pipe, i, t, tensors):
        long_steps.append(i)
        if i == 2:
            started.set()
        return {}

    at_short_first_step: list[int] = []

    def short_progress(pipe, i, t, tensors):
        if i == 0:
            at_short_first_step.append(len(long_steps))
        return {}

    long_kwargs, short_kwargs = _video(0, 40, frames), _video(1, 3, frames)
    expected = [wan(**seeded(long_kwargs)).frames, wan(**seeded(short_kwargs)).frames]
    with StepBatched(wan, max_batch_size=8) as sb:
        long = sb.submit(**seeded(dict(long_kwargs, callback_on_step_end=long_progress)))
        assert started.wait(120)
        short = sb.submit(**seeded(dict(short_kwargs, callback_on_step_end=short_progress)))
        submitted_at = len(long_steps)
        short_frames = short.result(timeout=120).frames
        long_done_when_short_ended = len(long_steps)
        long_frames = long.result(timeout=300).frames
        rows = sb.stats()["rows_histogram"]["denoise"]
    # NOTE: before its first step ends the short request makes 4 engine calls (prompt and negative prompt encodes,
    # step 0's two CFG calls, not yet paired); the long one makes one per step, plus the step in flight
    assert at_short_first_step[0] - submitted_at <= 5, (submitted_at, at_short_first_step)
    assert long_done_when_short_ended < 40, "the short request waited for the long one to finish"
    # WanPipeline calls its transformer per CFG branch; a request's two calls of a step run as one engine call
    # (programs/generic/branch_pairs.py), and the two requests share it
    assert max(rows) == 4, rows
    assert max_diff(long_frames, expected[0]) <= TOLERANCE
    assert max_diff(short_frames, expected[1]) <= TOLERANCE


@pytest.mark.parametrize("policy, priorities, order", [
    ("fcfs", (0, 0, 0), ["running", "long", "short"]),
    ("sjf", (0, 0, 0), ["running", "short", "long"]),
    ("priority", (0, 0, 5), ["running", "short", "long"]),
])
def test_admission_policies_order_waiting_long_and_short_requests(wan, policy, priorities, order):
    finished: list[str] = []
    started = threading.Event()

    def running_progress(pipe, i, t, tensors):
        if i == 1:
            started.set()
        return {}

    # NOTE: 2 rows (CFG) per request and 2 per forward: one request at a time, the policy alone picks the next
    config = SchedulerConfig(max_batch_size=2, policy=policy)
    with StepBatched(wan, scheduler=config) as sb:
        running = sb.submit(**seeded(dict(_video(0, 12), callback_on_step_end=running_progress)),
                            priority=priorities[0])
        assert started.wait(120)
        handles = {"running": running,
                   "long": sb.submit(**seeded(_video(1, 12)), priority=priorities[1]),
                   "short": sb.submit(**seeded(_video(2, 2)), priority=priorities[2])}
        for name, handle in handles.items():
            handle.add_done_callback(lambda _, name=name: finished.append(name))
        for handle in handles.values():
            handle.result(timeout=300)
    assert finished == order


@pytest.mark.parametrize("small, large", [((5, 16), (13, 16)), ((9, 16), (9, 32))])
def test_sjf_weighs_a_video_by_its_frames_and_size(wan, small, large):
    finished: list[str] = []
    started = threading.Event()

    def running_progress(pipe, i, t, tensors):
        if i == 1:
            started.set()
        return {}

    with StepBatched(wan, scheduler=SchedulerConfig(max_batch_size=2, policy="sjf")) as sb:
        running = sb.submit(**seeded(dict(_video(0, 8), callback_on_step_end=running_progress)))
        assert started.wait(120)
        handles = {"running": running, "large": sb.submit(**seeded(_video(1, 4, *large))),
                   "small": sb.submit(**seeded(_video(2, 4, *small)))}  # equal steps, the small one last
        for name, handle in handles.items():
            handle.add_done_callback(lambda _, name=name: finished.append(name))
        for handle in handles.values():
            handle.result(timeout=300)
    assert finished == ["running", "small", "large"]


def test_aborting_a_long_video_between_steps_frees_its_rows_for_the_others(wan):
    progress, started = [], threading.Event()

    def long_progress(pipe, i, t, tensors):
        progress.append(i)
        if i == 1:
            started.set()
        return {}

    short_kwargs = _video(1, 3)
    expected = wan(**seeded(short_kwargs)).frames
    with StepBatched(wan, max_batch_size=8) as sb:
        long = sb.submit(**seeded(dict(_video(0, 200), callback_on_step_end=long_progress)))
        assert started.wait(120)
        short = sb.submit(**seeded(short_kwargs))
        assert long.abort()
        with pytest.raises(CancelledError):
            long.result(timeout=60)
        assert max_diff(short.result(timeout=60).frames, expected) <= TOLERANCE
        assert len(progress) < 200
        assert sb.stats()["running"] == 0
    assert torch.is_grad_enabled()
