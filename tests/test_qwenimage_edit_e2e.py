"""Qwen-Image-Edit and Edit-Plus end to end through the generic program, on tiny offline components.

Reference images of other sizes and aspect ratios give transformer calls of other image grids (the reference
tokens are part of each row's `img_shapes`), which pack into shared forwards; each request still equals its
solo run of the plain pipeline. The pipelines VAE-encode every reference image at ~1024x1024 (hard-coded), so
each request costs ~1 s here whatever its output size.

Results are compared as latents (`output_type="latent"`) except where a request says otherwise: the tiny VAE
decoder shrinks differences ~100x (other reference images: ~5e-4 apart as latents, ~7e-6 as pixels).
"""

import functools

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.testing.image_models import tiny_qwenimage_edit_pipeline

from .references import TOLERANCE, max_diff, seeded, single_thread, submit_all  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    "edit-tiny": {},
    "edit-wide": dict(num_layers=2, attention_head_dim=8, num_attention_heads=4, text_hidden=24, vae_base_dim=2),
}


@functools.lru_cache(maxsize=None)
def edit_pipe(config: str, pipeline_class=QwenImageEditPipeline):
    return tiny_qwenimage_edit_pipeline(pipeline_class, **CONFIGS[config])


def reference_image(width: int, height: int, seed: int) -> Image.Image:
    """A horizontal gradient between two random colours (noise images all look alike once averaged)."""
    rng = np.random.default_rng(seed)
    left, right = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0.0, 1.0, width)[None, :, None]
    return Image.fromarray((left * (1 - ramp) + right * ramp).repeat(height, 0).astype(np.uint8))


# Aspect ratios 5:3, 1:1, 5:12 and 3:2: the pipelines resize them to ~1024^2 areas of four shapes
# (1312x800, 1024x1024, 672x1600, 1248x832), so the reference grids differ.
IMAGES = [reference_image(80, 48, 1), reference_image(64, 64, 2), reference_image(40, 96, 3),
          reference_image(96, 64, 4)]


def as_latents(kwargs: dict) -> dict:
    return {"output_type": "latent", **kwargs}


def solo(pipe, kwargs: dict):
    return pipe(**seeded(as_latents(kwargs))).images


def batched(sb, requests: list[dict]) -> list:
    return [output.images for output in submit_all(sb, [as_latents(r) for r in requests])]


