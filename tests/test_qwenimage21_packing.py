"""Qwen-Image 2.1's packed forward (`models/qwenimage21/packing.py`): calls of other sizes, prompt lengths and
condition images, filling their KV cache, reading it or without one, as one call equal to each call alone."""

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.models.qwenimage21.packing import pack_calls, pack_key

from .references import TOLERANCE, max_diff, single_thread  # noqa: F401  (fixture)
from .test_qwenimage21 import condition_image, pipe_for
from .test_row_states import captured_calls

pytestmark = pytest.mark.usefixtures("single_thread")

RUNS = [dict(prompt="a cat one", height=64, width=96),
        dict(prompt="a much longer dog", height=96, width=64, negative_prompt="bad", true_cfg_scale=3.0),
        dict(prompt="edit it", image=condition_image(48, 64, 3)),
        dict(prompt="no cache here", height=64, width=64, use_kv_cache=False)]


@pytest.mark.parametrize("config", ["tiny", "wide"])
def test_packed_calls_equal_each_call_alone_at_every_step(config):
    pipe = pipe_for(config)
    model, blocks = pipe.transformer, len(pipe.transformer.transformer_blocks)
    runs = [captured_calls(pipe, num_inference_steps=3, output_resolution=64, **run) for run in RUNS]
    assert support_for(model).packing.unsupported(model) is None
    caches = [{}, {}]  # per side: the run's caches, replaced by fresh ones
    with torch.no_grad():
        for step in range(3):
            sides = [[], []]
            for calls in runs:
                call = calls[step]
                for side, own in zip(sides, caches):
                    given = call.get("kv_cache")
                    side.append(dict(call, kv_cache=None if given is None else own.setdefault(
                        id(given), QwenImage21KVCache(blocks))))
            assert len({pack_key(call)[0] for call in sides[1]}) == 1  # one packed call for all of them
            alone = [model(**call)[0] for call in sides[0]]
            packed = pack_calls(model, sides[1], "auto", [None] * len(sides[1]))
            for own, (out,) in zip(alone, packed):
                assert max_diff(out, own) <= TOLERANCE


def test_calls_the_model_would_refuse_run_as_the_model_does():
    """A KV cache without its mode (or a mode without a cache) is the model's error to raise: never packed."""
    from diffusers_stepbatch.models.qwenimage21.teacache import teacache_call

    pipe = pipe_for("tiny")
    call = captured_calls(pipe, num_inference_steps=2, output_resolution=64, **RUNS[0])[1]
    assert pack_key(call) is not None
    for wrong in (dict(call, kv_cache_mode=None), dict(call, kv_cache=None), dict(call, kv_cache_mode="other")):
        assert pack_key(wrong) is None and teacache_call(pipe.transformer, [None], wrong) is None
        with pytest.raises(ValueError, match="kv_cache"):
            pipe.transformer(**wrong)
