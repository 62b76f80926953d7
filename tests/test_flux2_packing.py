"""FLUX.2 (dev and klein) requests of different sizes, aspect ratios and reference images share packed forwards.

The generic program intercepts `Flux2Transformer2DModel` calls; calls of other image token counts (an edit row's
reference images included) and text lengths run as one packed call (`models/flux2/packing.py`), and each request
still equals its plain solo run. A custom attention processor keeps sizes apart, klein KV calls of one size share
forwards by rows (their packed forwards: test_flux2_kv_packing.py), and per-request LoRA mixes adapters in one
forward.
"""


import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models import support_for
from diffusers_stepbatch.models.flux2.packing import Flux2Part
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.testing import add_random_lora_adapters
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

from .flux2_cases import BUILDERS, COMMON, CONFIGS, flux2_pipe, reference_image
from .test_lora_requests import ACTIVE, plain_run
from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE,
    count_forwards,
    engine_held,
    max_diff,
    plain_and_wrapped,
    seeded,
    single_thread,
    submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")



def _requests():
    """Text-to-image and edit requests (1-3 reference images of their own sizes) at 4 output sizes."""
    references = [None, [reference_image(64, 64, 0)], None, [reference_image(64, 96, 1), reference_image(96, 64, 2)],
                  [reference_image(64, 64, 3), reference_image(64, 80, 4), reference_image(80, 64, 5)],
                  [reference_image(80, 96, 6)], None]
    sizes = [(32, 32), (32, 48), (48, 32), (48, 48), (32, 48), (32, 32), (48, 32)]
    requests = []
    for i, ((height, width), images) in enumerate(zip(sizes, references)):
        kwargs = dict(prompt="a red circle" if i % 2 else f"a shape {i}", height=height, width=width,
                      num_inference_steps=2 + i % 3, guidance_scale=[1.0, 3.0, 4.5][i % 3], seed=i, **COMMON)
        if images is not None:
            kwargs["image"] = images
        requests.append(kwargs)
    return requests


def flux2_parts(part_shapes):
    """Flux2Parts of random inputs and their position ids, as the FLUX.2 pipelines make them: `part_shapes` holds
    (rows, (height, width) of the latent grid, reference grids, text tokens)."""
    def grid(height, width, t):
        return torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width), torch.arange(1))

    parts = []
    for rows, (height, width), references, text in part_shapes:
        img_ids = torch.cat([grid(height, width, 0)] + [grid(h, w, 10 + 10 * i) for i, (h, w) in enumerate(references)])
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
        parts.append(Flux2Part(hidden_states=torch.randn(rows, img_ids.shape[0], 4),
                               encoder_hidden_states=torch.randn(rows, text, 16), timestep=torch.rand(rows),
                               guidance=None, txt_ids=txt_ids, img_ids=img_ids))
    return parts


def test_packed_calls_return_what_the_model_returns():
    from diffusers_stepbatch.models.flux2.packing import pack_calls

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                    axes_dims_rope=[4, 4, 4, 4]).eval()
    calls = [dict(hidden_states=p.hidden_states, encoder_hidden_states=p.encoder_hidden_states, timestep=p.timestep,
                  img_ids=p.img_ids, txt_ids=p.txt_ids, return_dict=return_dict)
             for p, return_dict in zip(flux2_parts([(1, (4, 4), [], 8), (2, (2, 6), [], 5)]), (True, False))]
    with torch.no_grad():
        packed = pack_calls(model, calls, "auto", [None, None])
        own = [model(**call) for call in calls]
    assert [type(out) for out in packed] == [type(out) for out in own]
    assert max_diff(packed[0].sample, own[0].sample) <= 1e-5 and max_diff(packed[1][0], own[1][0]) <= 1e-5


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("variant", sorted(BUILDERS))
def test_requests_of_different_sizes_and_references_pack_and_equal_their_solo_runs(variant, config):
    pipe = flux2_pipe(variant, config)
    assert program_for(pipe) is generic.plan_generic
    requests = _requests()
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, max_batch_size=16) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
    # the reference images matter: an edit request differs from the same request without them
    plain = dict(requests[1])
    del plain["image"]
    assert max_diff(pipe(**seeded(plain)).images, expected[1]) > 1e-3


