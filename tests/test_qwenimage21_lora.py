"""Qwen-Image 2.1 requests with their own LoRA adapters share forwards: merged by rows and packed across sizes,
with the KV cache (filling and reading calls) and without, true CFG and condition images, with TeaCache too. Each
request equals the plain pipeline after `set_adapters`, run alone: every row modulates its text and condition-image
tokens from its own t=0 row, through its own adapters (`models/qwenimage21/lora.py`)."""

import contextlib
import functools

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.adapters.lora import per_row_lora
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.models.calls import fill
from diffusers_stepbatch.models.qwenimage21.packing import lora_forward
from diffusers_stepbatch.testing import add_random_lora_adapters
from diffusers_stepbatch.testing.image_models import tiny_qwenimage21_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, add_lora_everywhere, assert_teacache_shared_equals_alone, engine_held, max_diff, seeded, single_thread,
    with_adapters,
)
from .test_lora_requests import ACTIVE, plain_run
from .test_qwenimage21 import CONFIGS, condition_image
from .test_row_states import captured_calls, merged

pytestmark = pytest.mark.usefixtures("single_thread")
COMMON = dict(output_type="pt", output_resolution=64)


@functools.lru_cache(maxsize=None)
def lora_pipe(config: str):
    """The config's pipeline with adapters a, b, c (each on its own layers) and `all` (every Linear layer: the
    timestep embedding, `modulation` and `norm_out` too); the pipeline's own adapters are `ACTIVE`."""
    pipe = tiny_qwenimage21_pipeline(**CONFIGS[config])
    add_random_lora_adapters(pipe.transformer)
    add_lora_everywhere(pipe.transformer, "all")
    pipe.set_adapters(*ACTIVE)
    return pipe


