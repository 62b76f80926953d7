"""Wan 2.1 / 2.2 requests of different frame counts and sizes share packed forwards, exactly.

Wan pipelines have no dedicated program: the generic program intercepts their transformer calls and, where the
video shapes differ, packs them into one call of `models/wan/packing.py`. Every request must equal its own
unwrapped run.
"""

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models.wan.packing import WanPart
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import (  # noqa: F401
    TOLERANCE,
    max_diff,
    seeded,
    single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {"wan-tiny": dict(heads=2, head_dim=12, layers=2), "wan-wide": dict(heads=3, head_dim=8, layers=3)}
# (height, width, frames): non-square, 3 frame counts, one shape twice (so equal shapes merge plainly too)
SHAPES = [(16, 16, 5), (16, 32, 9), (32, 16, 13), (32, 32, 5), (16, 16, 5)]


@functools.lru_cache(maxsize=None)
def _pipe(config: str, **options):
    return tiny_wan_pipeline(**CONFIGS[config], **options)


def _image(height, width, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _requests(shapes, image=False, max_sequence_length=16):
    requests = []
    for i, (height, width, frames) in enumerate(shapes):
        kwargs = dict(prompt=f"a fox {'running ' * i}", height=height, width=width, num_frames=frames,
                      num_inference_steps=2 + i % 3, guidance_scale=1.0 if i == 1 else 2.0 + i,
                      output_type="pt", max_sequence_length=max_sequence_length, seed=i)
        if i % 2:
            kwargs["negative_prompt"] = "blurry " * i
        if image:
            kwargs["image"] = _image(height, width, i)
        requests.append(kwargs)
    return requests


def _packed_equals_solo(pipe, requests):
    """Submitted together, each request equals its solo unwrapped run; returns the engine's stats."""
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, max_batch_size=16) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    differences = [max_diff(got.frames, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert len({tuple(frames.shape) for frames in expected}) >= 3
    return stats


@pytest.mark.parametrize("config", list(CONFIGS))
def test_text_to_video_requests_of_different_frame_counts_and_sizes_pack(config):
    pipe = _pipe(config)
    assert program_for(pipe) is generic.plan_generic
    stats = _packed_equals_solo(pipe, _requests(SHAPES))
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


@pytest.mark.parametrize("image_kv", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_wan21_image_to_video_requests_of_different_images_and_sizes_pack(config, image_kv):
    # NOTE: with image key/value projections the model takes the last 512 context tokens as text
    pipe = _pipe(config, image_to_video=True, image_kv=image_kv)
    assert (pipe.transformer.blocks[0].attn2.add_k_proj is not None) == image_kv
    stats = _packed_equals_solo(pipe, _requests(SHAPES, image=True,
                                                max_sequence_length=512 if image_kv else 16))
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


@pytest.mark.parametrize("image_to_video", [False, True])
def test_wan22_ti2v_per_token_timesteps_pack(image_to_video):
    pipe = _pipe("wan-tiny", image_to_video=image_to_video, expand_timesteps=True)
    assert pipe.config.expand_timesteps
    stats = _packed_equals_solo(pipe, _requests(SHAPES[:4], image=image_to_video))
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]


def _rows_per_step(transformer, name, tick, log):
    # NOTE: the time projection runs once per forward, plain or packed, on one row per video and CFG branch
    def hook(_module, args):
        log.append((tick[0], name, int(args[0].shape[0])))

    return transformer.condition_embedder.time_proj.register_forward_pre_hook(hook)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_wan22_experts_run_in_one_engine_step_with_rows_grouped_per_expert(config):
    pipe = _pipe(config, experts=True)
    # UniPC with flow_shift=3: 2 steps are [999, 750], 4 are [999, 900, 750, 500], 6 start [999, 937, 857]: at
    # the second engine step the 2-step request is past the boundary (875), the others are not
    requests = [dict(kwargs, num_inference_steps=steps)
                for kwargs, steps in zip(_requests(SHAPES[:4]), (2, 4, 6, 4))]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    tick, log = [0], []
    hooks = [_rows_per_step(pipe.transformer, "high", tick, log), _rows_per_step(pipe.transformer_2, "low", tick, log)]
    try:
        sb = StepBatched(pipe, max_batch_size=16)
        with sb:
            planned = [sb._make_request((), seeded(kwargs), 0, None) for kwargs in requests]
            for request in planned:
                sb.engine.scheduler.add(request)
            with torch.no_grad():
                while sb.engine.scheduler.has_work():
                    sb.engine.step()
                    tick[0] += 1
            results = [request.handle.result().frames for request in planned]
            stats = sb.stats()
    finally:
        for hook in hooks:
            hook.remove()
    assert max(max_diff(got, want) for got, want in zip(results, expected)) <= TOLERANCE
    per_step: dict[int, dict[str, list[int]]] = {}
    for step, name, rows in log:
        per_step.setdefault(step, {}).setdefault(name, []).append(rows)
    both = [step for step, experts in per_step.items() if set(experts) == {"high", "low"}]
    assert both, per_step
    for step in both:  # one forward per expert, holding all of that expert's rows (one model call per request)
        assert [len(calls) for calls in per_step[step].values()] == [1, 1], per_step[step]
    assert per_step[both[0]] == {"high": [3], "low": [1]}, per_step[both[0]]
    assert stats["mixed"]["calls"] > 0


def wan_parts(model, shapes, generator, per_token=False, image_tokens=None, text_lengths=None, image_blocks=1):
    parts = []
    for i, (rows, frames, height, width) in enumerate(shapes):
        tokens = frames * (height // 2) * (width // 2)
        timestep = torch.rand(rows, tokens if per_token else 1, generator=generator) * 1000
        text = torch.randn(rows, text_lengths[i] if text_lengths else 16, 32, generator=generator)
        image = None if image_tokens is None else torch.randn(rows * image_blocks, image_tokens, 4,
                                                              generator=generator)
        video = torch.randn(rows, model.config.in_channels, frames, height, width, generator=generator)
        parts.append(WanPart(video, timestep if per_token else timestep[:, 0], text, image))
    return parts


def test_an_other_attention_processor_keeps_sizes_apart_and_exact():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class OwnProcessor(WanAttnProcessor):  # a custom processor: a packed call would bypass it
        pass

    pipe = tiny_wan_pipeline(**CONFIGS["wan-tiny"])
    requests = _requests(SHAPES[:3])
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    pipe.transformer.set_attn_processor(OwnProcessor())
    with StepBatched(pipe, max_batch_size=16) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0


def test_teacache_in_shared_packed_forwards_equals_teacache_alone():
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = _pipe("wan-tiny")
    requests = [dict(kwargs, num_inference_steps=12 + i) for i, kwargs in enumerate(_requests(SHAPES[:4]))]
    requests[1]["teacache"] = None  # this one computes every step, beside the others
    exact = [pipe(**seeded({k: v for k, v in kwargs.items() if k != "teacache"})).frames for kwargs in requests]
    # NOTE: the published Wan polynomials are fitted to the real models' timestep-projection changes; the tiny
    # model's are far larger, so the test rescales by the identity
    teacache = TeaCacheConfig(threshold=0.5, coefficients=(1.0, 0.0))
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
        batched = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.frames, want) for got, want in zip(batched, solo)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert max_diff(solo[1], exact[1]) <= TOLERANCE  # teacache=None: every step computed
    assert min(max_diff(solo[i], exact[i]) for i in (0, 2, 3)) > 10 * TOLERANCE, "TeaCache skipped no step"


def test_threshold_zero_never_skips_even_where_the_published_polynomial_is_negative():
    from diffusers_stepbatch.cache import TeaCacheConfig
    from diffusers_stepbatch.models.wan.teacache import WAN_COEFFICIENTS

    assert WAN_COEFFICIENTS[-1] < 0  # the polynomial at 0: a step that barely changes counts as negative
    pipe = _pipe("wan-tiny")
    kwargs = dict(_requests(SHAPES[:1])[0], num_inference_steps=8)
    exact = pipe(**seeded(kwargs)).frames
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.0, coefficients=WAN_COEFFICIENTS)) as sb:
        assert max_diff(sb(**seeded(kwargs)).frames, exact) <= TOLERANCE
