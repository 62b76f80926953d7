"""FLUX.2 TeaCache per request: the same skips in shared (merged or packed) forwards as alone
(`models/flux2/teacache.py`).

FLUX.2 dev and klein requests of different sizes, aspect ratios, reference images and step counts pack into one
transformer call; each request's TeaCache state decides for its own rows from its own tokens, so its result equals
its solo run with the same TeaCache config, and a request with `teacache=None` equals the plain pipeline.
"""


import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache import TeaCacheState
from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.cache.teacache_fit import fit_coefficients
from diffusers_stepbatch.models.flux2.teacache import FLUX2_COEFFICIENTS, signal_hook, teacache_call
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

from .flux2_cases import BUILDERS, COMMON, CONFIGS, flux2_call, flux2_pipe, flux2_transformer, reference_image
from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, BlockTokenPasses, assert_polynomial_beats_a_constant, assert_teacache_shared_equals_alone, engine_held,
    held_out_changes, max_diff, seeded, single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_teacache_forward_leaves_the_klein_kv_calls_to_theflux2_transformer():
    model = flux2_transformer("narrow", False)
    arguments = dict(flux2_call(model, rows=1), kv_cache_mode="extract", num_ref_tokens=4)
    assert teacache_call(model, [TeaCacheState(0.4, FLUX2_COEFFICIENTS, 10)], arguments) is None
    assert support_for(model).teacache_forward is teacache_call
    assert support_for(model).teacache_coefficients == FLUX2_COEFFICIENTS


def test_signal_hook_records_the_signal_the_teacache_forward_decides_on():
    model = flux2_transformer("wide", True)
    arguments = flux2_call(model, rows=2)
    state = TeaCacheState(0.4, FLUX2_COEFFICIENTS, num_steps=10)
    recorded = []
    hook = signal_hook(model, recorded.append)
    try:
        with torch.no_grad():
            model(**arguments)
    finally:
        hook.remove()
    with torch.no_grad():
        teacache_call(model, [state, state], arguments)
    assert max_diff(recorded[0], state.previous_signal) <= 1e-6


def test_fitted_coefficients_explain_the_output_change():
    pipe = flux2_pipe("klein", "narrow")
    call = dict(height=32, width=32, num_inference_steps=12, guidance_scale=1.0, output_type="latent",
                text_encoder_out_layers=(1,), max_sequence_length=32)
    coefficients = fit_coefficients(pipe, ["a red circle", "a blue square"], degree=2, signal=signal_hook, **call)
    assert_polynomial_beats_a_constant(coefficients, *held_out_changes(pipe, "a yellow cross", signal_hook, **call))


def block_passes(transformer) -> BlockTokenPasses:
    # NOTE: the first double block's image query: the plain and the packed forward both call it
    return BlockTokenPasses(transformer.x_embedder, transformer.transformer_blocks[0].attn.to_q)


def _requests():
    """Text-to-image and edit requests at 4 sizes (non-square too) and 4 step counts; the second runs without
    TeaCache. Klein runs CFG (guidance_scale > 1) as two calls a step, one state each; dev embeds guidance."""
    references = [None, [reference_image(64, 64, 0)], None, [reference_image(64, 96, 1), reference_image(80, 64, 2)],
                  None]
    shapes = [(32, 32, 12), (32, 48, 13), (48, 32, 12), (48, 48, 14), (32, 48, 11)]
    requests = []
    for i, ((height, width, steps), images) in enumerate(zip(shapes, references)):
        kwargs = dict(prompt=f"a shape {i}" if i % 2 else "a red circle", height=height, width=width,
                      num_inference_steps=steps, guidance_scale=[4.0, 1.0, 3.0][i % 3], seed=i, **COMMON)
        if images is not None:
            kwargs["image"] = images
        requests.append(kwargs)
    requests[1]["teacache"] = None  # computes every step, beside the others
    return requests


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("variant", sorted(BUILDERS))
def test_teacache_in_shared_packed_forwards_equals_teacache_alone(variant, config):
    pipe = flux2_pipe(variant, config)
    requests = _requests()
    exact = [pipe(**seeded({k: v for k, v in kwargs.items() if k != "teacache"})).images for kwargs in requests]
    teacache = TeaCacheConfig(threshold=0.5)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
    passes = block_passes(pipe.transformer)
    try:
        with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
            blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, teacache=None, **COMMON)
            with engine_held(sb, blocker):  # all start in lockstep
                futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
            batched = [future.result(300).images for future in futures]
            stats = sb.stats()
    finally:
        passes.remove()
    differences = [max_diff(got, want) for got, want in zip(batched, solo)]
    assert max(differences) <= TOLERANCE, differences
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    assert max_diff(solo[1], exact[1]) <= TOLERANCE  # teacache=None: every step computed
    assert min(max_diff(solo[i], exact[i]) for i in (0, 2, 3, 4)) > 10 * TOLERANCE, "TeaCache skipped no step"
    assert passes.skipped > 0 and passes.packed_with_skips > 0, passes.forwards


