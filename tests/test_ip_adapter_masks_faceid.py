"""IP-Adapter masks (`cross_attention_kwargs={"ip_adapter_masks": ...}`) and FaceID (embeddings only, no image
encoder) through StepBatched, for SD and SDXL: per request, against the plain pipeline run alone."""

import functools

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.callbacks import IPAdapterScaleCutoffCallback
from diffusers.image_processor import IPAdapterMaskProcessor

from diffusers_stepbatch.decoders.vae import CPU_DECODES_APART
from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.scheduler import SchedulerConfig
from diffusers_stepbatch.testing import add_random_ip_adapter, tiny_sd_pipeline, tiny_sdxl_pipeline

from .references import TOLERANCE, count_forwards, engine_held, ip_adapter_scale, max_diff, seeded

BUILDERS = {"sd": tiny_sd_pipeline, "sdxl": tiny_sdxl_pipeline}
MASKS = "denoise: ip_adapter: masks (shapes, or none)"


@functools.cache
def ip_pipe(family, faceid=False):
    pipe = BUILDERS[family]()
    add_random_ip_adapter(pipe, faceid=faceid)
    return pipe


def image(seed):
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype("uint8"))


def mask(columns, size=32):
    """An IPAdapterMaskProcessor mask [1, images, size, size], one image per column range (white inside)."""
    pictures = []
    for start, stop in columns:
        pixels = np.zeros((size, size), dtype=np.uint8)
        pixels[:, start:stop] = 255
        pictures.append(PIL.Image.fromarray(pixels))
    masks = IPAdapterMaskProcessor().preprocess(pictures, height=size, width=size)
    return masks.reshape(1, masks.shape[0], size, size)


def kwargs_for(prompt="a red circle", seed=0, **extra):
    return {"prompt": prompt, "height": 32, "width": 32, "num_inference_steps": 3, "seed": seed,
            "output_type": "pt", **extra}


def plain_run(pipe, kwargs, scale):
    with ip_adapter_scale(pipe, scale, restore=1.0):
        return pipe(**seeded(kwargs)).images


def run_in_lockstep(pipe, cases):
    sizes, hook = count_forwards(pipe.unet)
    try:
        # NOTE: cost_aware=False: one forward per group, so stats()["splits"] shows the keys' reasons only
        with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=32, cost_aware=False)) as sb:
            futures = []
            with engine_held(sb, dict(cases[0][0], num_inference_steps=1)):  # every request starts in lockstep
                for kwargs, scale in cases:
                    pipe.set_ip_adapter_scale(scale)
                    futures.append(sb.submit(**seeded(kwargs)))
                pipe.set_ip_adapter_scale(1.0)
            results = [future.result(300).images for future in futures]
            splits = sb.stats()["splits"]
    finally:
        hook.remove()
        pipe.set_ip_adapter_scale(1.0)
    return results, sizes, splits


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_requests_with_their_own_masks_share_forwards_and_equal_plain_runs(family):
    pipe = ip_pipe(family)
    cases = [
        (kwargs_for(ip_adapter_image=image(0), cross_attention_kwargs={"ip_adapter_masks": [mask([(0, 16)])]}), 1.0),
        (kwargs_for("a blue square", 1, ip_adapter_image=image(1),
                    cross_attention_kwargs={"ip_adapter_masks": [mask([(16, 32)])]}), 0.6),
        (kwargs_for(seed=4, ip_adapter_image=image(4), cross_attention_kwargs={"ip_adapter_masks": [mask([(8, 24)])]},
                    callback_on_step_end=IPAdapterScaleCutoffCallback(cutoff_step_ratio=0.5)), 1.0),
        # two images for the one adapter, a mask each, a scale each
        (kwargs_for(seed=2, ip_adapter_image=[[image(2), image(3)]],
                    cross_attention_kwargs={"ip_adapter_masks": [mask([(0, 16), (16, 32)])]}), [[0.5, 0.9]]),
        (kwargs_for("a green cross", 3, ip_adapter_image=image(5)), 0.8),  # no mask
    ]
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    results, sizes, splits = run_in_lockstep(pipe, cases)
    for (kwargs, scale), got, want in zip(cases, results, expected):
        assert max_diff(got, want) <= TOLERANCE, (sorted(kwargs), scale)
    assert max(sizes) == 3 * 2  # the three one-image masked requests (CFG: 2 rows each) shared forwards
    steps = 3
    shapes = "ip_adapter: image embedding shapes (images per adapter)"
    assert splits == {MASKS: steps, f"denoise: {shapes}; {MASKS.split(': ', 1)[1]}": steps,
                      f"decode: {CPU_DECODES_APART}": len(cases) - 1}
    unmasked = plain_run(pipe, dict(cases[0][0], cross_attention_kwargs=None), 1.0)
    assert max_diff(expected[0], unmasked) > 1e-3  # the mask matters


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_faceid_embeddings_without_an_image_encoder_equal_plain_runs(family):
    pipe = ip_pipe(family, faceid=True)
    assert getattr(pipe, "image_encoder", None) is None

    def face(seed):  # [negative, positive] face embeddings under CFG, one image
        return [torch.randn(2, 1, 1, 16, generator=torch.Generator().manual_seed(seed))]

    cases = [(kwargs_for(ip_adapter_image_embeds=face(0)), 1.0),
             (kwargs_for("a blue square", 1, ip_adapter_image_embeds=face(1)), 0.5),
             (kwargs_for(seed=2, ip_adapter_image_embeds=face(2),
                         callback_on_step_end=IPAdapterScaleCutoffCallback(cutoff_step_ratio=0.5)), 1.0)]
    expected = [plain_run(pipe, kwargs, scale) for kwargs, scale in cases]
    results, sizes, splits = run_in_lockstep(pipe, cases)
    for (kwargs, scale), got, want in zip(cases, results, expected):
        assert max_diff(got, want) <= TOLERANCE, (sorted(kwargs), scale)
    assert max(sizes) == 3 * 2 and splits == {f"decode: {CPU_DECODES_APART}": len(cases) - 1}
    assert max_diff(expected[0], plain_run(pipe, cases[0][0], 0.0)) > 1e-3  # the face embeddings matter
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError, match="needs an image prompt"):
            sb.submit(**seeded(kwargs_for()))  # FaceID has no image-free mode (diffusers raises too)
        with pytest.raises(ValueError, match="needs pipe.image_encoder"):
            sb.submit(**seeded(kwargs_for(ip_adapter_image=image(0))))


@pytest.mark.parametrize("overrides, message", [
    (dict(ip_adapter_image=image(0), cross_attention_kwargs={"ip_adapter_masks": [mask([(0, 16)])] * 2}),
     "ip_adapter_masks has 2 entries for 1 IP-Adapters"),
    (dict(ip_adapter_image=image(0), cross_attention_kwargs={"ip_adapter_masks": [torch.ones(1, 32, 32)]}),
     r"ip_adapter_masks\[0\] must be a tensor \[batch, images, height, width\]"),
    (dict(ip_adapter_image=image(0), cross_attention_kwargs={"ip_adapter_masks": [torch.ones(3, 1, 32, 32)]}),
     r"ip_adapter_masks\[0\] has batch 3; pass 1"),
    (dict(cross_attention_kwargs={"ip_adapter_masks": [mask([(0, 16)])]}), "needs an image prompt"),
])
def test_bad_masks_raise_in_caller(overrides, message):
    with StepBatched(ip_pipe("sd")) as sb, pytest.raises(ValueError, match=message):
        sb.submit(**seeded(kwargs_for(**overrides)))