def lora_requests(**common) -> list[dict]:
    """Six requests: one adapter each, a mix, none, the pipeline's own (no adapters=), at three sizes; the first
    two run more steps than the others, so their last steps merge their rows without packing."""
    common = dict(COMMON, **common)
    return [dict(common, adapters={"a": 1.0}, prompt="a red circle", height=64, width=64, num_inference_steps=9,
                 seed=0),
            dict(common, adapters={"all": 1.0}, prompt="a red circle", height=64, width=64, num_inference_steps=9,
                 seed=0),
            dict(common, adapters={}, prompt="a red circle", height=64, width=64, num_inference_steps=3, seed=0),
            dict(common, adapters={"all": 0.7, "c": 0.3}, prompt="a blue square", height=64, width=96,
                 num_inference_steps=3, seed=1, negative_prompt="blurry", true_cfg_scale=3.0),
            dict(common, prompt="make it red", image=condition_image(64, 48, 3), num_inference_steps=3, seed=3),
            dict(common, adapters=["a", "b", "all"], prompt="a cat", height=96, width=64, num_inference_steps=2,
                 seed=4)]


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_requests_with_their_own_adapters_share_forwards_and_equal_plain_runs(config, use_kv_cache, monkeypatch):
    from diffusers_stepbatch.adapters import state as adapter_state

    pipe = lora_pipe(config)
    requests = lora_requests(use_kv_cache=use_kv_cache)
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    recorded = []  # each per-row LoRA forward's distinct adapter sets, where it ran through
    real = adapter_state.per_row_lora

    @contextlib.contextmanager
    def record(model, row_weights, token_rows=None):
        with real(model, row_weights, token_rows):
            yield
        recorded.append({tuple(sorted(weights.items())) for weights in row_weights})

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    with StepBatched(pipe, max_batch_size=16) as sb:
        with engine_held(sb, dict(COMMON, prompt="a blocker", height=32, width=32, num_inference_steps=1, seed=0)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
        stats = sb.stats()
    assert max(max_diff(got, want) for got, want in zip(results, expected)) <= TOLERANCE
    # the adapters change the images: a request with other adapters than its plain run's would fail
    assert min(max_diff(expected[0], expected[i]) for i in (1, 2)) > 1e-3
    assert max(stats["rows_histogram"]["denoise"]) >= 3 and stats["mixed"]["calls"] > 0, stats
    assert max(len(adapters) for adapters in recorded) == len(requests), recorded  # one forward held them all
    assert not any("raised" in reason for reason in stats["splits"]), stats["splits"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_teacache_with_per_request_adapters_in_shared_forwards_equals_it_alone(config):
    pipe = lora_pipe(config)
    common = dict(COMMON, height=64, width=64)
    requests = [dict(common, adapters={"a": 1.0}, prompt="a cat one", num_inference_steps=12, seed=0),
                dict(common, adapters={"all": 0.8}, prompt="a dog two", num_inference_steps=14, seed=1),
                dict(common, adapters={"all": 0.5, "b": 1.0}, prompt="a cow 333", num_inference_steps=13, seed=2,
                     negative_prompt="bad", true_cfg_scale=3.0),
                dict(common, adapters={"all": 1.0}, prompt="a pig 444", num_inference_steps=12, seed=3,
                     teacache=None),  # computes every step, beside the others: equals its plain run
                dict(common, prompt="a much longer prompt", height=96, num_inference_steps=13, seed=4,
                     use_kv_cache=False)]
    blocker = dict(COMMON, prompt="a blocker", height=32, width=32, num_inference_steps=1)
    stats = assert_teacache_shared_equals_alone(pipe, requests, TeaCacheConfig(threshold=0.6), blocker,
                                                plain=functools.partial(plain_run, pipe))
    rows, mixed = stats["rows_histogram"]["denoise"], stats["mixed"]["calls"]
    assert max(rows) >= 3 and mixed > 0, (rows, mixed)  # forwards held rows of several requests and sizes
    assert not any("raised" in reason for reason in stats["splits"]), stats["splits"]


ROWS = [{"all": 1.0}, {"a": 1.0, "all": 0.5}, {}, {"c": 0.6}]  # per row of a merged call ({}: the base model)


@pytest.mark.parametrize("case", [{}, dict(use_kv_cache=False),
                                  dict(image=condition_image(48, 64, 3), negative_prompt="bad", true_cfg_scale=3.0)])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_merged_call_gives_each_row_its_own_adapters(config, case):
    """A call of one layout, its rows merged (`lora_forward`, as the generic program runs it unpacked), filling and
    reading their KV caches: each row equals the model's forward after `set_adapters` with that row's adapters."""
    pipe = lora_pipe(config)
    model, blocks = pipe.transformer, len(pipe.transformer.transformer_blocks)
    calls = captured_calls(pipe, prompt="a cat one", height=64, width=96, num_inference_steps=2, output_resolution=64,
                           **case)
    caches = [[{}, {}] for _ in ROWS]  # per row: its caches of the run alone and merged (fresh ones)

    def own_call(call, side):
        given = call.get("kv_cache")
        return [dict(call, kv_cache=None if given is None else own[side].setdefault(id(given),
                                                                                    QwenImage21KVCache(blocks)))
                for own in caches]

    def lora_run(model, described, rows):
        with per_row_lora(model, ROWS):
            return lora_forward(model, fill(described.template, rows))

    try:
        with torch.no_grad():
            for call in calls:
                alone = [with_adapters(model, adapters, model, **row)[0]
                         for adapters, row in zip(ROWS, own_call(call, 0))]
                together = merged(model, own_call(call, 1), run=lora_run)
                assert max(max_diff(got[0], want) for got, want in zip(together, alone)) <= TOLERANCE
                assert min(max_diff(alone[2], alone[i]) for i in (0, 1, 3)) > 1e-3  # each row's adapters count
    finally:
        pipe.set_adapters(*ACTIVE)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_with_another_attention_processor_each_request_runs_with_its_own_adapters(config):
    """The packed forward stands in only for `QwenImage21AttnProcessor`: with another, a call of one request's rows
    runs the model's forward (its t=0 row with their adapters), and rows of other adapters run apart, saying so."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    class OwnProcessor(QwenImage21AttnProcessor):
        pass

    pipe = lora_pipe.__wrapped__(config)
    pipe.transformer.set_attn_processor(OwnProcessor())
    common = dict(COMMON, prompt="a red circle", height=64, width=64, num_inference_steps=3)
    requests = [dict(common, adapters={"all": 1.0}, seed=0), dict(common, adapters={"a": 1.0, "all": 0.5}, seed=1),
                dict(common, adapters={}, seed=2, negative_prompt="blurry", true_cfg_scale=3.0)]
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    with StepBatched(pipe, max_batch_size=16) as sb:
        with engine_held(sb, dict(COMMON, prompt="a blocker", height=32, width=32, num_inference_steps=1, seed=0)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
        splits = sb.stats()["splits"]
    assert max(max_diff(got, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert min(max_diff(expected[2], expected[i]) for i in (0, 1)) > 1e-3
    assert any("rows with other adapters can't share" in reason and "OwnProcessor" in reason for reason in splits), \
        splits
