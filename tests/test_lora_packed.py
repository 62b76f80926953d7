"""Per-request LoRA inside the generic program's forwards over several sizes: requests of different sizes, each with
its own adapters, share packed forwards (FLUX.1 Kontext, FLUX.2 klein, Qwen-Image Edit: `Packing.token_rows`) or
Z-Image's own forward, which joins its rows' tokens (`ModelSupport.lora_token_rows`); each request equals the plain
pipeline after `set_adapters`, run alone."""

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.adapters import state as adapter_state
from diffusers_stepbatch.programs import generic, program_for
from diffusers_stepbatch.testing import FluxSize, add_random_lora_adapters, tiny_flux_pipeline
from diffusers_stepbatch.testing.image_models import (
    tiny_flux2_klein_pipeline,
    tiny_qwenimage_edit_pipeline,
    tiny_z_image_pipeline,
)

from .references import TOLERANCE, engine_held, max_diff, seeded
from .test_lora_requests import ACTIVE, plain_run

# (adapters= or None for the pipeline's active adapters, LoRA scale or None), one per request
ADAPTERS = [({"a": 1.0}, None), ({"b": 0.5}, None), ({}, None), (None, None), ({"a": 0.3, "c": 1.0}, None),
            ({"b": 1.0}, 0.5)]


def _gradient(width, height, seed):
    """A reference image: a horizontal gradient between two random colours."""
    rng = np.random.default_rng(seed)
    left, right = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0.0, 1.0, width)[None, :, None]
    return Image.fromarray((left * (1 - ramp) + right * ramp).repeat(height, 0).astype(np.uint8))


def _kontext(config):
    from diffusers import FluxKontextPipeline

    size = {"tiny": FluxSize(), "wide": FluxSize(num_layers=2, num_single_layers=1, attention_head_dim=8,
                                                 num_attention_heads=4, joint_attention_dim=24,
                                                 pooled_projection_dim=40, in_channels=8)}[config]
    pipe = FluxKontextPipeline(**tiny_flux_pipeline(guidance_embeds=True, size=size).components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _kontext_request(i, height, width):
    image = torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(10 + i))
    return dict(image=image, height=height, width=width, max_sequence_length=16, _auto_resize=False,
                max_area=height * width, guidance_scale=2.0 + i)


def _klein(config):
    return tiny_flux2_klein_pipeline(**{"narrow": dict(heads=2, head_dim=16, axes_dims=(4, 4, 4, 4)),
                                        "wide": dict(heads=4, head_dim=8, axes_dims=(2, 2, 2, 2))}[config])


def _klein_request(i, height, width):
    # NOTE: compared as latents: the tiny VAE decoder shrinks differences
    kwargs = dict(height=height, width=width, text_encoder_out_layers=(1,), max_sequence_length=32,
                  guidance_scale=[1.0, 3.0, 4.5][i % 3], output_type="latent")
    if i % 2:  # edit requests: reference images of their own sizes
        kwargs["image"] = [_gradient(64 + 16 * (i % 3), 64, i)]
    return kwargs


def _qwen_edit(config):
    return tiny_qwenimage_edit_pipeline(**{"tiny": {}, "wide": dict(num_layers=2, attention_head_dim=8,
                                                                    num_attention_heads=4, text_hidden=24,
                                                                    vae_base_dim=2)}[config])


def _qwen_edit_request(i, height, width):
    # NOTE: compared as latents: the tiny VAE decoder shrinks differences ~100x
    return dict(image=_gradient([80, 64, 40][i % 3], [48, 64, 96][i % 3], i), height=height, width=width,
                negative_prompt="blurry", true_cfg_scale=1.0 if i == 2 else 3.0, output_type="latent")


def _z_image(config):
    return tiny_z_image_pipeline(**{"narrow": {}, "wide": dict(dim=48, heads=4, axes_dims=(4, 4, 4))}[config])


def _z_image_request(i, height, width):
    return dict(height=height, width=width, guidance_scale=[0.0, 3.0, 5.0][i % 3])


# family: (builder(config), configs, attention-kwargs name, request(i, height, width) -> kwargs, sizes)
PACKED_FAMILIES = {
    "kontext": (_kontext, ("tiny", "wide"), "joint_attention_kwargs", _kontext_request,
                [(32, 32), (32, 48), (48, 32), (32, 48), (48, 48), (32, 32)]),
    "flux2-klein": (_klein, ("narrow", "wide"), "attention_kwargs", _klein_request,
                    [(32, 32), (32, 48), (48, 32), (32, 48), (48, 48), (32, 32)]),
    "qwenimage-edit": (_qwen_edit, ("tiny", "wide"), "attention_kwargs", _qwen_edit_request,
                       [(32, 32), (32, 64), (64, 32), (32, 64), (64, 64), (32, 32)]),
    "z-image": (_z_image, ("narrow", "wide"), "joint_attention_kwargs", _z_image_request,
                [(32, 32), (32, 48), (48, 32), (16, 32), (48, 48), (32, 32)]),
}
CASES = [(family, config) for family, spec in PACKED_FAMILIES.items() for config in spec[1]]


@functools.cache
def lora_pipe(family, config):
    pipe = PACKED_FAMILIES[family][0](config)
    add_random_lora_adapters(pipe.transformer)
    return pipe


