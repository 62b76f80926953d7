"""Property: FLUX.2 klein requests with any mix of sizes, reference images (none, or several of other sizes) and
arrival order each equal their own solo run; Z-Image the same over sizes and guidance; Qwen-Image 2.1 over sizes,
prompt lengths, condition images and its KV cache on or off."""

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.testing.image_models import (
    tiny_flux2_klein_pipeline, tiny_qwenimage21_pipeline, tiny_z_image_pipeline,
)

from .references import TOLERANCE, call_with_delays, max_diff, seeded

SIZES = [(32, 32), (32, 64), (64, 32), (48, 48)]
REFERENCE_SIZES = [(64, 64), (64, 96), (96, 64)]  # FLUX.2's image processor takes sides of 64 px and more


@functools.cache
def klein():
    return tiny_flux2_klein_pipeline()


@functools.cache
def z_image():
    return tiny_z_image_pipeline()


@functools.cache
def reference(size: tuple[int, int], shade: int) -> Image.Image:
    pixels = torch.rand(size[0], size[1], 3, generator=torch.Generator().manual_seed(shade)) * 255
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def klein_kwargs(size, seed, steps, references):
    kwargs = dict(prompt=f"a cat {seed}", height=size[0], width=size[1], num_inference_steps=steps, seed=seed,
                  guidance_scale=1.0, output_type="pt", text_encoder_out_layers=(1,), max_sequence_length=32)
    if references:
        kwargs["image"] = [reference(ref_size, shade) for ref_size, shade in references]
    return kwargs


def z_image_kwargs(size, seed, steps, guidance):
    return dict(prompt=f"a dog {seed}", negative_prompt="bad" if guidance > 1 else None, height=size[0],
                width=size[1], num_inference_steps=steps, guidance_scale=guidance, seed=seed, output_type="pt",
                max_sequence_length=16)


@functools.lru_cache(maxsize=None)
def klein_solo(*key):
    return klein()(**seeded(klein_kwargs(*key))).images


@functools.lru_cache(maxsize=None)
def z_image_solo(*key):
    return z_image()(**seeded(z_image_kwargs(*key))).images


klein_requests = st.lists(st.fixed_dictionaries({
    "size": st.sampled_from(SIZES),
    "seed": st.integers(0, 2),
    "steps": st.integers(1, 3),
    "references": st.lists(st.tuples(st.sampled_from(REFERENCE_SIZES), st.integers(0, 1)), max_size=2).map(tuple),
    "delay_ms": st.integers(0, 20),
}), min_size=2, max_size=4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cost_aware=st.booleans(), requests=klein_requests)
def test_flux2_klein_mixes_of_sizes_and_reference_images_equal_solo(cost_aware, requests):
    keys = [(r["size"], r["seed"], r["steps"], r["references"]) for r in requests]
    expected = [klein_solo(*key) for key in keys]
    with StepBatched(klein(), scheduler=SchedulerConfig(max_batch_size=8, cost_aware=cost_aware)) as sb:
        results = call_with_delays(sb, [klein_kwargs(*key) for key in keys], [r["delay_ms"] for r in requests])
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE


z_image_requests = st.lists(st.fixed_dictionaries({
    "size": st.sampled_from(SIZES),
    "seed": st.integers(0, 2),
    "steps": st.integers(1, 3),
    "guidance": st.sampled_from([0.0, 3.0]),
    "delay_ms": st.integers(0, 20),
}), min_size=2, max_size=4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cost_aware=st.booleans(), requests=z_image_requests)
def test_z_image_mixes_of_sizes_and_guidance_equal_solo(cost_aware, requests):
    keys = [(r["size"], r["seed"], r["steps"], r["guidance"]) for r in requests]
    expected = [z_image_solo(*key) for key in keys]
    with StepBatched(z_image(), scheduler=SchedulerConfig(max_batch_size=8, cost_aware=cost_aware)) as sb:
        results = call_with_delays(sb, [z_image_kwargs(*key) for key in keys], [r["delay_ms"] for r in requests])
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE


@functools.cache
def qwenimage21():
    return tiny_qwenimage21_pipeline()


def qwenimage21_kwargs(size, seed, steps, prompt, conditions, use_kv_cache):
    kwargs = dict(prompt=prompt, num_inference_steps=steps, seed=seed, output_type="pt", output_resolution=64,
                  use_kv_cache=use_kv_cache)
    if conditions:  # NOTE: the output takes the last condition image's aspect
        kwargs["image"] = [reference(ref_size, shade) for ref_size, shade in conditions]
    else:
        kwargs.update(height=size[0] * 2, width=size[1] * 2)  # sizes are multiples of 32
    return kwargs


@functools.lru_cache(maxsize=None)
def qwenimage21_solo(*key):
    return qwenimage21()(**seeded(qwenimage21_kwargs(*key))).images


qwenimage21_requests = st.lists(st.fixed_dictionaries({
    "size": st.sampled_from(SIZES),
    "seed": st.integers(0, 2),
    "steps": st.integers(1, 3),
    "prompt": st.sampled_from(["a cat", "a red circle", "a blue square on grass"]),
    "conditions": st.lists(st.tuples(st.sampled_from(REFERENCE_SIZES), st.integers(0, 1)), max_size=2).map(tuple),
    "use_kv_cache": st.booleans(),
    "delay_ms": st.integers(0, 20),
}), min_size=2, max_size=4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cost_aware=st.booleans(), requests=qwenimage21_requests)
def test_qwenimage21_mixes_of_sizes_prompts_and_condition_images_equal_solo(cost_aware, requests):
    keys = [(r["size"], r["seed"], r["steps"], r["prompt"], r["conditions"], r["use_kv_cache"]) for r in requests]
    expected = [qwenimage21_solo(*key) for key in keys]
    with StepBatched(qwenimage21(), scheduler=SchedulerConfig(max_batch_size=8, cost_aware=cost_aware)) as sb:
        results = call_with_delays(sb, [qwenimage21_kwargs(*key) for key in keys], [r["delay_ms"] for r in requests])
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
