"""Qwen-Image 2.1 (`QwenImage21Pipeline`) through the generic program and `models/qwenimage21.py`.

Requests share forwards whatever their steps, seeds and guidance, with the KV cache (the default: each request's
cache of its text and condition-image tokens, filled at its first step and read after) and without it: calls of
one joint text/image layout (one size, prompt token count and condition-image layout) merge by rows, and calls of
other layouts pack into one forward (`models/qwenimage21/packing.py`).
"""

import functools

import numpy as np
import pytest
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.testing.image_models import tiny_qwenimage21_pipeline

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {"tiny": {}, "wide": dict(heads=4, head_dim=8, axes_dims=(2, 2, 4), latent_channels=4, text_hidden=24)}


@functools.lru_cache(maxsize=None)
def pipe_for(config: str):
    return tiny_qwenimage21_pipeline(**CONFIGS[config])


def condition_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def requests() -> list[dict]:
    common = dict(output_type="pt", output_resolution=64)
    return [dict(common, prompt="a red circle", height=64, width=64, num_inference_steps=3, seed=0),
            dict(common, prompt="a red square", height=64, width=64, num_inference_steps=4, seed=7),
            dict(common, prompt="a blue square on grass", height=64, width=96, num_inference_steps=4, seed=1),
            dict(common, prompt="a cat", height=96, width=64, num_inference_steps=3, seed=2,
                 negative_prompt="blurry", true_cfg_scale=3.0),
            dict(common, prompt="make it red", image=condition_image(64, 48, 3), num_inference_steps=3, seed=3),
            dict(common, prompt="both", image=[condition_image(40, 40, 4), condition_image(64, 32, 5)],
                 num_inference_steps=2, seed=4),
            dict(common, prompt="no cache", height=64, width=64, num_inference_steps=3, seed=5, use_kv_cache=False),
            dict(common, prompt="no cache either", height=64, width=64, num_inference_steps=2, seed=6,
                 use_kv_cache=False)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_concurrent_requests_equal_their_plain_runs(config):
    pipe = pipe_for(config)
    runs = plain_and_wrapped(pipe, requests())
    for result, plain in zip(runs.wrapped, runs.plain):
        assert result.images.shape == plain.images.shape
        assert max_diff(result.images, plain.images) <= TOLERANCE
    # other sizes, prompt lengths and condition images, cache filling and reading: packed into shared forwards
    mixed = runs.stats["mixed"]
    assert mixed["calls"] > 0 and mixed["sizes_per_call"] > 1, mixed


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("size", [(64, 64), (64, 96)])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_requests_share_forwards_where_their_layout_is_one(config, size, use_kv_cache):
    pipe = pipe_for(config)
    height, width = size
    common = dict(output_type="pt", output_resolution=64, height=height, width=width, use_kv_cache=use_kv_cache)
    batch = [dict(common, prompt="a cat one", num_inference_steps=3, seed=0),  # prompts of one token count
             dict(common, prompt="a dog two", num_inference_steps=4, seed=1),
             dict(common, prompt="a cow 333", num_inference_steps=3, seed=2),
             dict(common, prompt="a longer prompt", num_inference_steps=2, seed=3)]
    runs = plain_and_wrapped(pipe, batch)
    for result, plain in zip(runs.wrapped, runs.plain):
        assert max_diff(result.images, plain.images) <= TOLERANCE
    assert max(runs.stats["rows_histogram"]["denoise"]) >= 2  # no CFG: a call of 2+ rows holds 2+ requests


def test_nested_condition_images_are_refused_with_the_pipelines_message():
    pipe = pipe_for("tiny")
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match="cannot be nested per prompt"):
        sb(prompt="a cat", image=[[condition_image(32, 32, 0)]], num_inference_steps=2, output_type="pt")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_prompts_with_the_same_condition_image_encode_apart_by_rule(config):
    """Equal images give equal `pixel_values`, but Qwen3-VL reads them as one sequence per call: never merged."""
    pipe = pipe_for(config)
    image = condition_image(64, 48, 3)
    batch = [dict(prompt=prompt, image=image, num_inference_steps=2, seed=seed, output_type="pt",
                  output_resolution=64) for seed, prompt in enumerate(("make it red", "make it blu", "make it tan"))]
    runs = plain_and_wrapped(pipe, batch)
    stats = runs.stats
    for result, plain in zip(runs.wrapped, runs.plain):
        assert max_diff(result.images, plain.images) <= TOLERANCE
    assert set(stats["rows_histogram"]["encode"]) == {1}
    assert any("Qwen3-VL image patches are one sequence" in reason for reason in stats["splits"])
    assert not any("merged call raised" in reason for reason in stats["splits"]), stats["splits"]