def assert_each_equals_solo(pipe, requests: list[dict], got: list[np.ndarray]) -> None:
    for kwargs, images in zip(requests, got):
        want = solo(pipe, kwargs)
        assert images.shape == want.shape
        assert max_diff(images, want) <= TOLERANCE, {k: v for k, v in kwargs.items() if k != "image"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_edit_requests_with_references_of_other_sizes_pack_and_equal_solo_runs(config):
    pipe = edit_pipe(config)
    requests = [
        dict(image=IMAGES[0], prompt="make it red", height=64, width=32, num_inference_steps=2, true_cfg_scale=1.0,
             seed=0),
        dict(image=IMAGES[1], prompt="a dog on grass", negative_prompt="blurry", true_cfg_scale=3.0, height=32,
             width=32, num_inference_steps=3, seed=1),
        dict(image=IMAGES[2], prompt="night", height=32, width=64, num_inference_steps=4, true_cfg_scale=1.0,
             seed=2),
        dict(image=IMAGES[3], prompt="add a hat", negative_prompt="", true_cfg_scale=2.0, height=64, width=64,
             num_inference_steps=2, seed=3, output_type="np"),
    ]
    with StepBatched(pipe, max_batch_size=8) as sb:
        got = batched(sb, requests)
        stats = sb.stats()
    assert stats["mixed"]["calls"] > 0, stats["mixed"]  # a forward held requests of different sizes
    assert max(stats["rows_histogram"]["denoise"]) > 1
    assert_each_equals_solo(pipe, requests, got)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_edit_plus_requests_with_one_two_and_three_references_share_forwards(config):
    pipe = edit_pipe(config, QwenImageEditPlusPipeline)
    requests = [
        dict(image=[IMAGES[0]], prompt="make it red", height=32, width=32, num_inference_steps=3, true_cfg_scale=1.0,
             seed=5),
        dict(image=[IMAGES[1], IMAGES[2]], prompt="the cat of 1 in 2", negative_prompt="dark", true_cfg_scale=2.5,
             height=64, width=32, num_inference_steps=2, seed=6),
        dict(image=[IMAGES[2], IMAGES[3], IMAGES[0]], prompt="mix them", height=32, width=64,
             num_inference_steps=3, true_cfg_scale=1.0, seed=7),
    ]
    with StepBatched(pipe, max_batch_size=8) as sb:
        got = batched(sb, requests)
        stats = sb.stats()
    assert stats["mixed"]["calls"] > 0, stats["mixed"]
    assert max(stats["rows_histogram"]["denoise"]) > 1
    assert_each_equals_solo(pipe, requests, got)


def test_text_to_image_and_edit_requests_in_one_engine_equal_solo_runs():
    edit = edit_pipe("edit-tiny")
    text_to_image = tiny_qwenimage_edit_pipeline(QwenImagePipeline, models_of=edit)
    edit_request = dict(image=IMAGES[1], prompt="make it blue", height=32, width=32, num_inference_steps=3,
                        true_cfg_scale=1.0, seed=8)
    text_request = dict(prompt="a blue cat", negative_prompt="red", true_cfg_scale=2.0, height=32, width=64,
                        num_inference_steps=3, seed=9)
    with StepBatched(edit, max_batch_size=8) as sb:
        sibling = sb.sibling(text_to_image)
        assert sibling.engine is sb.engine
        handles = [sb.submit(**seeded(as_latents(edit_request))), sibling.submit(**seeded(as_latents(text_request)))]
        got = [handle.result(300).images for handle in handles]
    assert max_diff(got[0], solo(edit, edit_request)) <= TOLERANCE
    assert max_diff(got[1], solo(text_to_image, text_request)) <= TOLERANCE


def count_calls(module: torch.nn.Module):
    calls: list[int] = []
    return calls, module.register_forward_pre_hook(lambda _module, _args: calls.append(1))


def test_edit_prompt_with_another_reference_image_is_encoded_again():
    pipe = edit_pipe("edit-tiny")
    images = [IMAGES[1], reference_image(64, 64, 5)]  # one size: prompt embeddings of one length
    requests = [dict(image=image, prompt="make it red", height=32, width=32, num_inference_steps=2,
                     true_cfg_scale=1.0, seed=10) for image in images]
    calls, hook = count_calls(pipe.text_encoder)
    try:
        with StepBatched(pipe) as sb:
            got = []
            for expected_calls, request in enumerate(requests, start=1):
                got.append(sb(**seeded(as_latents(request))).images)
                assert len(calls) == expected_calls  # same text, other image: not the first call's entry
    finally:
        hook.remove()
    with torch.no_grad():
        embeds = [pipe.encode_prompt("make it red", image=image)[0] for image in images]
    assert max_diff(*embeds) > 0.1  # the image reached the prompt encoder
    assert max_diff(*got) > TOLERANCE  # and the output
    assert_each_equals_solo(pipe, requests, got)


def test_same_edit_prompt_and_reference_image_is_answered_from_the_prompt_cache():
    pipe = edit_pipe("edit-tiny")
    request = dict(image=IMAGES[0], prompt="make it red", height=32, width=32, num_inference_steps=2,
                   true_cfg_scale=1.0, seed=11)
    calls, hook = count_calls(pipe.text_encoder)
    try:
        with StepBatched(pipe) as sb:
            got = [sb(**seeded(as_latents(request))).images for _ in range(2)]
    finally:
        hook.remove()
    want = solo(pipe, request)
    assert max(max_diff(images, want) for images in got) <= TOLERANCE
    assert len(calls) == 1


@pytest.mark.parametrize("pipeline_class", [QwenImageEditPipeline, QwenImageEditPlusPipeline])
@pytest.mark.parametrize("bad, message", [
    (dict(prompt=3), "`prompt` has to be of type `str` or `list` but is <class 'int'>"),
    (dict(prompt=None), "Provide either `prompt` or `prompt_embeds`"),
    (dict(max_sequence_length=2000), "`max_sequence_length` cannot be greater than 1024 but is 2000"),
])
def test_bad_edit_input_raises_in_the_caller_with_the_pipelines_words(pipeline_class, bad, message):
    pipe = edit_pipe("edit-tiny", pipeline_class)
    kwargs = dict(dict(image=IMAGES[0], prompt="x", height=32, width=32, num_inference_steps=2), **bad)
    with pytest.raises(ValueError) as plain:
        pipe(**kwargs)
    assert message in str(plain.value)
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError) as caught:
            sb.submit(**kwargs)
        assert str(caught.value) == str(plain.value)
        assert not sb.engine.scheduler.has_work()  # nothing was queued


@pytest.mark.parametrize("image", [
    pytest.param(None, marks=pytest.mark.xfail(strict=True, reason=(
        "`image` is optional in the edit pipelines' signature and their check_inputs; they read image.size in "
        "__call__, so image=None is queued and fails there with the plain pipeline's AttributeError"))),
    "photo.png",
])
def test_missing_or_mistyped_reference_image_raises_in_the_caller(image):
    pipe = edit_pipe("edit-tiny")
    kwargs = dict(image=image, prompt="x", height=32, width=32, num_inference_steps=2)
    with pytest.raises(AttributeError) as plain:  # the pipeline's own failure: `image.size`
        pipe(**kwargs)
    with StepBatched(pipe) as sb:
        with pytest.raises((TypeError, ValueError, AttributeError)) as caught:
            handle = sb.submit(**kwargs)
            handle.abort()
        assert "image" in str(caught.value), (str(caught.value), str(plain.value))
