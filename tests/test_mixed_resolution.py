"""Mixed resolutions: rows of different sizes share one packed transformer call, and each equals its solo run."""

import logging

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.testing import tiny_flux_pipeline

from .references import TOLERANCE, family_pipe, flux_pipe, in_lockstep, max_diff, seeded

PACK_ALWAYS = SchedulerConfig(max_batch_size=16, cost_aware=False)


class PackedCalls:
    """Token counts of the transformer calls whose image tokens came packed (2-D input to proj_out)."""

    def __init__(self, transformer):
        self.tokens: list[int] = []
        self.handle = transformer.proj_out.register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        if args[0].ndim == 2:
            self.tokens.append(args[0].shape[0])

    def remove(self):
        self.handle.remove()


def flux_requests(name):
    """Seven requests over five sizes (non-square, 16x token ratio), prompts, seeds, steps, guidance, true CFG."""
    sizes = [(16, 16), (64, 64), (32, 48), (16, 64), (64, 64), (16, 16), (48, 32)]
    prompts = ["a red circle", "a blue square at the top left", "a cat", "x", "a green triangle", "a dog", "a cow"]
    requests = []
    for i, ((height, width), prompt) in enumerate(zip(sizes, prompts)):
        kwargs = dict(prompt=prompt, height=height, width=width, num_inference_steps=2 + i % 3, seed=i,
                      guidance_scale=1.5 + i, output_type="pt", max_sequence_length=16 if i % 2 else 24)
        if i % 3 == 1:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=2.0 + i / 4)
        requests.append(kwargs)
    return requests


def assert_packed_equals_solo(pipe, requests, tolerance=TOLERANCE, **options):
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    calls = PackedCalls(pipe.transformer)
    try:
        sb = StepBatched(pipe, scheduler=PACK_ALWAYS, **options)
        got = in_lockstep(sb, requests)
        mixed = sb.stats()["mixed"]
        sb.close()
    finally:
        calls.remove()
    for kwargs, image, want in zip(requests, got, expected):
        assert image.shape == want.shape
        assert max_diff(image, want) <= tolerance, kwargs
    assert calls.tokens, "no transformer call packed rows of different sizes"
    # one packed call is one transformer forward, or one per skip-layer set among its rows (SD3)
    assert 0 < mixed["calls"] <= len(calls.tokens) and mixed["sizes_per_call"] >= 2
    return calls


