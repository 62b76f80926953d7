"""Video TeaCache per request: the same skips in shared packed forwards as alone (`models/*/teacache.py`).

HunyuanVideo 1.5 and LTX-2 requests of different sizes and frame counts pack into one transformer call; each
request's TeaCache state decides for its own rows from its own tokens, so its result equals its solo run with
TeaCache.
"""

import functools

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache import TeaCacheState
from diffusers_stepbatch.testing.hunyuan_video_models import (
    HunyuanVideo15Size,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video15_transformer,
)
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, LTX2Size, tiny_ltx2_pipeline, tiny_ltx2_transformer

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


def _hv15_arguments(model, generator, batch=2, frames=3, height=4, width=6):
    config = model.config
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, frames, height, width, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, 7, config.text_embed_dim, generator=generator),
        encoder_attention_mask=torch.tensor([[1] * 7, [1] * 4 + [0] * 3][:batch]),
        encoder_hidden_states_2=torch.randn(batch, 5, config.text_embed_2_dim, generator=generator),
        encoder_attention_mask_2=torch.tensor([[1] * 5, [1] * 2 + [0] * 3][:batch]),
        image_embeds=torch.zeros(batch, 3, config.image_embed_dim), return_dict=False)


def test_hv15_teacache_forward_with_every_row_computing_equals_the_model_forward():
    from diffusers_stepbatch.models.hunyuan_video15.teacache import HUNYUAN_VIDEO15_COEFFICIENTS, teacache_call

    model = tiny_hunyuan_video15_transformer(HV15_SIZE)
    arguments = _hv15_arguments(model, torch.Generator().manual_seed(1))
    state = TeaCacheState(0.4, HUNYUAN_VIDEO15_COEFFICIENTS, num_steps=10)  # step 0: computes
    with torch.no_grad():
        (got,) = teacache_call(model, [state, None], arguments)
        (want,) = model(**arguments)
    assert max_diff(got, want) <= 1e-5
    inner = HV15_SIZE.heads * HV15_SIZE.head_dim
    assert state.computed_steps == 1 and state.residual.shape == (3 * 4 * 6, inner)
    # a skipping row adds its residual: with the same inputs at the next step, the output is the computed one
    state.step, state.threshold = 1, 1e9
    with torch.no_grad():
        (again,) = teacache_call(model, [state, None], arguments)
    assert state.skipped_steps == 1
    assert max_diff(again, want) <= 1e-5


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


def test_ltx2_teacache_forward_with_every_row_computing_equals_the_model_forward():
    from diffusers_stepbatch.models.ltx2.teacache import LTX2_COEFFICIENTS, teacache_call

    model = tiny_ltx2_transformer(LTX2Size())
    config, generator = model.config, torch.Generator().manual_seed(1)
    frames, height, width, audio_frames = 2, 2, 3, 5
    arguments = dict(
        hidden_states=torch.randn(2, frames * height * width, config.in_channels, generator=generator),
        audio_hidden_states=torch.randn(2, audio_frames, config.audio_in_channels, generator=generator),
        encoder_hidden_states=torch.randn(2, 6, config.caption_channels, generator=generator),
        audio_encoder_hidden_states=torch.randn(2, 6, config.caption_channels, generator=generator),
        timestep=torch.rand(2, generator=generator), encoder_attention_mask=torch.tensor([[1] * 6, [1] * 3 + [0] * 3]),
        audio_encoder_attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]), num_frames=frames, height=height,
        width=width, fps=25.0, audio_num_frames=audio_frames, return_dict=False)
    state = TeaCacheState(0.4, LTX2_COEFFICIENTS, num_steps=10)  # step 0: computes
    with torch.no_grad():
        got = teacache_call(model, [None, state], arguments)
        want = model(**arguments)
    assert max(max_diff(got[i], want[i]) for i in range(2)) <= 1e-5
    assert state.computed_steps == 1 and state.residual[0].shape[0] == frames * height * width
    # a skipping row adds its residuals: with the same inputs at the next step, the output is the computed one
    state.step, state.threshold = 1, 1e9
    with torch.no_grad():
        again = teacache_call(model, [None, state], arguments)
    assert state.skipped_steps == 1
    assert max(max_diff(again[i], want[i]) for i in range(2)) <= 1e-5


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