def requests_of(family):
    _, _, kwargs_name, request, sizes = PACKED_FAMILIES[family]
    requests = []
    for i, ((adapters, scale), (height, width)) in enumerate(zip(ADAPTERS, sizes)):
        kwargs = dict(request(i, height, width), prompt=["a red circle", "a blue square", "a cat"][i % 3],
                      num_inference_steps=2 + i % 2, seed=i)
        kwargs.setdefault("output_type", "pt")
        if scale is not None:
            kwargs[kwargs_name] = {"scale": scale}
        if adapters is not None:
            kwargs["adapters"] = adapters
        requests.append(kwargs)
    return requests


@pytest.fixture
def lora_forwards(monkeypatch):
    """Per per-row LoRA forward: (distinct adapter weight sets among its rows, whether token streams were mapped)."""
    forwards = []
    real = adapter_state.per_row_lora

    def record(model, row_weights, token_rows=None):
        forwards.append((len({tuple(sorted(w.items())) for w in row_weights}), token_rows is not None))
        return real(model, row_weights, token_rows)

    monkeypatch.setattr(adapter_state, "per_row_lora", record)
    return forwards


@pytest.mark.parametrize("family, config", CASES)
def test_requests_of_different_sizes_with_their_own_adapters_share_forwards_and_equal_plain_runs(
        family, config, lora_forwards, caplog):
    pipe = lora_pipe(family, config)
    assert program_for(pipe) is generic.plan_generic
    pipe.set_adapters(*ACTIVE)
    requests = requests_of(family)
    expected = [plain_run(pipe, kwargs) for kwargs in requests]
    sizes = _forward_sizes(pipe.transformer) if family == "z-image" else None
    caplog.set_level("WARNING", logger="diffusers_stepbatch.engine.core")
    try:
        with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=16, cost_aware=False)) as sb:
            blocker = dict(requests[0], adapters={}, num_inference_steps=1, seed=0)
            with engine_held(sb, blocker):  # all start in lockstep
                futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
            results = [future.result(300).images for future in futures]
            mixed_calls = sb.stats()["mixed"]["calls"]
    finally:
        if sizes is not None:
            sizes[1].remove()
    differences = [max_diff(got, want) for got, want in zip(results, expected)]
    assert max(differences) <= TOLERANCE, differences
    for i in (0, 5):  # the adapters (and the LoRA scale) matter
        assert max_diff(expected[i], plain_run(pipe, dict(requests[i], adapters={}))) > 1e-3
    assert not [r for r in caplog.records if "failed" in r.getMessage() or "packed" in r.getMessage()]
    # a forward held rows of several requests with different adapters, their tokens mapped to rows
    assert max(count for count, mapped in lora_forwards if mapped) >= 3, lora_forwards
    if family == "z-image":  # its own forward joins the rows' tokens: images of other sizes share it as they are
        assert max(sizes[0]) >= 3, sizes[0]
    else:  # a packed forward: one per-row LoRA forward with mapped streams runs only for several shapes
        assert mixed_calls > 0


def _forward_sizes(transformer):
    """Per forward of Z-Image's transformer, how many image sizes its rows have; (list, hook handle)."""
    counts = []

    def hook(_module, args, kwargs):
        images = kwargs.get("x", args[0] if args else None)
        counts.append(len({tuple(image.shape) for image in images}))

    return counts, transformer.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("family", ["kontext", "z-image"])
def test_teacache_sub_batches_keep_each_rows_adapters(family, monkeypatch):
    """A TeaCache forward computes only the rows whose request decided to (a sub-batch): per-row LoRA follows
    them (`adapters.lora.row_subset`), so such calls keep merging, and each request equals itself run alone with
    the same TeaCache config (TeaCache is lossy, but batch-invariant)."""
    from diffusers_stepbatch.adapters.lora import RowPlan
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = lora_pipe(family, PACKED_FAMILIES[family][1][0])
    pipe.set_adapters(*ACTIVE)
    # NOTE: two sizes, two requests each, all with other step counts: merged calls whose rows decide differently
    requests = [dict(kwargs, height=height, width=width, num_inference_steps=steps)
                for kwargs, (height, width), steps in zip(requests_of(family), [(32, 32), (32, 48)] * 2, (6, 7, 8, 9))]
    for kwargs in requests:
        if isinstance(kwargs.get("image"), torch.Tensor):
            kwargs.update(image=kwargs["image"][..., :kwargs["height"], :kwargs["width"]],
                          max_area=kwargs["height"] * kwargs["width"])
    sub_batches = []
    narrowed = RowPlan.narrowed

    def record(plan, rows):
        sub_batches.append((len(rows), plan.num_rows, len({tuple(sorted(w.items())) for w in plan.rows})))
        return narrowed(plan, rows)

    monkeypatch.setattr(RowPlan, "narrowed", record)
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.6, min_steps=3), scheduler=config) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
        with engine_held(sb, dict(requests[0], adapters={}, num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
        splits = sb.stats()["splits"]
    differences = [max_diff(got, want) for got, want in zip(results, solo)]
    assert max(differences) <= TOLERANCE, differences
    assert not [reason for reason in splits if "raised" in reason], splits
    # a merged call of requests with different adapters computed only some of its rows
    assert any(count < rows and distinct > 1 for count, rows, distinct in sub_batches), sub_batches
