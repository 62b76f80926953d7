"""FLUX.2 klein KV requests of different sizes and reference images share packed forwards.

A klein KV request's first call fills a reference-image KV cache (`kv_cache_mode="extract"`), its later calls read
it (`"cached"`); `models/flux2/kv_packing.py` runs such calls of other sizes, reference counts and modes, and plain
calls, as one packed forward. Each request still equals its plain solo run, with per-request LoRA and TeaCache too.
"""

import contextlib
import logging

import pytest
import torch
from diffusers import Flux2KleinKVPipeline

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.models.flux2 import packing
from diffusers_stepbatch.models.flux2.kv_cache import KV_CACHE
from diffusers_stepbatch.testing import add_random_lora_adapters
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

from .flux2_cases import COMMON, CONFIGS, reference_image
from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE,
    assert_teacache_shared_equals_alone,
    engine_held,
    max_diff,
    seeded,
    single_thread,
)
from .test_lora_requests import ACTIVE, plain_run
from .test_row_states import captured_calls

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCKER = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, **COMMON)


def _request(prompt, size, references, steps, seed, **extra):
    kwargs = dict(prompt=prompt, height=size[0], width=size[1], num_inference_steps=steps, seed=seed, **COMMON, **extra)
    if references:
        kwargs["image"] = [reference_image(height, width, seed + i) for i, (height, width) in enumerate(references)]
    return kwargs


def _calls(pipe, kwargs) -> list[dict]:
    """The transformer calls of a plain run of the request (`captured_calls` seeds it itself)."""
    return captured_calls(pipe, **{k: v for k, v in kwargs.items() if k not in ("output_type", "seed")})


@contextlib.contextmanager
def packed_forwards(monkeypatch, caplog):
    """Per packed forward, its parts as (KV mode, reference tokens per row, image tokens per row, rows, whether
    any row holds a TeaCache state); none of them may fail (the engine would run each shape on its own)."""
    forwards, real = [], packing.flux2_packed_forward

    def record(transformer, parts, *args, **kwargs):
        forwards.append([(getattr(p.kv, "mode", None), getattr(p.kv, "num_ref", 0), p.hidden_states.shape[1],
                          p.hidden_states.shape[0], any(s is not None for s in p.teacache or ())) for p in parts])
        return real(transformer, parts, *args, **kwargs)

    monkeypatch.setattr(packing, "flux2_packed_forward", record)
    with caplog.at_level(logging.WARNING, logger="diffusers_stepbatch.engine"):
        yield forwards
    assert not [r.message for r in caplog.records if "packed" in r.message and "failed" in r.message]


def _sizes(forward, mode) -> set:
    """The (image tokens, reference tokens) per row of a packed forward's parts in `mode`."""
    return {(tokens, refs) for part_mode, refs, tokens, _, _ in forward if part_mode == mode}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("method", ["auto", "flex"])  # NOTE: KV parts attend per part whichever is asked for
def test_packed_kv_calls_return_what_the_model_returns(config, method):
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS[config])
    model = pipe.transformer
    runs = [_calls(pipe, _request(prompt, size, refs, 2, seed))
            for prompt, size, refs, seed in (("a cat", (32, 48), [(64, 64)], 0),
                                             ("a dog on a hill", (48, 32), [(64, 96), (80, 64)], 1),
                                             ("a cow", (32, 48), [(64, 64)], 2),
                                             ("no reference", (32, 32), [], 3))]
    runs[1][0] = dict(runs[1][0], return_dict=True)  # an output record, the others tuples
    with torch.no_grad():
        first = [model(**calls[0]) for calls in runs]
        packed = packing.pack_calls(model, [calls[0] for calls in runs], method, [None] * len(runs))
        for own, got in zip(first, packed):
            assert type(got) is type(own) and len(got) == len(own)
            assert max_diff(got[0], own[0]) <= 1e-5
        for own, got in zip(first[:3], packed[:3]):  # the extract calls' caches, layer by layer
            assert got[1].num_ref_tokens == own[1].num_ref_tokens
            assert max(max_diff(mine.get()[i], theirs.get()[i]) for i in range(2) for mine, theirs in zip(
                got[1].double_block_caches + got[1].single_block_caches,
                own[1].double_block_caches + own[1].single_block_caches)) <= 1e-5
        # cached calls: one request's cache, and two requests of one size with their caches joined by row
        joined = {name: torch.cat([runs[0][1][name], runs[2][1][name]]) if name in ("hidden_states",
                  "encoder_hidden_states", "timestep") else value for name, value in runs[0][1].items()}
        joined["kv_cache"] = KV_CACHE.join([(first[0][1], 1), (first[2][1], 1)])
        cached = [dict(runs[1][1], kv_cache=first[1][1]), joined, runs[3][1]]
        packed = packing.pack_calls(model, cached, method, [None] * len(cached))
        for call, got in zip(cached, packed):
            assert max_diff(got[0], model(**call)[0]) <= 1e-5
        # the cache matters: without it the joined call's output differs
        no_cache = {k: v for k, v in joined.items() if k not in ("kv_cache", "kv_cache_mode")}
        assert max_diff(packed[1][0], model(**no_cache)[0]) > 1e-3


