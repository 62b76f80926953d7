"""Qwen-Image 2.1 TeaCache per request (`models/qwenimage21/teacache.py`): the same skips in shared forwards as
alone, with the KV cache (whose filling call always computes) and without it, also where the first merge is checked
against separate calls (each request's states decide once per step)."""

import dataclasses

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from diffusers_stepbatch import models
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache_fit import fit_coefficients
from diffusers_stepbatch.models.qwenimage21.teacache import signal_hook, teacache_call
from diffusers_stepbatch.models import merge_checks

from .references import (  # noqa: F401  (single_thread is a fixture)
    assert_polynomial_beats_a_constant, assert_teacache_shared_equals_alone, held_out_changes, max_diff, single_thread,
)
from .test_qwenimage21 import condition_image, pipe_for
from .test_row_states import captured_calls

pytestmark = pytest.mark.usefixtures("single_thread")
COMMON = dict(output_type="pt", output_resolution=64)


@pytest.mark.parametrize("case", [{}, dict(use_kv_cache=False), dict(image=condition_image(48, 64, 3)),
                                  dict(negative_prompt="bad", true_cfg_scale=3.0)])
@pytest.mark.parametrize("config", ["tiny", "wide"])
def test_teacache_forward_with_every_row_computing_is_the_model_forward(config, case):
    pipe = pipe_for(config)
    model, blocks = pipe.transformer, len(pipe.transformer.transformer_blocks)
    calls = captured_calls(pipe, prompt="a cat one", height=64, width=96, num_inference_steps=3, output_resolution=64,
                           **case)
    caches = {}  # the run's own caches, replaced by fresh ones per side
    with torch.no_grad():
        for call in calls:
            own = caches.setdefault(id(call.get("kv_cache")), (QwenImage21KVCache(blocks), QwenImage21KVCache(blocks)))
            model_side = dict(call, kv_cache=own[0] if call.get("kv_cache") is not None else None)
            teacache_side = dict(call, kv_cache=own[1] if call.get("kv_cache") is not None else None)
            assert max_diff(teacache_call(model, [None], teacache_side)[0], model(**model_side)[0]) == 0.0


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_teacache_in_shared_forwards_equals_teacache_alone(use_kv_cache, checked, monkeypatch):
    pipe = pipe_for("tiny")
    if checked:  # as a model without proven row rules: its first merge is checked against separate calls
        support = models.support_for(pipe.transformer)
        monkeypatch.setitem(models._SUPPORT, type(pipe.transformer), dataclasses.replace(support, trusted=False))
        monkeypatch.setitem(merge_checks._row_records, pipe.transformer, merge_checks.RowRecord())
    common = dict(COMMON, use_kv_cache=use_kv_cache)
    requests = [dict(common, prompt="a cat one", height=64, width=64, num_inference_steps=12, seed=0),
                dict(common, prompt="a dog two", height=64, width=64, num_inference_steps=14, seed=1),
                dict(common, prompt="a cow 333", height=64, width=64, num_inference_steps=13, seed=2,
                     negative_prompt="bad", true_cfg_scale=3.0),
                dict(common, prompt="a pig 444", height=64, width=64, num_inference_steps=12, seed=3,
                     teacache=None),  # computes every step, beside the others
                dict(common, prompt="a much longer prompt", height=96, width=64, num_inference_steps=13, seed=4)]
    blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, **COMMON)
    stats = assert_teacache_shared_equals_alone(pipe, requests, TeaCacheConfig(threshold=0.6), blocker)
    rows, mixed = stats["rows_histogram"]["denoise"], stats["mixed"]["calls"]
    assert max(rows) >= 3 and mixed > 0, (rows, mixed)  # forwards held rows of several requests and sizes


def test_fitted_coefficients_explain_the_output_change():
    pipe = pipe_for("tiny")
    call = dict(height=64, width=64, num_inference_steps=12, output_resolution=64, output_type="latent")
    coefficients = fit_coefficients(pipe, ["a red circle", "a blue square"], degree=2, signal=signal_hook, **call)
    assert_polynomial_beats_a_constant(coefficients, *held_out_changes(pipe, "a yellow cross", signal_hook, **call))
