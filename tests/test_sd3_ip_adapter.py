"""SD3 IP-Adapter through StepBatched: image-prompt requests with their own images, embeddings and scales share
transformer forwards with each other and with text-only requests; each equals the plain pipeline run alone."""

import functools

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.callbacks import IPAdapterScaleCutoffCallback

from diffusers_stepbatch.decoders.vae import CPU_DECODES_APART
from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.scheduler import SchedulerConfig
from diffusers_stepbatch.testing import add_random_sd3_ip_adapter, tiny_sd3_pipeline

from .references import TOLERANCE, count_forwards, engine_held, ip_adapter_scale, max_diff, seeded


@functools.cache
def ip_pipe():
    pipe = tiny_sd3_pipeline()
    add_random_sd3_ip_adapter(pipe)
    return pipe


def image(seed, size=32):
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def kwargs_for(prompt="a red circle", seed=0, steps=3, **extra):
    return {"prompt": prompt, "height": 32, "width": 32, "num_inference_steps": steps, "seed": seed,
            "output_type": "pt", **extra}


def given_embeds(seed, rows=2, tokens=16):
    return torch.randn(rows, tokens, 32, generator=torch.Generator().manual_seed(seed))  # [negative, positive]


def plain_run(pipe, kwargs, scale):
    with ip_adapter_scale(pipe, scale, restore=0.5):
        return pipe(**seeded(kwargs)).images


def run_in_lockstep(pipe, cases):
    sizes, hook = count_forwards(pipe.transformer)
    images = []
    image_hook = pipe.image_encoder.register_forward_pre_hook(lambda m, args: images.append(args[0].shape[0]))
    try:
        # NOTE: cost_aware=False: one forward per group, so stats()["splits"] shows the keys' reasons only
        with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=32, cost_aware=False)) as sb:
            futures = []
            with engine_held(sb, kwargs_for(steps=1)):  # every request starts in lockstep
                for kwargs, scale in cases:
                    pipe.set_ip_adapter_scale(scale)
                    futures.append(sb.submit(**seeded(kwargs)))
                pipe.set_ip_adapter_scale(0.5)
            results = [future.result(300).images for future in futures]
            stats = sb.stats()
    finally:
        hook.remove()
        image_hook.remove()
        pipe.set_ip_adapter_scale(0.5)
    return results, sizes, images, stats


@pytest.mark.parametrize("steps", [2, 4])
def test_image_prompt_requests_share_forwards_and_equal_plain_runs(steps):
    pipe = ip_pipe()
    cases = [  # (call kwargs, pipeline IP scale at submit)
        (kwargs_for(steps=steps, ip_adapter_image=image(0)), 0.5),
        (kwargs_for("a blue square", 1, steps, ip_adapter_image=image(1), guidance_scale=3.0), 1.0),
        (kwargs_for(seed=2, steps=steps, ip_adapter_image_embeds=given_embeds(2)), 0.7),
        (kwargs_for("a green cross", 3, steps), 0.5),  # text only
        (kwargs_for(seed=4, steps=steps, ip_adapter_image=image(4),
                    callback_on_step_end=IPAdapterScaleCutoffCallback(cutoff_step_ratio=0.5)), 1.0),
        (kwargs_for(seed=5, steps=steps, ip_adapter_image=image(5), guidance_scale=1.0), 0.8),  # no CFG
    ]
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    results, sizes, images, stats = run_in_lockstep(pipe, cases)
    for (kwargs, scale), got, want in zip(cases, results, expected):
        assert max_diff(got, want) <= TOLERANCE, (sorted(kwargs), scale)
    assert max(sizes) == 2 * 5 + 1  # every request, text-only included, in one forward
    assert max(images) >= 2  # the requests' images were encoded together
    assert stats["splits"] == {f"decode: {CPU_DECODES_APART}": 4}  # the 4 others' decodes, by rule
    assert max_diff(expected[0], plain_run(pipe, cases[0][0], 0.0)) > 1e-3  # the image prompt matters


def test_an_image_at_scale_zero_is_the_text_only_model_as_in_the_pipeline():
    pipe = ip_pipe()
    kwargs = kwargs_for(ip_adapter_image=image(3))
    expected = plain_run(pipe, kwargs, 0.0)
    with ip_adapter_scale(pipe, 0.0, restore=0.5), StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert max_diff(got, expected) <= TOLERANCE


def test_sizes_run_in_their_own_forwards_and_stay_exact():
    pipe = ip_pipe()
    cases = [(kwargs_for(ip_adapter_image=image(0)), 0.5),
             (dict(kwargs_for("a blue square", 1, ip_adapter_image=image(1)), height=48, width=32), 0.5),
             (dict(kwargs_for("a green cross", 2, ip_adapter_image=image(2)), height=32, width=48), 0.5)]
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    results, _, _, stats = run_in_lockstep(pipe, cases)
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0  # packing refused: an IP-Adapter is loaded
    # 2 extra sizes, each step; each decode alone on the CPU (and of another size)
    assert stats["splits"] == {"denoise: latent size": 2 * 3, f"decode: latent size; {CPU_DECODES_APART}": 2}


@pytest.mark.parametrize("overrides, message", [
    (dict(ip_adapter_image=[image(0), image(1)]), "ip_adapter_image has 2 images"),
    (dict(ip_adapter_image_embeds=given_embeds(0, rows=1)), r"ip_adapter_image_embeds is \(1, 16, 32\)"),
    (dict(ip_adapter_image_embeds=[given_embeds(0)]), "ip_adapter_image_embeds is list"),
    (dict(ip_adapter_image=image(0), ip_adapter_image_embeds=given_embeds(0)), "not both"),
    (dict(ip_adapter_image=image(0), skip_guidance_layers=[0]), "skip_guidance_layers with an SD3 IP-Adapter"),
])
def test_bad_ip_adapter_input_raises_in_caller(overrides, message):
    with StepBatched(ip_pipe()) as sb, pytest.raises(ValueError, match=message):
        sb.submit(**seeded(kwargs_for(**overrides)))


def test_image_prompt_without_an_ip_adapter_is_an_error():
    with StepBatched(tiny_sd3_pipeline()) as sb, pytest.raises(ValueError, match="load_ip_adapter"):
        sb.submit(**seeded(kwargs_for(ip_adapter_image=image(0))))


def test_text_only_requests_with_skip_layer_guidance_share_forwards_with_image_prompts():
    pipe = ip_pipe()
    cases = [(kwargs_for(ip_adapter_image=image(0), steps=4), 0.5),
             (kwargs_for("a green cross", 3, 4, skip_guidance_layers=[0], skip_layer_guidance_start=0.0), 0.5)]
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    results, _, _, _ = run_in_lockstep(pipe, cases)
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
