"""stats()["splits"]: why calls of one program ran apart, field by field of their compatibility keys."""

import functools

import numpy as np
import PIL.Image
import pytest

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.decoders.vae import CPU_DECODES_APART
from diffusers_stepbatch.engine.split_reasons import SAME_KEY, NamedKey, named_key, split_reasons
from diffusers_stepbatch.testing import add_random_ip_adapter, tiny_flux_pipeline, tiny_sd_pipeline

from .references import TOLERANCE, engine_held, max_diff, seeded

IP_SHAPES = "ip_adapter: image embedding shapes (images per adapter)"


def test_named_keys_compare_as_tuples_and_keep_names_when_extended():
    key = named_key(program="unet", size=(4, 8))
    assert key == ("unet", (4, 8)) and hash(key) == hash(("unet", (4, 8)))
    longer = key + named_key(ip=1) + (7,)
    assert isinstance(longer, NamedKey) and longer.names == ("program", "size", "ip", "key field 3")
    with pytest.raises(ValueError, match="one name per field"):
        NamedKey((1, 2), ["a"])


def test_reasons_name_the_fields_that_differ_and_ignore_what_varies_inside_a_packed_call():
    a = named_key(program="flux", size=(2, 2), text=8)
    b = named_key(program="flux", size=(4, 4), text=8)
    c = named_key(program="flux", size=(2, 2), text=16)
    other = named_key(program="sd3", size=(2, 2), text=8)
    assert split_reasons([[("denoise", a)], [("denoise", b)], [("denoise", c)]]) == {"denoise: size": 1, "denoise: text": 1}
    # a packed call of sizes a and b, and c apart: only the text length kept c out
    assert split_reasons([[("denoise", a), ("denoise", b)], [("denoise", c)]]) == {"denoise: text": 1}
    # other programs and other kinds are never compared; equal keys in two calls were chunked
    assert split_reasons([[("denoise", a)], [("denoise", other)], [("encode", b)]]) == {}
    assert split_reasons([[("denoise", a)], [("denoise", a)]]) == {f"denoise: {SAME_KEY}": 1}
    assert split_reasons([[("denoise", a)], [("denoise", a + named_key(ip=1))]]) == {"denoise: ip": 1}


def image(seed):
    return PIL.Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype("uint8"))


@functools.cache
def sd_ip_pipe():
    pipe = tiny_sd_pipeline()
    add_random_ip_adapter(pipe)
    return pipe


def run_together(pipe, cases, **options):
    with StepBatched(pipe, max_batch_size=16, **options) as sb:
        with engine_held(sb, dict(cases[0], num_inference_steps=1)):  # the requests start in lockstep
            futures = [sb.submit(**seeded(kwargs)) for kwargs in cases]
        results = [future.result(300).images for future in futures]
        return results, sb.stats()["splits"]


@pytest.mark.parametrize("steps", [2, 3])
def test_image_prompts_of_different_image_counts_split_and_say_why(steps):
    pipe = sd_ip_pipe()
    base = {"prompt": "a red circle", "height": 32, "width": 32, "num_inference_steps": steps, "output_type": "pt"}
    cases = [dict(base, seed=0, ip_adapter_image=image(0)),
             dict(base, seed=1, ip_adapter_image=[[image(1), image(2)]])]  # two images for the one adapter
    results, splits = run_together(pipe, cases)
    # one split per denoising step, nothing else kept them apart but the rule that CPU decodes run per request
    assert splits == {f"denoise: {IP_SHAPES}": steps, f"decode: {CPU_DECODES_APART}": 1}
    for kwargs, got in zip(cases, results):
        assert max_diff(got, pipe(**seeded(kwargs)).images) <= TOLERANCE


def test_requests_that_share_every_forward_report_no_splits():
    pipe = sd_ip_pipe()
    base = {"prompt": "a red circle", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "pt"}
    cases = [dict(base, seed=0, ip_adapter_image=image(0)), dict(base, seed=1, ip_adapter_image=image(1)),
             dict(base, seed=2, prompt="a blue square", guidance_scale=3.0)]
    _, splits = run_together(pipe, cases)
    # the only calls apart: CPU decodes, by rule (the text-only request, with no image to encode, decodes a step
    # before the two others, whose decodes share a round)
    assert splits == {f"decode: {CPU_DECODES_APART}": 1}


def test_sizes_that_cannot_pack_split_by_image_size():
    pipe = tiny_flux_pipeline(guidance_embeds=True)
    add_random_ip_adapter(pipe)  # NOTE: Flux with an IP-Adapter does not pack mixed resolutions
    base = {"prompt": "a red circle", "num_inference_steps": 2, "output_type": "pt", "max_sequence_length": 16}
    cases = [dict(base, seed=0, height=32, width=32, ip_adapter_image=image(0)),
             dict(base, seed=1, height=32, width=48, ip_adapter_image=image(1))]
    results, splits = run_together(pipe, cases)
    assert splits == {"denoise: image size": 2, f"decode: latent size; {CPU_DECODES_APART}": 1}
    for kwargs, got in zip(cases, results):
        assert max_diff(got, pipe(**seeded(kwargs)).images) <= TOLERANCE


def test_requests_on_a_hooked_denoiser_run_alone_and_say_why():
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_flux_pipeline(guidance_embeds=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.8))
    base = {"prompt": "a red circle", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "pt",
            "max_sequence_length": 16}
    cases = [dict(base, seed=0), dict(base, seed=1, prompt="a blue square")]
    expected = [pipe(**seeded(kwargs)).images for kwargs in cases]
    results, splits = run_together(pipe, cases)
    hooks = "denoise: diffusers cache hooks: a hooked request's forwards run alone"
    # NOTE: FirstBlockCache keeps one state per model, so the requests take turns; they meet at least once
    assert set(splits) == {hooks} and splits[hooks] >= 1
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE


def test_split_reasons_are_exported_to_prometheus():
    import prometheus_client

    pipe = sd_ip_pipe()
    base = {"prompt": "a red circle", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "pt"}
    registry = prometheus_client.CollectorRegistry()
    with StepBatched(pipe, max_batch_size=16) as sb:
        sb.register_prometheus(registry)
        with engine_held(sb, dict(base, num_inference_steps=1)):
            futures = [sb.submit(**seeded(dict(base, seed=0, ip_adapter_image=image(0)))),
                       sb.submit(**seeded(dict(base, seed=1, ip_adapter_image=[[image(1), image(2)]])))]
        [future.result(300) for future in futures]
        exposition = prometheus_client.generate_latest(registry).decode()
    assert f'split_calls_total{{reason="denoise: {IP_SHAPES}"}} 2.0' in exposition