def test_flux_requests_of_different_sizes_share_calls_and_equal_solo(flux_name):
    pipe = flux_pipe(flux_name)
    requests = flux_requests(flux_name)
    calls = assert_packed_equals_solo(pipe, requests)
    largest = max(2 * (h // 16) * (w // 16) * 4 for h, w in ((64, 64),))  # two 64x64 requests' image tokens
    assert max(calls.tokens) > largest, "the largest packed call did not hold more than the largest size's rows"


def test_flux_packed_calls_with_flex_attention_equal_solo():
    pipe = flux_pipe("dev-tiny")
    assert_packed_equals_solo(pipe, flux_requests("dev-tiny")[:5], packed_attention="flex")
    with pytest.raises(ValueError, match="packed_attention='sdpa' is not one of"):
        StepBatched(pipe, packed_attention="sdpa")
    sb = StepBatched(pipe, scheduler=PACK_ALWAYS, packed_attention="varlen")
    try:
        with pytest.raises(ValueError, match="needs CUDA"):  # the model is on the CPU: refused at submit
            sb.submit(**seeded(flux_requests("dev-tiny")[0]))
    finally:
        sb.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="packed attention on the GPU needs CUDA")
@pytest.mark.parametrize("packed_attention, dtype, tolerance", [
    ("recover_scatter", torch.float32, TOLERANCE),
    ("flex", torch.float32, TOLERANCE),
    # NOTE: flash varlen runs in half precision only; bfloat16 keeps 8 mantissa bits (~4e-3 per rounding), and
    # solo and packed rows round differently through two to four steps and the VAE (the same requests in bfloat16
    # on the CPU, packed with recover-scatter: up to 1.2e-2 from their solo runs)
    ("varlen", torch.bfloat16, 5e-2),
])
def test_flux_packed_calls_on_cuda_equal_solo(packed_attention, dtype, tolerance, monkeypatch):
    # NOTE: cuDNN convolutions default to TF32 (10 mantissa bits), which would differ between batch sizes
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    pipe = tiny_flux_pipeline(guidance_embeds=True, vae_blocks=2).to("cuda", dtype)  # not the shared CPU pipeline
    assert_packed_equals_solo(pipe, flux_requests("dev-tiny")[:5], tolerance=tolerance,
                              packed_attention=packed_attention)


def sd3_requests(name, skip_layer_guidance):
    sizes = [(16, 16), (64, 64), (32, 48), (16, 64), (48, 32), (16, 16)]
    requests = []
    for i, (height, width) in enumerate(sizes):
        kwargs = dict(prompt=["a red circle", "a cat", "x y", "a blue square", "a dog", "z"][i], height=height,
                      width=width, num_inference_steps=2 + i % 3, seed=i, guidance_scale=[1.0, 3.0, 5.0][i % 3],
                      output_type="pt", max_sequence_length=8 if i % 2 else 16)
        if skip_layer_guidance and i % 2 == 0:
            kwargs.update(skip_guidance_layers=[1], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0,
                          guidance_scale=3.0)
        requests.append(kwargs)
    return requests


@pytest.mark.parametrize("name", ["sd3-tiny", "sd3-patch2"])
@pytest.mark.parametrize("skip_layer_guidance", [False, True])
def test_sd3_requests_of_different_sizes_share_calls_and_equal_solo(name, skip_layer_guidance):
    assert_packed_equals_solo(family_pipe(name), sd3_requests(name, skip_layer_guidance))


def test_teacache_in_packed_calls_equals_teacache_alone():
    pipe = flux_pipe("dev-tiny")
    teacache = TeaCacheConfig(threshold=0.6)
    requests = [
        dict(prompt="a red circle", height=32, width=32, num_inference_steps=12, seed=1),
        dict(prompt="a blue square", height=16, width=64, num_inference_steps=10, seed=2, negative_prompt="noise",
             true_cfg_scale=2.0),
        dict(prompt="a cat", height=64, width=64, num_inference_steps=12, seed=3, teacache=None),
        dict(prompt="a dog", height=48, width=32, num_inference_steps=14, seed=4),
    ]
    for kwargs in requests:
        kwargs.update(output_type="pt", max_sequence_length=16)
    with StepBatched(pipe, teacache=teacache) as sb:
        alone = [sb(**seeded(kwargs)).images for kwargs in requests]
    # per packed call: image tokens that entered the blocks (block 0's MLP) and image tokens out (proj_out)
    entered = []
    handle = pipe.transformer.transformer_blocks[0].ff.register_forward_pre_hook(
        lambda m, a: entered.append(a[0].shape[0]) if a[0].ndim == 2 else None)
    calls = PackedCalls(pipe.transformer)
    try:
        packed = in_lockstep(StepBatched(pipe, teacache=teacache, scheduler=PACK_ALWAYS), requests)
    finally:
        handle.remove()
        calls.remove()
    assert calls.tokens and entered, "no packed call ran the blocks"
    assert sum(entered) < sum(calls.tokens), "no packed call skipped any row's blocks: the test proves nothing"
    for got, want in zip(packed, alone):
        assert max_diff(got, want) <= TOLERANCE


def test_an_unknown_attention_processor_keeps_sizes_apart(caplog):
    class CustomProcessor(FluxAttnProcessor):
        pass

    pipe = flux_pipe("schnell-tiny")
    original = pipe.transformer.attn_processors
    pipe.transformer.set_attn_processor(CustomProcessor())
    requests = flux_requests("schnell-tiny")[:4]
    try:
        expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
        calls = PackedCalls(pipe.transformer)
        with caplog.at_level(logging.INFO, logger="diffusers_stepbatch.models.packing.support"):
            sb = StepBatched(pipe, scheduler=PACK_ALWAYS)
            got = in_lockstep(sb, requests)
        calls.remove()
    finally:
        pipe.transformer.set_attn_processor(original)
    assert calls.tokens == [] and sb.stats()["mixed"]["calls"] == 0
    assert sum("CustomProcessor" in record.getMessage() for record in caplog.records) == 1  # logged once
    for image, want in zip(got, expected):
        assert max_diff(image, want) <= TOLERANCE


def test_mixed_resolution_false_runs_one_call_per_size():
    pipe = flux_pipe("dev-tiny")
    requests = flux_requests("dev-tiny")[:4]
    calls = PackedCalls(pipe.transformer)
    try:
        sb = StepBatched(pipe, scheduler=PACK_ALWAYS, mixed_resolution=False)
        got = in_lockstep(sb, requests)
    finally:
        calls.remove()
    assert calls.tokens == [] and sb.stats()["mixed"]["calls"] == 0
    for kwargs, image in zip(requests, got):
        assert max_diff(image, pipe(**seeded(kwargs)).images) <= TOLERANCE
    with pytest.raises(ValueError, match="mixed_resolution"):
        StepBatched(pipe, mixed_resolution="yes")


def test_pid_early_exit_requests_of_different_sizes_pack():
    from diffusers_stepbatch import PiDDecoding

    from .test_pid_pipeline import call, tiny_pid

    pipe = flux_pipe("dev-tiny")
    decoding = PiDDecoding(tiny_pid(), text_encoder="pipeline")
    requests = [call("a red circle", seed=1, height=64, width=96, steps=5),
                call("a blue square", seed=2, height=128, width=64, steps=4, guidance_scale=5.0),
                call("a cat", seed=3, height=256, width=256, steps=6)]
    seeds = [1, 2, 3]
    fresh = lambda: [{**kwargs, "generator": torch.Generator().manual_seed(s)}  # noqa: E731
                     for kwargs, s in zip(requests, seeds)]
    with StepBatched(pipe, decoder=decoding, pid_exit_step=3) as sb:
        alone = [sb(**kwargs).images for kwargs in fresh()]
    calls = PackedCalls(pipe.transformer)
    try:
        sb = StepBatched(pipe, decoder=decoding, pid_exit_step=3, scheduler=PACK_ALWAYS)
        requests_now = fresh()
        handles = [sb._make_request((), kwargs, 0, None) for kwargs in requests_now]
        for request in handles:
            sb.engine.scheduler.add(request)
        with torch.no_grad():
            while sb.engine.scheduler.has_work():
                sb.engine.step()
        together = [request.handle.result().images for request in handles]
    finally:
        calls.remove()
    assert len(calls.tokens) == 3  # the three main-model steps before the exit, each one packed call
    for a, b in zip(alone, together):
        assert a.shape == b.shape and max_diff(a, b) <= TOLERANCE
