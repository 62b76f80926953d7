"""StepBatched(StableDiffusionXLPipeline / StableDiffusionPipeline) == the unwrapped pipeline's solo output.

Each request steps its own copy of the scheduler, so Euler and DPM-Solver (whose `model_outputs` history is
per request) requests at different steps, and even of different schedulers, share UNet forwards.
"""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

from diffusers_stepbatch import StepBatched

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, assert_batched_equals_solo, count_forwards, family_pipe, family_size, max_diff, seeded, single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = ["sdxl-euler", "sdxl-dpm", "sd-euler", "sd-dpm"]


def kwargs_for(name, **overrides):
    height, width = family_size(name)
    kwargs = dict(prompt="a red circle", height=height, width=width, num_inference_steps=3, seed=0,
                  output_type="pt")
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("guidance_scale", [1.0, 6.0])
def test_solo_equals_diffusers(name, guidance_scale):
    pipe = family_pipe(name)
    kwargs = kwargs_for(name, guidance_scale=guidance_scale, negative_prompt="blurry", guidance_rescale=0.5)
    expected = pipe(**seeded(kwargs)).images
    with StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= TOLERANCE


def mixed_requests(name):
    """Mixed guidance scales and rescales, step counts, prompt lists, clip_skip and SDXL size conditioning."""
    sdxl = name.startswith("sdxl")
    requests = [
        kwargs_for(name, guidance_scale=1.0, num_inference_steps=2, seed=1),
        kwargs_for(name, prompt="a blue square", guidance_scale=5.0, negative_prompt="noise", guidance_rescale=0.7,
                   num_inference_steps=5, seed=2),
        kwargs_for(name, prompt=["a cat", "x"], num_images_per_prompt=2, guidance_scale=2.0, num_inference_steps=4,
                   seed=3, **({"clip_skip": 1} if sdxl else {})),
        kwargs_for(name, prompt="a green cross", guidance_scale=7.5, num_inference_steps=6, seed=4,
                   output_type="np", return_dict=False),
    ]
    if sdxl:
        requests.append(kwargs_for(name, prompt="a yellow cross", guidance_scale=3.0, num_inference_steps=3, seed=5,
                                   original_size=(64, 64), crops_coords_top_left=(4, 8), negative_original_size=(16, 16),
                                   negative_target_size=(32, 32), denoising_end=0.8))
    else:
        requests.append(kwargs_for(name, prompt="a yellow cross", guidance_scale=3.0, sigmas=None, seed=5,
                                   timesteps=[901, 501, 101] if name == "sd-euler" else None))
    return requests


@pytest.mark.parametrize("name", CONFIGS)
def test_mixed_batch_equals_solo_runs(name):
    pipe = family_pipe(name)
    assert_batched_equals_solo(pipe, pipe.unet, mixed_requests(name), max_batch_size=8)


@pytest.mark.parametrize("name", ["sdxl-euler", "sd-euler"])
def test_euler_and_dpm_requests_share_forwards(name):
    """Requests submitted before and after `sb.scheduler` is swapped keep their own scheduler (and its state)."""
    pipe = family_pipe(name)
    euler = pipe.scheduler
    dpm = DPMSolverMultistepScheduler.from_config(euler.config)
    first = [kwargs_for(name, prompt=f"euler {i}", seed=i, num_inference_steps=3 + i, guidance_scale=4.0)
             for i in range(2)]
    second = [kwargs_for(name, prompt=f"dpm {i}", seed=10 + i, num_inference_steps=4 + i, guidance_scale=2.0 + i)
              for i in range(2)]
    try:
        expected = [pipe(**seeded(kwargs)).images for kwargs in first]
        pipe.scheduler = dpm
        expected += [pipe(**seeded(kwargs)).images for kwargs in second]
        pipe.scheduler = euler
        sizes, hook = count_forwards(pipe.unet)
        with StepBatched(pipe) as sb:
            futures = [sb.submit(**seeded(kwargs)) for kwargs in first]
            sb.scheduler = dpm  # falls through to the pipeline: only later submissions copy it
            futures += [sb.submit(**seeded(kwargs)) for kwargs in second]
            results = [future.result(timeout=300).images for future in futures]
        hook.remove()
    finally:
        pipe.scheduler = euler
    assert isinstance(pipe.scheduler, EulerDiscreteScheduler)
    assert all(max_diff(got, want) <= TOLERANCE for got, want in zip(results, expected))
    assert max(sizes) > 4  # more rows than either scheduler's two requests have: Euler and DPM rows together


@pytest.mark.parametrize("name, overrides, message", [
    ("sdxl-euler", dict(height=36), "divisible by 8"),
    ("sdxl-euler", dict(num_inference_steps=0), "num_inference_steps"),
    ("sdxl-euler", dict(prompt=["a", "b"], prompt_2=["c"]), "prompt_2"),
    ("sdxl-euler", dict(guidance_scale=5.0, prompt=["a", "b"], negative_prompt=["c"]), "negative_prompt"),
    ("sdxl-euler", dict(original_size=(32, 32, 32)), "added time embedding"),
    ("sdxl-euler", dict(latents=torch.zeros(1, 4, 3, 3)), "latents"),
    ("sdxl-euler", dict(ip_adapter_image_embeds=[torch.zeros(1, 1, 4)]), "need an IP-Adapter on the UNet"),
    ("sd-euler", dict(guidance_scale=5.0, prompt="a", negative_prompt=["c"]), "negative_prompt"),
    ("sd-euler", dict(generator=[torch.Generator(), torch.Generator()]), "generator"),
    ("sd-euler", dict(callback_steps=2), "deprecated"),
])
def test_bad_input_raises_value_error_in_caller(name, overrides, message):
    kwargs = kwargs_for(name, **overrides)
    kwargs.pop("seed")
    with StepBatched(family_pipe(name)) as sb:
        with pytest.raises(ValueError, match=message):
            sb.submit(**kwargs)
    assert not sb.engine.is_alive


def test_zeroed_negatives_given_embeddings_and_step_callbacks():
    """SDXL's force_zeros_for_empty_prompt, given (pooled) embeddings, and callbacks that edit conditioning."""
    pipe = family_pipe("sdxl-euler")
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt("a blue square", num_images_per_prompt=1)
    seen = {}

    def edit(step_pipe, i, t, tensors):
        seen.setdefault(step_pipe.guidance_scale, []).append(i)
        return {"latents": tensors["latents"] * 0.95, "add_text_embeds": tensors["add_text_embeds"] * 1.1}

    requests = [
        kwargs_for("sdxl-euler", prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                   negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled,
                   num_images_per_prompt=2, guidance_scale=3.0, seed=1),
        kwargs_for("sdxl-euler", guidance_scale=6.0, num_inference_steps=4, seed=2, callback_on_step_end=edit,
                   callback_on_step_end_tensor_inputs=["latents", "add_text_embeds"]),
        kwargs_for("sdxl-euler", prompt=["a", "b"], guidance_scale=2.0, seed=3),  # zeroed negatives
    ]
    pipe.register_to_config(force_zeros_for_empty_prompt=True)
    try:
        expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
        reference, seen = seen, {}
        with StepBatched(pipe) as sb:
            results = submit_all(sb, requests)
    finally:
        pipe.register_to_config(force_zeros_for_empty_prompt=False)
    assert all(max_diff(r.images, e) <= TOLERANCE for r, e in zip(results, expected))
    assert seen == reference == {6.0: [0, 1, 2, 3]}
