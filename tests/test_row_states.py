"""Row states (`ModelSupport.row_states`): a request's KV cache, filled by its first step's call and read by its
later ones, in calls merged with other requests' calls.

Each test captures the transformer calls of plain pipeline runs, then runs two requests' calls separately and as
one merged call through the model layer (`describe_call`, `run_call`, `cut`): outputs and caches must match.
"""

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinKVPipeline
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from PIL import Image

import diffusers_stepbatch.programs  # noqa: F401  (before models.calls, which the programs import)
from diffusers_stepbatch.models.calls import cut, describe_call, run_call
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_qwenimage21_pipeline

from .references import TOLERANCE, max_diff, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def captured_calls(pipe, **kwargs) -> list[dict]:
    """The keyword arguments of each transformer call of one plain run."""
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda _m, _a, kw: calls.append(dict(kw)), with_kwargs=True)
    try:
        pipe(generator=torch.Generator().manual_seed(len(kwargs["prompt"])), output_type="pt", **kwargs)
    finally:
        hook.remove()
    return calls


def merged(model, calls: list[dict], run=run_call) -> list:
    """The calls as one call of all their rows (`run(model, call, rows)`: the model's forward), its output cut back
    per call."""
    described = [describe_call(model, (), kwargs) for kwargs in calls]
    assert all(call.signature == described[0].signature for call in described)
    rows = {}
    for i, first in enumerate(described[0].row_inputs):
        parts = [call.row_inputs[i] for call in described]
        rows[f"row{i}"] = sum(parts, []) if isinstance(first, list) else torch.cat(parts)
    output = run(model, described[0], rows)
    return [cut(output, i, i + 1, len(calls), described[0].support) for i in range(len(calls))]


def image(seed: int, height: int = 64, width: int = 64) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def cache_layers(cache) -> list:
    layers = cache.double_block_caches + cache.single_block_caches if hasattr(cache, "double_block_caches") \
        else cache.layer_caches
    return [tensor for layer in layers for tensor in layer.get()]


FLUX2_CONFIGS = [dict(heads=2, head_dim=16, axes_dims=(4, 4, 4, 4)), dict(heads=4, head_dim=8, axes_dims=(2, 2, 2, 2))]


@pytest.mark.parametrize("config", FLUX2_CONFIGS)
@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_flux2_klein_kv_caches_fill_and_read_per_row_in_merged_calls(config, size):
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **config)
    model = pipe.transformer
    common = dict(height=size[0], width=size[1], num_inference_steps=2, text_encoder_out_layers=(1,),
                  max_sequence_length=32)
    runs = [captured_calls(pipe, prompt=prompt, image=image(seed), **common)
            for prompt, seed in (("a cat", 0), ("a dog", 1))]
    with torch.no_grad():
        alone = [model(**calls[0]) for calls in runs]  # extract: (noise, the request's new cache)
        together = merged(model, [calls[0] for calls in runs])
        for (noise, cache), (merged_noise, merged_cache) in zip(alone, together):
            assert max_diff(merged_noise, noise) <= TOLERANCE
            assert merged_cache.num_ref_tokens == cache.num_ref_tokens
            assert max(max_diff(a, b) for a, b in zip(cache_layers(merged_cache), cache_layers(cache))) <= TOLERANCE
        cached = [dict(calls[1], kv_cache=cache) for calls, (_, cache) in zip(runs, alone)]
        separate = [model(**kwargs)[0] for kwargs in cached]
        for (noise,), own in zip(merged(model, cached), separate):
            assert max_diff(noise, own) <= TOLERANCE


def test_flux2_klein_kv_caches_of_other_reference_lengths_keep_calls_apart():
    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline)
    common = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, text_encoder_out_layers=(1,),
                  max_sequence_length=32)
    caches = [pipe.transformer(**captured_calls(pipe, image=reference, **common)[0])[1]
              for reference in (image(0), image(1), image(2, 64, 96))]
    cached = captured_calls(pipe, image=image(0), **common)[1]
    signatures = [describe_call(pipe.transformer, (), dict(cached, kv_cache=cache)).signature for cache in caches]
    assert caches[0].num_ref_tokens == caches[1].num_ref_tokens != caches[2].num_ref_tokens
    assert signatures[0] == signatures[1] != signatures[2]


QWEN21_CONFIGS = [{}, dict(heads=4, head_dim=8, axes_dims=(2, 2, 4), latent_channels=4, text_hidden=24)]


@pytest.mark.parametrize("config", QWEN21_CONFIGS)
@pytest.mark.parametrize("condition", [None, (64, 48)])
def test_qwenimage21_caches_fill_and_read_per_row_in_merged_calls(config, condition):
    pipe = tiny_qwenimage21_pipeline(**config)
    model = pipe.transformer
    blocks = len(model.transformer_blocks)
    extra = {} if condition is None else dict(image=image(3, *condition))
    runs = [captured_calls(pipe, prompt=prompt, height=64, width=96, num_inference_steps=2, output_resolution=64,
                           **extra) for prompt in ("a cat one", "a dog two")]  # prompts of one token count
    with torch.no_grad():
        own_caches = [QwenImage21KVCache(blocks) for _ in runs]
        alone = [model(**dict(calls[0], kv_cache=cache))[0] for calls, cache in zip(runs, own_caches)]
        shared_caches = [QwenImage21KVCache(blocks) for _ in runs]
        together = merged(model, [dict(calls[0], kv_cache=cache) for calls, cache in zip(runs, shared_caches)])
        for (noise,), own in zip(together, alone):
            assert max_diff(noise, own) <= TOLERANCE
        for shared, own in zip(shared_caches, own_caches):  # each request's cache holds its own rows
            assert max(max_diff(a, b) for a, b in zip(cache_layers(shared), cache_layers(own))) <= TOLERANCE
        separate = [model(**dict(calls[1], kv_cache=cache))[0] for calls, cache in zip(runs, own_caches)]
        together = merged(model, [dict(calls[1], kv_cache=cache) for calls, cache in zip(runs, shared_caches)])
        for (noise,), own in zip(together, separate):
            assert max_diff(noise, own) <= TOLERANCE


def test_a_merged_call_never_holds_part_of_a_requests_state():
    from diffusers_stepbatch.models.calls import _join_state
    from diffusers_stepbatch.models.flux2.kv_cache import KV_CACHE

    state = object()
    with pytest.raises(ValueError, match="without its earlier rows"):
        _join_state(KV_CACHE, [(state, 1)])
    assert _join_state(KV_CACHE, [(state, 0), (state, 1)]) is state  # one call's whole state: itself