@pytest.mark.parametrize("variant", sorted(BUILDERS))
def test_threshold_zero_never_skips(variant):
    pipe = flux2_pipe(variant, "narrow")
    kwargs = _requests()[3]  # an edit request; klein with CFG
    exact = pipe(**seeded(kwargs)).images
    # NOTE: a polynomial that is negative everywhere: any positive threshold would skip every inner step
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.0, coefficients=(-1.0,))) as sb:
        assert max_diff(sb(**seeded(kwargs)).images, exact) <= TOLERANCE


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_klein_kv_cache_reading_calls_with_every_row_computing_are_the_model_forward(config):
    from diffusers import Flux2KleinKVPipeline

    from .test_row_states import captured_calls

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS[config])  # NOTE: its own
    model = pipe.transformer  # transformer: the KV pipeline sets KV attention processors on it
    calls = captured_calls(pipe, prompt="a cat", image=reference_image(64, 64, 0), height=32, width=48,
                           num_inference_steps=3, **{k: v for k, v in COMMON.items() if k != "output_type"})
    with torch.no_grad():
        assert teacache_call(model, [None], calls[0]) is None  # filling the cache: the model's own forward
        cache = model(**calls[0])[1]
        for call in calls[1:]:
            call = dict(call, kv_cache=cache)
            assert max_diff(teacache_call(model, [None], call)[0], model(**call)[0]) == 0.0


def test_klein_kv_teacache_in_shared_forwards_equals_teacache_alone():
    from diffusers import Flux2KleinKVPipeline

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS["narrow"])
    reference = reference_image(64, 64, 0)
    requests = [dict(prompt=prompt, image=reference, height=32, width=32, num_inference_steps=steps, seed=seed,
                     **COMMON) for prompt, steps, seed in (("a cat", 10, 0), ("a dog", 12, 1), ("a cow", 11, 2))]
    requests.append(dict(requests[0], seed=3, teacache=None))  # computes every step, beside the others
    blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, **COMMON)
    stats = assert_teacache_shared_equals_alone(pipe, requests, TeaCacheConfig(threshold=0.6), blocker)
    rows = stats["rows_histogram"]["denoise"]
    assert max(rows) >= 3, rows  # cache-reading calls of several requests in one forward


def test_requests_with_their_own_adapters_and_teacache_share_forwards_and_equal_their_solo_runs():
    """Per-row LoRA maps layer inputs to rows by count: where some rows of a merged call skip and others compute,
    the computing rows run the blocks with their own adapters (`row_subset`), so the call never falls apart."""
    from diffusers_stepbatch.testing import add_random_lora_adapters

    pipe = tiny_flux2_klein_pipeline(seed=5)
    add_random_lora_adapters(pipe.transformer)
    pipe.set_adapters(["c"], [0.6])
    steps_and_adapters = [(10, {"a": 1.0}), (13, {"b": 1.0}), (11, {}), (12, {"a": 0.5, "c": 0.5})]
    requests = [dict(prompt="a red circle", height=32, width=32, num_inference_steps=steps, guidance_scale=1.0,
                     seed=i, adapters=adapters, **COMMON) for i, (steps, adapters) in enumerate(steps_and_adapters)]
    teacache = TeaCacheConfig(threshold=0.5)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
    passes = block_passes(pipe.transformer)
    try:
        with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
            blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, adapters={}, teacache=None,
                           **COMMON)
            with engine_held(sb, blocker):  # all start in lockstep
                futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
            batched = [future.result(300).images for future in futures]
            stats = sb.stats()
    finally:
        passes.remove()
    differences = [max_diff(got, want) for got, want in zip(batched, solo)]
    assert max(differences) <= TOLERANCE, differences
    assert not [reason for reason in stats["splits"] if "raised" in reason], stats["splits"]
    # the four requests shared forwards to near the end of the shortest (10 steps), and skipped steps in them
    assert stats["rows_histogram"]["denoise"].get(4, 0) >= 8, stats["rows_histogram"]
    assert passes.skipped > 0