def test_pack_key_takes_the_kv_calls_the_pipeline_makes_and_refuses_the_others():
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline)
    calls = _calls(pipe, _request("a cat", (32, 48), [(64, 64)], 2, 0))
    with torch.no_grad():
        cache = pipe.transformer(**calls[0])[1]
    cached = dict(calls[1], kv_cache=cache)
    key, tokens = packing.pack_key(calls[0])
    # both pack with plain calls; tokens per row: the image (reference tokens included) and text tokens run
    assert packing.pack_key(calls[0])[0] == packing.pack_key(
        {k: v for k, v in calls[1].items() if k not in ("kv_cache", "kv_cache_mode")})[0]
    assert tokens == calls[0]["hidden_states"].shape[1] + calls[0]["encoder_hidden_states"].shape[1]
    assert packing.pack_key(cached) == (key, tokens - cache.num_ref_tokens)
    for refused in (dict(calls[0], kv_cache=cache), dict(calls[1], kv_cache=None),
                    dict(calls[1], kv_cache_mode="other", kv_cache=cache),
                    dict(calls[0], num_ref_tokens=calls[0]["hidden_states"].shape[1] + 1)):
        assert packing.pack_key(refused) is None


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_kv_requests_of_different_sizes_and_references_pack_and_equal_their_solo_runs(config, monkeypatch, caplog):
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS[config])
    requests = [_request("a cat", (32, 32), [(64, 64)], 3, 0), _request("a dog", (32, 48), [(64, 96), (64, 64)], 2, 1),
                _request("a cow on grass", (48, 32), [(80, 64)], 4, 2), _request("no reference", (32, 32), [], 2, 3),
                _request("a bird", (48, 48), [(64, 64)], 3, 4), _request("a fish", (32, 48), [], 3, 5),
                _request("a cat", (32, 32), [(64, 64)], 2, 6)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with packed_forwards(monkeypatch, caplog) as forwards, StepBatched(pipe, max_batch_size=16) as sb:
        with engine_held(sb, BLOCKER):  # all start in lockstep
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
        stats = sb.stats()
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    # first steps: cache-filling calls of other sizes and reference counts, beside plain or cache-reading calls, in
    # one forward; later steps: cache-reading calls of other sizes, the two 32x32 requests' rows reading their
    # joined caches
    assert max(len(_sizes(forward, "extract")) for forward in forwards) >= 3, forwards
    assert any(_sizes(forward, "extract") and (_sizes(forward, None) or _sizes(forward, "cached"))
               for forward in forwards), forwards
    assert max(len(_sizes(forward, "cached")) for forward in forwards) >= 3, forwards
    assert any(mode == "cached" and rows == 2 for forward in forwards for mode, _, _, rows, _ in forward), forwards


def test_requests_with_their_own_adapters_share_packed_kv_forwards_and_equal_plain_runs(monkeypatch, caplog):
    from diffusers_stepbatch.adapters import state as adapter_state

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, seed=5)
    add_random_lora_adapters(pipe.transformer)
    pipe.set_adapters(*ACTIVE)
    requests = [_request("a cat", (32, 32), [(64, 64)], 2, 0, adapters={"a": 1.0}),
                _request("a cat", (32, 32), [(64, 64)], 2, 0, adapters={}),
                _request("a dog", (32, 48), [(64, 96), (64, 64)], 2, 1, adapters={"b": 1.0}),
                _request("a cow", (48, 32), [(80, 64)], 3, 2, adapters={"a": 0.7, "c": 0.3}),
                _request("no reference", (48, 32), [], 2, 3)]  # the pipeline's own adapters
    expected = [plain_run(pipe, kwargs) for kwargs in requests]

    recorded, real = [], adapter_state.per_row_lora

    def record(model, row_weights, token_rows=None):
        if token_rows is not None:  # a packed forward's rows
            recorded.append({tuple(sorted(w.items())) for w in row_weights})
        return real(model, row_weights, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    with packed_forwards(monkeypatch, caplog) as forwards, StepBatched(pipe, max_batch_size=16) as sb:
        with engine_held(sb, dict(BLOCKER, adapters={})):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert max_diff(expected[0], expected[1]) > 1e-3  # the adapters matter
    # packed forwards filled and read the caches of requests of other sizes, each row with its own adapters
    assert max(len(_sizes(forward, "extract")) for forward in forwards) >= 2, forwards
    assert max(len(_sizes(forward, "cached")) for forward in forwards) >= 2, forwards
    assert max(map(len, recorded)) >= 3, recorded


def test_klein_kv_teacache_in_packed_forwards_equals_teacache_alone(monkeypatch, caplog):
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS["narrow"])
    requests = [_request("a cat", (32, 32), [(64, 64)], 10, 0), _request("a bird", (32, 32), [(64, 64)], 13, 4),
                _request("a dog", (32, 48), [(64, 96), (64, 64)], 12, 1), _request("no reference", (48, 32), [], 11, 2),
                _request("a cow", (32, 32), [(64, 64)], 10, 3, teacache=None)]  # computes every step, beside them
    with packed_forwards(monkeypatch, caplog) as forwards:
        assert_teacache_shared_equals_alone(pipe, requests, TeaCacheConfig(threshold=0.6), BLOCKER)
    # cache-reading calls of other sizes, their rows with TeaCache states, in one forward
    assert any(len({(tokens, refs) for mode, refs, tokens, _, states in forward if mode == "cached" and states}) >= 2
               for forward in forwards), forwards
