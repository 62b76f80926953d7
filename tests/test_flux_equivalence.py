"""StepBatched(FluxPipeline) output == the unwrapped FluxPipeline's solo output, alone and batched."""

import threading
import time

import numpy as np
import PIL.Image
import pytest
import torch

from diffusers_stepbatch import StepBatched

from .references import TOLERANCE, count_forwards, flux_pipe, max_diff, seeded

SIZES = {"dev-tiny": (32, 32), "schnell-tiny": (32, 48), "dev-wide": (24, 40)}


def base_kwargs(name, **overrides):
    height, width = SIZES[name]
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0,
                  output_type="pt", max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("true_cfg", [False, True])
@pytest.mark.parametrize("steps", [1, 4])
def test_solo_equals_diffusers(flux_name, true_cfg, steps):
    pipe = flux_pipe(flux_name)
    extra = dict(negative_prompt="blurry", true_cfg_scale=2.5) if true_cfg else {}
    kwargs = base_kwargs(flux_name, num_inference_steps=steps, guidance_scale=4.0, **extra)
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("output_type", ["pil", "np", "latent"])
def test_output_types_match(output_type):
    pipe = flux_pipe("dev-tiny")
    kwargs = base_kwargs("dev-tiny", output_type=output_type)
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
        as_tuple = sb(**seeded(kwargs), return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 1
    if output_type == "pil":
        assert isinstance(got[0], PIL.Image.Image) and got[0].size == expected[0].size == (32, 32)
        assert np.abs(np.asarray(got[0], dtype=int) - np.asarray(expected[0], dtype=int)).max() <= 1
    else:
        assert type(got) is type(expected) and max_diff(got, expected) <= TOLERANCE


def test_prompt_lists_images_per_prompt_and_generator_lists():
    pipe = flux_pipe("schnell-tiny")
    generators = lambda: [torch.Generator().manual_seed(s) for s in range(6)]  # noqa: E731
    kwargs = base_kwargs("schnell-tiny", prompt=["a cat", "a dog", "a cow"], num_images_per_prompt=2)
    del kwargs["seed"]
    expected = pipe(**kwargs, generator=generators()).images
    with StepBatched(pipe) as sb:
        got = sb(**kwargs, generator=generators()).images
    assert got.shape[0] == 6 and max_diff(got, expected) <= TOLERANCE


def test_custom_sigmas_prompt_embeds_and_prompt_2():
    pipe = flux_pipe("dev-tiny")
    embeds, pooled, _ = pipe.encode_prompt("a blue square", prompt_2=None, max_sequence_length=16)
    cases = [
        base_kwargs("dev-tiny", sigmas=[1.0, 0.7, 0.3], num_inference_steps=None),
        base_kwargs("dev-tiny", prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled),
        base_kwargs("dev-tiny", prompt_2="a green cross on a gray background"),
    ]
    with StepBatched(pipe) as sb:
        for kwargs in cases:
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "prompt"}
            assert max_diff(sb(**seeded(kwargs)).images, pipe(**seeded(kwargs)).images) <= TOLERANCE


def test_callback_on_step_end_sees_its_own_request():
    pipe = flux_pipe("dev-tiny")
    seen = {}

    def shrink(step_pipe, i, t, tensors):
        seen.setdefault(step_pipe.guidance_scale, []).append((i, float(t)))
        return {"latents": tensors["latents"] * 0.9}

    kwargs = base_kwargs("dev-tiny", num_inference_steps=4, callback_on_step_end=shrink,
                         callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    expected = {g: pipe(**seeded(kwargs), guidance_scale=g).images for g in (2.0, 7.0)}
    reference_steps = {g: list(v) for g, v in seen.items()}
    seen.clear()
    with StepBatched(pipe) as sb:
        futures = {g: sb.submit(**seeded(kwargs), guidance_scale=g) for g in (2.0, 7.0)}
        for g, future in futures.items():
            assert max_diff(future.result().images, expected[g]) <= TOLERANCE
    assert seen == reference_steps  # each callback saw its own guidance scale and its own 4 steps
    assert pipe._guidance_scale == 7.0  # set by the last unwrapped call above, untouched by StepBatched


def test_interrupt_from_callback_stops_only_that_request():
    pipe = flux_pipe("dev-tiny")

    def interrupt_after_one(step_pipe, i, t, tensors):
        step_pipe._interrupt = True
        return {}

    stopped = base_kwargs("dev-tiny", num_inference_steps=5, callback_on_step_end=interrupt_after_one)
    normal = base_kwargs("dev-tiny", num_inference_steps=5, seed=3)
    expected_stopped = pipe(**seeded(stopped)).images
    expected_normal = pipe(**seeded(normal)).images
    with StepBatched(pipe) as sb:
        a, b = sb.submit(**seeded(stopped)), sb.submit(**seeded(normal))
        assert max_diff(a.result().images, expected_stopped) <= TOLERANCE
        assert max_diff(b.result().images, expected_normal) <= TOLERANCE


def mixed_requests(name):
    """Six or more requests that differ in prompt, seed, steps (3-12), guidance and true CFG."""
    prompts = ["a red circle", "a blue square at the top left", "a cat", "a yellow cross", "x", "a green triangle"]
    requests = []
    for i, prompt in enumerate(prompts + ["a white square", "a black circle"]):
        cfg = dict(negative_prompt="noise", true_cfg_scale=1.5 + i) if i % 3 == 1 else {}
        requests.append(base_kwargs(name, prompt=prompt, seed=100 + i, num_inference_steps=3 + (i * 5) % 10,
                                    guidance_scale=1.0 + i, **cfg))
    return requests


def test_staggered_threads_equal_solo_runs(flux_name):
    pipe = flux_pipe(flux_name)
    requests = mixed_requests(flux_name)
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    results = [None] * len(requests)
    sizes, hook = count_forwards(pipe.transformer)
    sb = StepBatched(pipe, max_batch_size=8)

    def call(i):
        time.sleep(0.004 * i)
        results[i] = sb(**seeded(requests[i])).images

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        hook.remove()
        sb.close()
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
    assert max(sizes) > 1, "the transformer never ran a batch larger than one"
    assert sb.stats()["rows_histogram"]["denoise"].keys() - {1}
    assert max(sizes) <= 8


def test_max_batch_size_bounds_rows():
    pipe = flux_pipe("schnell-tiny")
    requests = [base_kwargs("schnell-tiny", prompt=f"p{i}", seed=i, num_inference_steps=4) for i in range(5)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with StepBatched(pipe, max_batch_size=2) as sb:
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
            got = [future.result().images for future in futures]
    finally:
        hook.remove()
    assert max(sizes) == 2
    assert all(max_diff(g, e) <= TOLERANCE for g, e in zip(got, expected))
