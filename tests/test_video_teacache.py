"""Video TeaCache per request: the same skips in shared packed forwards as alone (`models/*/teacache.py`).

HunyuanVideo 1.5 and LTX-2 requests of different sizes and frame counts pack into one transformer call; each
request's TeaCache state decides for its own rows from its own tokens, so its result equals its solo run with
TeaCache.
"""

import functools

import pytest

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.testing.hunyuan_video_models import HunyuanVideo15Size, tiny_hunyuan_video15_pipeline
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, tiny_ltx2_pipeline

from .references import TOLERANCE, max_diff, seeded, single_thread, submit_all  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

HV15_SIZE = HunyuanVideo15Size(heads=4, head_dim=8, layers=2)


@functools.cache
def _hv15_pipe():
    return tiny_hunyuan_video15_pipeline(HV15_SIZE, guidance_scale=3.0)


def _hv15_requests():
    # (height, width, num_frames, steps): other sizes, frame counts and step counts
    shapes = [(16, 16, 5, 12), (16, 32, 9, 13), (32, 16, 5, 12), (32, 32, 9, 14)]
    prompts = ["a cat", 'a sign that reads "open"', "a red ball on grass", "a dog"]
    return [dict(prompt=prompt, negative_prompt="blurry", height=height, width=width, num_frames=frames,
                 num_inference_steps=steps, output_type="pt", seed=i)
            for i, (prompt, (height, width, frames, steps)) in enumerate(zip(prompts, shapes))]


def test_hv15_teacache_in_shared_packed_forwards_equals_teacache_alone():
    pipe = _hv15_pipe()
    requests = _hv15_requests()
    requests[1]["teacache"] = None  # this one computes every step, beside the others
    exact = [pipe(**seeded({k: v for k, v in kwargs.items() if k != "teacache"})).frames for kwargs in requests]
    teacache = TeaCacheConfig(threshold=0.3)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
        batched = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.frames, want) for got, want in zip(batched, solo)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert max_diff(solo[1], exact[1]) <= TOLERANCE  # teacache=None: every step computed
    assert min(max_diff(solo[i], exact[i]) for i in (0, 2, 3)) > 10 * TOLERANCE, "TeaCache skipped no step"


def test_hv15_threshold_zero_never_skips():
    pipe = _hv15_pipe()
    kwargs = _hv15_requests()[0]
    exact = pipe(**seeded(kwargs)).frames
    # NOTE: a polynomial that is negative everywhere: any positive threshold would skip every inner step
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.0, coefficients=(-1.0,))) as sb:
        assert max_diff(sb(**seeded(kwargs)).frames, exact) <= TOLERANCE


@functools.cache
def _ltx2_pipe():
    return tiny_ltx2_pipeline()


def _ltx2_requests():
    # (height, width, num_frames, steps, guidance): other sizes, frame counts, step counts, with and without CFG
    shapes = [(32, 32, 5, 12, 3.0), (32, 64, 9, 13, 1.0), (64, 32, 5, 12, 1.0), (32, 32, 9, 14, 2.0)]
    return [dict(LTX2_PLAIN, prompt="a robot " * (i + 1), negative_prompt="blurry", height=height, width=width,
                 num_frames=frames, frame_rate=25.0, num_inference_steps=steps, guidance_scale=guidance,
                 output_type="pt", seed=i)
            for i, (height, width, frames, steps, guidance) in enumerate(shapes)]


def test_ltx2_teacache_in_shared_packed_forwards_equals_teacache_alone():
    pipe = _ltx2_pipe()
    requests = _ltx2_requests()
    requests[1]["teacache"] = None  # this one computes every step, beside the others
    exact = [pipe(**seeded({k: v for k, v in kwargs.items() if k != "teacache"})) for kwargs in requests]
    teacache = TeaCacheConfig(threshold=0.5)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
        batched = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max(max_diff(got.frames, want.frames), max_diff(got.audio, want.audio))
               for got, want in zip(batched, solo)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert max(max_diff(solo[1].frames, exact[1].frames), max_diff(solo[1].audio, exact[1].audio)) <= TOLERANCE
    assert min(max_diff(solo[i].frames, exact[i].frames) for i in (0, 2, 3)) > 10 * TOLERANCE, "no step skipped"


def test_ltx2_threshold_zero_never_skips():
    pipe = _ltx2_pipe()
    kwargs = _ltx2_requests()[0]
    exact = pipe(**seeded(kwargs))
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.0, coefficients=(-1.0,))) as sb:
        got = sb(**seeded(kwargs))
    assert max(max_diff(got.frames, exact.frames), max_diff(got.audio, exact.audio)) <= TOLERANCE