def test_an_other_attention_processor_keeps_sizes_apart_and_exact():
    class OwnProcessor(Flux2AttnProcessor):  # a custom processor: a packed call would bypass it
        pass

    pipe = tiny_flux2_klein_pipeline()
    requests = [dict(prompt="a cat", height=32, width=48, num_inference_steps=2, seed=0, **COMMON),
                dict(prompt="a dog", height=48, width=32, num_inference_steps=2, seed=1, **COMMON),
                dict(prompt="a bird", height=48, width=32, num_inference_steps=3, seed=2, guidance_scale=1.0,
                     **COMMON),
                dict(prompt="a fish", height=48, width=32, image=[reference_image(64, 64, 0)], num_inference_steps=2,
                     seed=3, **COMMON)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    for block in pipe.transformer.transformer_blocks:
        block.attn.set_processor(OwnProcessor())
    assert "OwnProcessor" in support_for(pipe.transformer).packing.unsupported(pipe.transformer)
    calls, hook = count_forwards(pipe.transformer)
    try:
        with StepBatched(pipe, max_batch_size=16) as sb:
            results = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        hook.remove()
    assert max(max_diff(got.images, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] == 0
    # 32x48 and 48x32 have equal token counts but other positions: only the two plain 48x32 requests share a
    # forward (klein runs its CFG branches as calls of one row each); the edit request has more image tokens
    assert max(calls) == 2 and stats["splits"].get("denoise: argument img_ids", 0) > 0, (calls, stats["splits"])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_klein_kv_requests_share_forwards_through_their_caches_and_stay_exact(config):
    from diffusers import Flux2KleinKVPipeline

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline, **CONFIGS[config])
    one_reference = [dict(prompt=prompt, image=reference_image(64, 64, seed), height=32, width=32,
                          num_inference_steps=steps, seed=seed, **COMMON)
                     for prompt, steps, seed in (("a cat", 3, 0), ("a dog", 4, 1), ("a cow", 2, 2))]
    requests = one_reference + [
        dict(prompt="a dog", image=[reference_image(64, 96, 3), reference_image(64, 64, 4)], height=32, width=48,
             num_inference_steps=2, seed=3, **COMMON),
        dict(prompt="a b", image=reference_image(80, 64, 5), height=48, width=32, num_inference_steps=2, seed=4,
             **COMMON),
        dict(prompt="no reference", height=32, width=32, num_inference_steps=2, seed=5, **COMMON)]
    runs = plain_and_wrapped(pipe, requests, max_batch_size=16, mixed_resolution=False)
    assert max(max_diff(got.images, want.images) for got, want in zip(runs.wrapped, runs.plain)) <= TOLERANCE
    # without packed forwards, the three requests with one 64x64 reference share calls that fill or read their
    # caches (their rows' caches joined)
    assert max(runs.wrapped_rows) >= 2, runs.wrapped_rows


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("side, other", [(48, 64), (64, 600)])  # too small; an aspect ratio past 8
def test_a_reference_image_the_pipeline_refuses_raises_at_submit_with_its_message(kv, side, other):
    """The FLUX.2 pipelines check each input image in `__call__` (`image_processor.check_image_input`), after the
    request would have been queued; the caller runs the same check at submit, with the pipeline's own message."""
    from diffusers import Flux2KleinKVPipeline

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline) if kv else flux2_pipe("klein", "narrow")
    images = [reference_image(64, 64, 0), reference_image(side, other, 1)]
    kwargs = dict(prompt="a cat", image=images, height=32, width=32, num_inference_steps=2, **COMMON)
    with pytest.raises(ValueError) as plain:
        pipe(**seeded(kwargs))
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError) as wrapped:
            sb.submit(**seeded(kwargs))
        stats = sb.stats()
    assert (stats["waiting"], stats["running"], stats["requests"]) == (0, 0, [])  # nothing was queued
    assert str(wrapped.value) == str(plain.value)


