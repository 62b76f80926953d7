"""Prompt-embedding cache: hits skip the text encoders, keys isolate models, outputs don't change."""

import threading

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import PromptCache, encoder_namespace
from diffusers_stepbatch.testing import tiny_flux_pipeline

from .references import TOLERANCE, flux_pipe, max_diff, seeded

PROMPTS = [f"a {color} {shape}" for color in ("red", "blue") for shape in ("circle", "square", "cross", "dot", "x")]


def kwargs_for(prompt, **overrides):
    kwargs = dict(prompt=prompt, height=32, width=32, num_inference_steps=2, seed=0, output_type="pt",
                  max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def call(target, prompt, **overrides):
    """Run `target` (a pipeline or StepBatched) on `prompt` with a fresh seeded generator."""
    return target(**seeded(kwargs_for(prompt, **overrides)))


def count_text_forwards(pipe):
    """Forward calls of each text encoder; returns (counts dict, remove function)."""
    counts = {"clip": 0, "t5": 0}
    handles = []
    for name, module in (("clip", pipe.text_encoder), ("t5", pipe.text_encoder_2)):
        def hook(*_, name=name):
            counts[name] += 1
        handles.append(module.register_forward_pre_hook(hook))
    return counts, lambda: [h.remove() for h in handles]


@pytest.mark.parametrize("true_cfg", [False, True])
def test_repeated_prompt_runs_text_encoders_zero_times(true_cfg):
    pipe = flux_pipe("dev-tiny")
    extra = dict(negative_prompt="blurry", true_cfg_scale=2.0) if true_cfg else {}
    kwargs = kwargs_for("a red circle", **extra)
    counts, remove = count_text_forwards(pipe)
    try:
        with StepBatched(pipe) as sb:
            first = sb(**seeded(kwargs)).images
            assert counts == {"clip": 1, "t5": 1}  # positive and negative share one batched encode
            second = sb(**seeded(dict(kwargs, num_images_per_prompt=3, seed=None))).images
            assert counts == {"clip": 1, "t5": 1}
            stats = sb.stats()["prompt_cache"]
    finally:
        remove()
    assert second.shape[0] == 3
    texts = 2 if true_cfg else 1
    assert (stats["hits"], stats["misses"], stats["entries"]) == (texts, texts, texts)
    assert max_diff(first, pipe(**seeded(kwargs)).images) <= TOLERANCE


def test_num_images_per_prompt_is_applied_after_the_lookup():
    pipe = flux_pipe("schnell-tiny")
    generators = lambda: [torch.Generator().manual_seed(s) for s in range(4)]  # noqa: E731
    kwargs = kwargs_for(["a cat", "a dog"], num_images_per_prompt=2)
    del kwargs["seed"]
    expected = pipe(**kwargs, generator=generators()).images
    with StepBatched(pipe) as sb:
        call(sb, "a dog")  # caches "a dog" alone, with one image
        got = sb(**kwargs, generator=generators()).images
        stats = sb.stats()["prompt_cache"]
    assert stats["hits"] == 1 and stats["misses"] == 2
    assert got.shape[0] == 4 and max_diff(got, expected) <= TOLERANCE


def test_outputs_identical_with_and_without_cache():
    pipe = flux_pipe("dev-tiny")
    calls = [kwargs_for(p, seed=i) for i, p in enumerate(["a cat", "a dog", "a cat", "a cat"])]
    calls.append(kwargs_for("a dog", negative_prompt="a cat", true_cfg_scale=3.0, seed=9))
    with StepBatched(pipe) as cached, StepBatched(pipe, prompt_cache=None) as uncached:
        for kwargs in calls:
            assert torch.equal(cached(**seeded(kwargs)).images, uncached(**seeded(kwargs)).images)
        assert cached.stats()["prompt_cache"]["hits"] == 4  # "a cat" twice, then "a dog" and "a cat" as negative
        assert "prompt_cache" not in uncached.stats()


@pytest.mark.parametrize("other", ["schnell-tiny", "dev-wide", "reseeded"])
def test_two_pipelines_with_the_same_prompts_never_share_an_entry(other):
    # NOTE: "schnell-tiny" has text encoders identical to "dev-tiny"'s (same seeds), "reseeded" the same
    # shapes with other weights, "dev-wide" other shapes: the model identity or the fingerprint must differ.
    first = flux_pipe("dev-tiny")
    second = tiny_flux_pipeline(seed=7) if other == "reseeded" else flux_pipe(other)
    cache = PromptCache()
    counts, remove = count_text_forwards(second)
    try:
        with StepBatched(first, prompt_cache=cache) as a, StepBatched(second, prompt_cache=cache) as b:
            for prompt in PROMPTS:
                call(a, prompt)
            size = (24, 40) if other == "dev-wide" else (32, 32)
            for prompt in PROMPTS:
                call(b, prompt, height=size[0], width=size[1])
    finally:
        remove()
    stats = cache.stats()
    assert stats.hits == 0 and stats.misses == 20 and stats.entries == 20
    assert counts == {"clip": 10, "t5": 10}
    namespaces = {key[0] for key in cache.keys()}
    assert len(namespaces) == 2


def test_one_cache_shared_by_two_engines_of_one_pipeline():
    pipe = flux_pipe("dev-tiny")
    cache = PromptCache()
    with StepBatched(pipe, prompt_cache=cache) as a, StepBatched(pipe, prompt_cache=cache) as b:
        expected = a(**seeded(kwargs_for("a blue cross"))).images
        got = b(**seeded(kwargs_for("a blue cross"))).images
    assert cache.stats().hits == 1 and torch.equal(got, expected)


@pytest.mark.parametrize("change", ["max_sequence_length", "weights", "replaced_encoder"])
def test_key_changes_with_what_changes_the_embedding(change):
    pipe = tiny_flux_pipeline(seed=3)
    cache = PromptCache()
    counts, remove = count_text_forwards(pipe)
    try:
        with StepBatched(pipe, prompt_cache=cache) as sb:
            call(sb, "a cat")
            call(sb, "a cat")
            assert counts["t5"] == 1
            if change == "max_sequence_length":
                call(sb, "a cat", max_sequence_length=20)
            elif change == "weights":
                with torch.no_grad():
                    pipe.text_encoder_2.shared.weight.add_(0.5)  # in place, as fusing a LoRA does
                call(sb, "a cat")
            else:
                remove()
                pipe.text_encoder_2 = tiny_flux_pipeline(seed=5).text_encoder_2
                counts, remove = count_text_forwards(pipe)
                counts["t5"] = 1
                call(sb, "a cat")
    finally:
        remove()
    assert counts["t5"] == 2, f"changing {change} must miss the cache"
    assert cache.stats().entries == 2


def test_namespace_carries_dtype_and_placement():
    pipe = tiny_flux_pipeline(seed=6)
    encoders = [pipe.text_encoder, pipe.text_encoder_2]
    base = encoder_namespace(pipe, encoders, "flux", max_sequence_length=16)
    assert encoder_namespace(pipe, encoders, "flux", max_sequence_length=16) == base
    assert encoder_namespace(pipe, encoders, "flux", max_sequence_length=32) != base
    assert encoder_namespace(pipe, encoders, "sd3", max_sequence_length=16) != base
    pipe.text_encoder.to(torch.float64)
    assert encoder_namespace(pipe, encoders, "flux", max_sequence_length=16) != base
    pipe.text_encoder.to(torch.float32)
    pipe.text_encoder._hf_hook = object()  # what enable_model_cpu_offload attaches
    try:
        assert encoder_namespace(pipe, encoders, "flux", max_sequence_length=16) != base
    finally:
        del pipe.text_encoder._hf_hook
    assert encoder_namespace(pipe, encoders, "flux", max_sequence_length=16) == base


def test_weights_fingerprint_ignores_in_place_no_ops():
    pipe = tiny_flux_pipeline(seed=4)
    before = encoder_namespace(pipe, [pipe.text_encoder, pipe.text_encoder_2], "flux")
    with torch.no_grad():
        pipe.text_encoder.final_layer_norm.weight.mul_(1.0)  # bumps the version, same values
    assert encoder_namespace(pipe, [pipe.text_encoder, pipe.text_encoder_2], "flux") == before


def test_hits_cannot_be_changed_by_callers():
    cache = PromptCache()
    original = torch.arange(6.0).reshape(2, 3)
    cache.put("k", (original,))
    original.zero_()  # the caller's tensor is not the stored one
    hit = cache.get("k")[0]
    hit.mul_(100)
    assert torch.equal(cache.get("k")[0], torch.arange(6.0).reshape(2, 3))


def test_hits_returned_to_programs_are_fresh_tensors():
    pipe = flux_pipe("dev-tiny")
    kwargs = kwargs_for("a yellow square", num_inference_steps=3)

    def vandal(step_pipe, i, t, tensors):
        tensors["prompt_embeds"].mul_(0.0)  # in place, on what the cache returned
        return {}

    with StepBatched(pipe) as sb:
        clean = sb(**seeded(kwargs)).images
        sb(**seeded(kwargs), callback_on_step_end=vandal, callback_on_step_end_tensor_inputs=["prompt_embeds"])
        again = sb(**seeded(kwargs)).images
    assert torch.equal(clean, again)


def test_lru_is_bounded_in_bytes_and_counts():
    row = torch.zeros(1, 256)  # 1 KiB
    cache = PromptCache(max_bytes=3 * 1024)
    for i in range(5):
        cache.put(i, (row,))
    assert cache.get(0) is None and cache.get(1) is None
    assert cache.get(4) is not None and cache.get(2) is not None  # 2 becomes most recent
    cache.put(5, (row,))  # evicts 3, the least recently used
    assert sorted(cache.keys()) == [2, 4, 5]
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 3 * 1024, 3)
    assert (stats.hits, stats.misses) == (2, 2) and stats.hit_rate == 0.5
    cache.put("huge", (torch.zeros(1, 2048),))  # larger than the whole cache: not stored, nothing evicted
    assert "huge" not in cache.keys() and len(cache) == 3
    with pytest.raises(ValueError, match="max_bytes=-1"):
        PromptCache(max_bytes=-1)
    with pytest.raises(ValueError, match="prompt_cache="):
        StepBatched(flux_pipe("dev-tiny"), prompt_cache={"size": 10})


