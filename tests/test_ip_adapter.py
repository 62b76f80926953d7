"""IP-Adapter through StepBatched (SD, SDXL, Flux): image-prompt requests with their own images, embeddings and scales
share UNet forwards with each other and with text-only requests; each equals the plain pipeline run alone."""

import functools

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.callbacks import IPAdapterScaleCutoffCallback

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.programs.cfg import CFGPolicy
from diffusers_stepbatch.testing import add_random_ip_adapter, tiny_flux_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline

from .references import TOLERANCE, count_forwards, engine_held, ip_adapter_scale, max_diff, seeded

BUILDERS = {"sd": tiny_sd_pipeline, "sdxl": tiny_sdxl_pipeline,
            "flux": functools.partial(tiny_flux_pipeline, guidance_embeds=True)}
FLUX_CFG = {"negative_prompt": "blurry", "true_cfg_scale": 2.0}


@functools.lru_cache(maxsize=None)
def ip_pipe(family):
    pipe = BUILDERS[family]()
    add_random_ip_adapter(pipe)
    return pipe


def image(seed):
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype("uint8"))


def kwargs_for(prompt="a red circle", seed=0, **extra):
    return {"prompt": prompt, "height": 32, "width": 32, "num_inference_steps": 4, "seed": seed, "output_type": "pt",
            **extra}


def denoiser(pipe):
    return pipe.transformer if hasattr(pipe, "transformer") else pipe.unet


def given_embeds(pipe, seed, rows=2):
    g = torch.Generator().manual_seed(seed)
    width = denoiser(pipe).encoder_hid_proj.image_projection_layers[0].image_embeds.in_features
    return [torch.randn(rows, 1, width, generator=g)]  # UNets under CFG: [negative, positive]


# (call kwargs, pipeline IP scale at submit); text-only requests run as the plain pipeline at IP scale 0
def requests(pipe):
    if hasattr(pipe, "transformer"):  # Flux: negative image prompts go with true CFG
        flux = {"max_sequence_length": 16}
        return [
            (kwargs_for(ip_adapter_image=image(0), **flux), 1.0),
            (kwargs_for("a blue square", 1, ip_adapter_image=image(1), negative_ip_adapter_image=image(6),
                        **FLUX_CFG, **flux), 0.5),
            (kwargs_for(seed=2, ip_adapter_image_embeds=given_embeds(pipe, 2, 1),
                        negative_ip_adapter_image_embeds=given_embeds(pipe, 7, 1), **FLUX_CFG, **flux), 0.7),
            (kwargs_for("a green cross", 3, **FLUX_CFG, **flux), None),
            (kwargs_for(seed=4, ip_adapter_image=image(4), **FLUX_CFG, **flux,
                        callback_on_step_end=IPAdapterScaleCutoffCallback(cutoff_step_ratio=0.5)), 1.0),
        ]
    return [
        (kwargs_for(ip_adapter_image=image(0)), 1.0),
        (kwargs_for("a blue square", 1, ip_adapter_image=image(1)), 0.5),
        (kwargs_for(seed=2, ip_adapter_image_embeds=given_embeds(pipe, 2)), 0.7),
        (kwargs_for("a green cross", 3), None),
        (kwargs_for(seed=4, ip_adapter_image=image(4),
                    callback_on_step_end=IPAdapterScaleCutoffCallback(cutoff_step_ratio=0.5)), 1.0),
    ]


def plain_run(pipe, kwargs, scale):
    kwargs = dict(kwargs)
    if scale is None:  # the model without its image branch: scale 0 and zero image embeddings
        flux = hasattr(pipe, "transformer")
        scale, kwargs["ip_adapter_image_embeds"] = 0.0, [torch.zeros_like(given_embeds(pipe, 0, 1 if flux else 2)[0])]
        if flux:
            kwargs["negative_ip_adapter_image_embeds"] = kwargs["ip_adapter_image_embeds"]
    with ip_adapter_scale(pipe, scale, restore=1.0):
        return pipe(**seeded(kwargs)).images


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_image_prompt_requests_share_forwards_and_equal_plain_runs(family):
    pipe = ip_pipe(family)
    cases = requests(pipe)
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    unet_sizes, unet_hook = count_forwards(denoiser(pipe))
    image_sizes = []
    image_hook = pipe.image_encoder.register_forward_pre_hook(lambda m, args: image_sizes.append(args[0].shape[0]))
    try:
        with StepBatched(pipe, max_batch_size=16, cfg_policy=CFGPolicy(mode="batched")) as sb:
            futures = []
            with engine_held(sb, kwargs_for(num_inference_steps=1)):  # every request starts in lockstep
                for kwargs, scale in cases:
                    pipe.set_ip_adapter_scale(1.0 if scale is None else scale)
                    futures.append(sb.submit(**seeded(kwargs)))
                pipe.set_ip_adapter_scale(1.0)
            results = [future.result(300).images for future in futures]
    finally:
        unet_hook.remove()
        image_hook.remove()
        pipe.set_ip_adapter_scale(1.0)
    for (kwargs, scale), got, want in zip(cases, results, expected):
        assert max_diff(got, want) <= TOLERANCE, (sorted(kwargs), scale)
    rows = sum(2 if kwargs.get("negative_prompt") or not hasattr(pipe, "transformer") else 1 for kwargs, _ in cases)
    assert max(unet_sizes) == rows  # every request, text-only included, in one forward
    assert max(image_sizes) >= 2  # the requests' images were encoded together
    assert max_diff(expected[0], plain_run(pipe, kwargs_for(ip_adapter_image=image(0)), 0.0)) > 1e-3


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_request_alone_with_an_image_equals_diffusers(family):
    pipe = ip_pipe(family)
    kwargs = kwargs_for(ip_adapter_image=[image(5)], guidance_scale=1.0)
    if family == "flux":
        kwargs.update(max_sequence_length=16, guidance_scale=3.5, **FLUX_CFG)
    expected = plain_run(pipe, kwargs, 0.8)
    with ip_adapter_scale(pipe, 0.8, restore=1.0), StepBatched(pipe) as sb:
        got = sb(**seeded(kwargs)).images
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("overrides, message", [
    (dict(ip_adapter_image=[image(0), image(1)]), "ip_adapter_image has 2 entries for 1 IP-Adapters"),
    (dict(ip_adapter_image_embeds=[torch.zeros(1, 1, 16)]), r"ip_adapter_image_embeds\[0\] has 1 rows"),
    (dict(ip_adapter_image=image(0), ip_adapter_image_embeds=[torch.zeros(2, 1, 16)]), "Provide either"),
])
def test_bad_ip_adapter_input_raises_in_caller(overrides, message):
    with StepBatched(ip_pipe("sd")) as sb, pytest.raises(ValueError, match=message):
        sb.submit(**seeded(kwargs_for(**overrides)))


def test_image_prompt_without_an_ip_adapter_is_an_error():
    from .references import family_pipe

    with StepBatched(family_pipe("sd-euler")) as sb, pytest.raises(ValueError, match="load_ip_adapter"):
        sb.submit(**seeded(kwargs_for(ip_adapter_image=image(0))))