# ------------------------------------------------------------------------------------------- per-request LoRA
LORA_REQUESTS = [({"a": 1.0}, "a red circle", 0), ({"b": 1.0}, "a red circle", 0),
                 ({"a": 0.7, "c": 0.3}, "a blue square", 1), ({}, "a red circle", 0), (None, "a red circle", 3),
                 (["a", "b", "c"], "a blue square", 4)]


def test_requests_with_their_own_adapters_share_forwards_and_equal_plain_runs(monkeypatch):
    from diffusers_stepbatch.adapters import state as adapter_state

    pipe = tiny_flux2_klein_pipeline(seed=5)
    add_random_lora_adapters(pipe.transformer)
    pipe.set_adapters(*ACTIVE)
    requests = []
    for adapters, prompt, seed in LORA_REQUESTS:
        kwargs = dict(prompt=prompt, height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=seed,
                      **COMMON)
        if adapters is not None:
            kwargs["adapters"] = adapters
        requests.append(kwargs)
    # another size: its own forward
    requests.append(dict(requests[2], height=48, width=32, image=[reference_image(64, 64, 1)]))
    expected = [plain_run(pipe, kwargs) for kwargs in requests]

    recorded = []
    real = adapter_state.per_row_lora

    def record(model, row_weights, token_rows=None):
        recorded.append([tuple(sorted(w.items())) for w in row_weights])
        return real(model, row_weights, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    with StepBatched(pipe, max_batch_size=16) as sb:
        blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, seed=0, adapters={},
                       **COMMON)
        with engine_held(sb, blocker):  # all start in lockstep
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300) for future in futures]
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    assert max_diff(expected[0], expected[3]) > 1e-3 and max_diff(expected[0], expected[1]) > 1e-3
    # one forward held the rows of every 32x32 request, each with its own weights
    assert max(len(set(rows)) for rows in recorded) == len(LORA_REQUESTS), recorded


def test_pack_key_lets_sizes_and_references_pack_and_refuses_what_the_packed_forward_does_not_reproduce():
    from diffusers_stepbatch.models.flux2.packing import pack_key

    small, edit = flux2_parts([(1, (4, 4), [], 8), (2, (2, 6), [(3, 3), (4, 2)], 12)])

    def arguments(part, **extra):
        return dict(hidden_states=part.hidden_states, encoder_hidden_states=part.encoder_hidden_states,
                    timestep=part.timestep, guidance=None, img_ids=part.img_ids[None], txt_ids=part.txt_ids[None],
                    return_dict=False, **extra)

    key, tokens = pack_key(arguments(small))
    assert pack_key(arguments(edit))[0] == key and tokens == 16 + 8
    assert pack_key(arguments(edit))[1] == 12 + 9 + 8 + 12
    assert pack_key(dict(arguments(small), guidance=torch.ones(1)))[0] != key  # guidance rows never join klein's
    for refused in (dict(kv_cache_mode="cached"), dict(joint_attention_kwargs={"mask": 1}),
                    dict(timestep=torch.tensor(0.5))):
        assert pack_key({**arguments(small), **refused}) is None, refused


@pytest.mark.parametrize("config", list(CONFIGS))
def test_klein_inpaint_requests_of_different_sizes_pack_and_equal_their_solo_runs(config):
    from diffusers import Flux2KleinInpaintPipeline

    pipe = Flux2KleinInpaintPipeline(**flux2_pipe("klein", config).components)
    pipe.set_progress_bar_config(disable=True)
    assert program_for(pipe) is generic.plan_generic
    requests = []
    for i, (height, width) in enumerate([(64, 64), (64, 96), (96, 64), (64, 64)]):
        mask = np.zeros((height, width), dtype="uint8")
        mask[: height // 2, : width // 2] = 255  # repaint the top-left quarter
        requests.append(dict(prompt=f"a red square {i}", image=reference_image(height, width, 10 + i),
                             mask_image=Image.fromarray(mask), height=height, width=width, strength=0.6 + 0.1 * i,
                             num_inference_steps=2 + i % 2, guidance_scale=1.0, seed=i, **COMMON))
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, max_batch_size=16) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert max(max_diff(got.images, want) for got, want in zip(results, expected)) <= TOLERANCE
    assert stats["mixed"]["calls"] > 0 and stats["mixed"]["sizes_per_call"] > 1, stats["mixed"]