def test_thread_safe_under_concurrent_puts_and_gets():
    cache = PromptCache(max_bytes=64 * 1024)
    errors = []

    def worker(offset):
        try:
            for i in range(300):
                key = (offset + i) % 97
                cache.put(key, (torch.full((1, 64), float(key)),))
                hit = cache.get((key * 7) % 97)
                if hit is not None:
                    assert hit[0][0, 0].item() == (key * 7) % 97
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 13,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = cache.stats()
    assert stats.bytes == stats.entries * 256 <= 64 * 1024
    assert stats.hits + stats.misses == 1200


def test_lora_adapter_switches_change_the_key():
    # NOTE: peft is not installed here; these are the attributes a peft LoRA layer carries, which
    # `set_adapters` / `disable_lora` change without touching any tensor.
    pipe = tiny_flux_pipeline(seed=8)
    encoders = [pipe.text_encoder, pipe.text_encoder_2]
    plain = encoder_namespace(pipe, encoders, "flux")
    layer = pipe.text_encoder.encoder.layers[0].self_attn.q_proj
    layer.scaling, layer.active_adapters, layer.disable_adapters = {"style": 1.0}, ["style"], False
    pipe.text_encoder._hf_peft_config_loaded = True
    loaded = encoder_namespace(pipe, encoders, "flux")
    layer.scaling = {"style": 0.5}
    rescaled = encoder_namespace(pipe, encoders, "flux")
    layer.disable_adapters = True
    disabled = encoder_namespace(pipe, encoders, "flux")
    assert len({plain, loaded, rescaled, disabled}) == 4


def test_an_encoder_in_training_mode_is_not_cached():
    """A text encoder built from a config (as diffusers' own tests build theirs) is in training mode: its dropout
    gives the plain pipeline new embeddings every call, drawn from the global RNG; wrapped calls draw the same."""
    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder_2.train()  # T5's dropout_rate: 0.1
    expected = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        expected.append(call(pipe, "a red circle").images)
    assert max_diff(expected[0], expected[1]) > 1e-3  # dropout really changes the plain output
    cache = PromptCache()
    with StepBatched(pipe, prompt_cache=cache) as sb:
        for global_seed, want in zip((1, 2), expected):
            torch.manual_seed(global_seed)
            assert max_diff(call(sb, "a red circle").images, want) <= TOLERANCE
    assert len(cache) == 0
    pipe.text_encoder_2.eval()
    with StepBatched(pipe, prompt_cache=cache) as sb:
        call(sb, "a red circle")
    assert len(cache) == 1  # in eval mode it caches again
