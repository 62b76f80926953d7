"""The prompt cache in the generic program: text- and image-encoder calls answered from the cache when the encoder
and its inputs (prompt tokens, reference images) are the same, and only then. Tiny Wan 2.1 pipelines."""

import pytest
import torch
from PIL import Image

from diffusers_stepbatch import PromptCache, StepBatched
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _video(prompt: str, seed: int = 0, **extra) -> dict:
    return dict(prompt=prompt, negative_prompt="blur", num_frames=5, height=16, width=16, num_inference_steps=2,
                guidance_scale=4.0, output_type="pt", max_sequence_length=16, seed=seed, **extra)


def _calls(module):
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("head_dim", [8, 12])
def test_repeated_prompts_skip_the_text_encoder_and_stay_exact(head_dim):
    pipe = tiny_wan_pipeline(head_dim=head_dim, layers=1)
    requests = [_video("a cat", 0), _video("a cat", 1), _video("a dog", 2)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    calls, handle = _calls(pipe.text_encoder)
    try:
        with StepBatched(pipe) as sb:
            results = [sb(**seeded(kwargs)).frames for kwargs in requests]
            stats = sb.stats()["prompt_cache"]
    finally:
        handle.remove()
    assert max(max_diff(got, want) for got, want in zip(results, expected)) <= TOLERANCE
    # "a cat" and "blur" once, then "a dog": the second request's two encodes and the third's negative are hits
    assert len(calls) == 3 and stats["hits"] == 3 and stats["misses"] == 3, (calls, stats)


@pytest.mark.parametrize("colours", [((200, 10, 10), (10, 200, 10)), ((0, 0, 0), (0, 0, 1))])
def test_reference_images_are_part_of_the_key(colours):
    pipe = tiny_wan_pipeline(image_to_video=True, layers=1)
    images = [Image.new("RGB", (16, 16), colour) for colour in colours]
    requests = [_video("a cat", 0, image=images[0]), _video("a cat", 1, image=images[0]),
                _video("a cat", 2, image=images[1])]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    calls, handle = _calls(pipe.image_encoder)
    try:
        with StepBatched(pipe) as sb:
            results = [sb(**seeded(kwargs)).frames for kwargs in requests]
    finally:
        handle.remove()
    assert max(max_diff(got, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert len(calls) == 2, "the same image was encoded twice, or another image was answered from the cache"


def test_an_encoder_that_changed_or_trains_is_not_answered_from_the_cache():
    pipe = tiny_wan_pipeline(layers=1)
    cache = PromptCache()
    with StepBatched(pipe, prompt_cache=cache) as sb:
        sb(**seeded(_video("a cat")))
        entries = len(cache)
        weight = pipe.text_encoder.shared.weight
        with torch.no_grad():
            weight.add_(0.5)
        try:
            expected = pipe(**seeded(_video("a cat"))).frames
            assert max_diff(sb(**seeded(_video("a cat"))).frames, expected) <= TOLERANCE
            assert len(cache) == entries + 2  # new entries under the new weights
            pipe.text_encoder.train()
            sb(**seeded(_video("a cat")))
            assert len(cache) == entries + 2  # dropout: nothing stored
        finally:
            pipe.text_encoder.eval()
            with torch.no_grad():
                weight.sub_(0.5)


def test_no_prompt_cache_encodes_every_time():
    pipe = tiny_wan_pipeline(layers=1)
    calls, handle = _calls(pipe.text_encoder)
    try:
        with StepBatched(pipe, prompt_cache=None) as sb:
            for _ in range(2):
                sb(**seeded(_video("a cat")))
    finally:
        handle.remove()
    assert len(calls) == 4


def test_an_output_with_a_key_value_cache_round_trips_through_the_prompt_cache():
    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from diffusers_stepbatch.cache import encoder_calls

    kv = DynamicCache()
    for layer in range(2):
        kv.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=layer)
    output = BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 3, 8), past_key_values=kv)
    cache = PromptCache()
    encoder_calls.store(cache, "key", output)
    assert cache.stats().bytes == 4 * (3 * 8 + 2 * 2 * 2 * 3 * 4)  # the states and every layer's keys and values
    back = encoder_calls.lookup(cache, "key")
    assert torch.equal(back.last_hidden_state, output.last_hidden_state)
    for got, want in zip(back.past_key_values.layers, kv.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    back.last_hidden_state.add_(1)  # fresh copies: the stored entry stays as it was
    assert torch.equal(encoder_calls.lookup(cache, "key").last_hidden_state, output.last_hidden_state)
