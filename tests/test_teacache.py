"""TeaCache per request and CFG branch: exact at threshold 0, batch-invariant, skipping more as it grows."""

import math
import warnings

import pytest
import torch

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache import TeaCacheState
from diffusers_stepbatch.models.flux.teacache import FLUX_COEFFICIENTS, flux_teacache_forward
from diffusers_stepbatch.engine.scheduler import SchedulerConfig

from .references import (
    TOLERANCE, assert_polynomial_beats_a_constant, engine_held, flux_pipe, held_out_changes, in_lockstep, max_diff,
    seeded,
)

SIZES = {"dev-tiny": (32, 32), "schnell-tiny": (32, 48), "dev-wide": (24, 40)}


def kwargs_for(name, prompt="a red circle", **overrides):
    height, width = SIZES[name]
    kwargs = dict(prompt=prompt, height=height, width=width, num_inference_steps=12, seed=0, output_type="pt",
                  max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


class BlockPasses:
    """Rows that enter the transformer blocks, and rows in each batched forward, per forward."""

    def __init__(self, transformer):
        self.forwards: list[list[int]] = []
        self._handles = [
            transformer.x_embedder.register_forward_pre_hook(lambda m, a: self.forwards.append([a[0].shape[0], 0])),
            transformer.transformer_blocks[0].register_forward_pre_hook(self._entered, with_kwargs=True),
        ]

    def _entered(self, module, args, kwargs):
        self.forwards[-1][1] += kwargs["hidden_states"].shape[0]

    @property
    def computed(self) -> int:
        return sum(entered for _, entered in self.forwards)

    @property
    def skipped(self) -> int:
        return sum(rows - entered for rows, entered in self.forwards)

    @property
    def mixed(self) -> int:
        """Forwards in which some rows skipped the blocks and others ran them."""
        return sum(0 < entered < rows for rows, entered in self.forwards)

    def remove(self):
        for handle in self._handles:
            handle.remove()


@pytest.mark.parametrize("true_cfg", [False, True])
def test_threshold_zero_equals_no_cache_exactly(flux_name, true_cfg):
    pipe = flux_pipe(flux_name)
    extra = dict(negative_prompt="blurry", true_cfg_scale=2.5) if true_cfg else {}
    kwargs = kwargs_for(flux_name, guidance_scale=4.0, **extra)
    passes = BlockPasses(pipe.transformer)
    try:
        with StepBatched(pipe) as plain, StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.0)) as cached:
            expected = plain(**seeded(kwargs)).images
            got = cached(**seeded(kwargs)).images
    finally:
        passes.remove()
    assert passes.skipped == 0
    assert torch.equal(got, expected)


def test_each_request_decides_for_itself_inside_a_merged_batch():
    """Rows that skip never enter the blocks; the others run them; outputs equal each row's solo forward."""
    pipe = flux_pipe("dev-tiny")
    transformer = pipe.transformer
    generator = torch.Generator().manual_seed(1)

    def inputs(rows, t):
        return dict(
            hidden_states=torch.randn(rows, 16, 16, generator=generator),
            encoder_hidden_states=torch.randn(rows, 5, 32, generator=generator),
            pooled_projections=torch.randn(rows, 32, generator=generator),
            timestep=torch.full([rows], t), guidance=torch.full([rows], 3.5),
            img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), joint_attention_kwargs={},
        )

    def step(states, batch):
        with torch.no_grad():
            return flux_teacache_forward(transformer, states, **batch)

    # Warm two requests up with one computed step each, then give them signals that force opposite decisions.
    skipper, computer = (TeaCacheState(10.0, FLUX_COEFFICIENTS, num_steps=10) for _ in range(2))
    first = inputs(2, 0.9)
    step([skipper, computer], first)
    skipper.step = computer.step = 1
    computer.threshold = 0.0
    second = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    second["timestep"] = torch.full([2], 0.85)
    passes = BlockPasses(transformer)
    try:
        got = step([skipper, computer], second)
    finally:
        passes.remove()
    assert passes.forwards == [[2, 1]]
    assert (skipper.skipped_steps, computer.computed_steps) == (1, 2)
    # The computing row equals a solo forward of that row; the skipping row is its cached residual applied.
    with torch.no_grad():
        solo = transformer(**{k: (v[1:] if isinstance(v, torch.Tensor) and k not in ("img_ids", "txt_ids") else v)
                              for k, v in second.items()}, return_dict=False)[0]
    assert max_diff(got[1:], solo) <= TOLERANCE


def test_output_is_the_same_solo_and_batched():
    pipe = flux_pipe("dev-tiny")
    calls = [
        kwargs_for("dev-tiny", "a red circle", seed=1, num_inference_steps=12),
        kwargs_for("dev-tiny", "a blue square", seed=2, num_inference_steps=16, guidance_scale=7.0,
                   negative_prompt="noise", true_cfg_scale=2.0),
        kwargs_for("dev-tiny", "a cat", seed=3, num_inference_steps=10, num_images_per_prompt=2,
                   teacache=TeaCacheConfig(threshold=0.25)),
        kwargs_for("dev-tiny", "a white cross", seed=4, num_inference_steps=14, teacache=None),
        kwargs_for("dev-tiny", "a yellow dot", seed=5, num_inference_steps=12,
                   teacache=TeaCacheConfig(threshold=1.0)),
    ]
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    teacache = TeaCacheConfig(threshold=0.5)
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in calls]
    passes = BlockPasses(pipe.transformer)
    try:
        batched = in_lockstep(StepBatched(pipe, teacache=teacache, scheduler=config), calls)
    finally:
        passes.remove()
    assert passes.mixed > 0, "no forward mixed skipping and computing rows: the test proves nothing"
    assert passes.skipped > 0
    for got, want in zip(batched, solo):
        assert max_diff(got, want) <= TOLERANCE


def test_skipped_block_passes_grow_with_the_threshold():
    pipe = flux_pipe("dev-tiny")
    kwargs = kwargs_for("dev-tiny", num_inference_steps=28, negative_prompt="noise", true_cfg_scale=2.0)
    skipped = []
    with StepBatched(pipe) as sb:
        for threshold in (0.0, 0.2, 0.4, 0.6, 0.8):
            passes = BlockPasses(pipe.transformer)
            try:
                sb(**seeded(kwargs), teacache=TeaCacheConfig(threshold=threshold))
            finally:
                passes.remove()
            assert passes.computed + passes.skipped == 2 * 28  # two CFG branches
            skipped.append(passes.skipped)
    assert skipped[0] == 0
    assert all(a <= b for a, b in zip(skipped, skipped[1:])), skipped
    assert skipped[-1] > skipped[1] > 0, skipped


def test_first_and_last_steps_always_compute():
    pipe = flux_pipe("schnell-tiny")
    passes = BlockPasses(pipe.transformer)
    try:
        with StepBatched(pipe, teacache=TeaCacheConfig(threshold=100.0)) as sb:
            sb(**seeded(kwargs_for("schnell-tiny", num_inference_steps=10)))
    finally:
        passes.remove()
    assert [entered for _, entered in passes.forwards] == [1] + [0] * 8 + [1]


def test_few_step_requests_run_without_teacache_and_warn_once():
    pipe = flux_pipe("schnell-tiny")
    config = TeaCacheConfig(threshold=0.8)
    kwargs = kwargs_for("schnell-tiny", num_inference_steps=4)
    with StepBatched(pipe) as plain:
        expected = plain(**seeded(kwargs)).images
    with StepBatched(pipe, teacache=config) as sb, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = sb(**seeded(kwargs)).images
        second = sb(**seeded(kwargs)).images
    messages = [str(w.message) for w in caught if "TeaCache is off" in str(w.message)]
    assert len(messages) == 1 and "num_inference_steps=4" in messages[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_per_request_override():
    pipe = flux_pipe("dev-tiny")
    kwargs = kwargs_for("dev-tiny", num_inference_steps=16)
    with StepBatched(pipe) as plain:
        exact = plain(**seeded(kwargs)).images
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.8)) as sb:
        engine_default = sb(**seeded(kwargs)).images
        off = sb(**seeded(kwargs), teacache=None).images
        zero = sb(**seeded(kwargs), teacache=TeaCacheConfig(threshold=0.0)).images
        with pytest.raises(ValueError, match="teacache=0.4"):
            sb(**seeded(kwargs), teacache=0.4)
    assert torch.equal(off, exact) and torch.equal(zero, exact)
    assert not torch.equal(engine_default, exact) and max_diff(engine_default, exact) < 0.05


@pytest.mark.parametrize("bad, match", [
    (dict(threshold=-0.1), "threshold=-0.1"),
    (dict(threshold="0.4"), "threshold='0.4'"),
    (dict(min_steps=2), "min_steps=2"),
    (dict(coefficients=()), "coefficients"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        TeaCacheConfig(**bad)


def test_fitted_coefficients_explain_the_output_change():
    from diffusers_stepbatch.cache.teacache_fit import fit_coefficients

    pipe = flux_pipe("dev-tiny")
    call = dict(height=32, width=32, num_inference_steps=12, max_sequence_length=16, output_type="latent",
                negative_prompt="noise", true_cfg_scale=2.0)
    coefficients = fit_coefficients(pipe, ["a red circle", "a blue square"], degree=2, **call)
    assert len(coefficients) == 3 and all(map(math.isfinite, coefficients))
    # On a prompt it was not fitted on, the polynomial predicts the output change better than a constant.
    assert_polynomial_beats_a_constant(coefficients, *held_out_changes(pipe, "a yellow cross", **call))
    with pytest.raises(ValueError, match="cannot fit a degree-4"):
        fit_coefficients(pipe, ["x"], **dict(call, num_inference_steps=2))


def test_teacache_on_a_family_without_it_is_an_error():
    from diffusers_stepbatch.testing import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline()
    message = (r"teacache= is not supported for StableDiffusion3Pipeline; supported: \[.FluxPipeline., "
               r".QwenImagePipeline.\] and")
    with pytest.raises(ValueError, match=message):
        StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4))
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match="teacache= is not supported"):
        sb.submit("a cat", height=32, width=32, num_inference_steps=12, teacache=TeaCacheConfig(threshold=0.4))


@pytest.mark.parametrize("program", ["generic", "dedicated"])
@pytest.mark.parametrize("fail_at_call", [3, 6])
def test_a_failed_packed_call_leaves_teacache_states_as_before_its_retry(program, fail_at_call, monkeypatch, caplog):
    """A packed call that raises after its TeaCache forward committed is retried one shape at a time: the retry
    must decide from the memory the failed attempt started with, so each request still equals its solo run.
    `generic`: FLUX.1 Kontext through the generic program; `dedicated`: FluxPipeline through its own program."""
    import dataclasses

    from diffusers import FluxKontextPipeline

    from diffusers_stepbatch import models
    from diffusers_stepbatch.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(guidance_embeds=True)
    if program == "generic":
        pipe = FluxKontextPipeline(**pipe.components)
    pipe.set_progress_bar_config(disable=True)
    packed_calls = []

    def failing_once(run):
        def wrapped(*args, **kwargs):
            outputs = run(*args, **kwargs)  # its TeaCache states commit here
            packed_calls.append(1)
            if len(packed_calls) == fail_at_call:
                raise RuntimeError("a packed call failed after its forward")
            return outputs
        return wrapped

    # NOTE: both programs run packed calls through the model's support (models/denoiser_calls.py)
    support = models.support_for(pipe.transformer)
    packing = dataclasses.replace(support.packing, run=failing_once(support.packing.run))
    monkeypatch.setitem(models._SUPPORT, type(pipe.transformer), dataclasses.replace(support, packing=packing))
    requests = [dict(prompt=f"a shape {i}", height=h, width=w, num_inference_steps=steps, max_sequence_length=16,
                     guidance_scale=3.5, output_type="pt", seed=i)
                for i, ((h, w), steps) in enumerate(zip([(32, 32), (32, 48), (48, 32)], (8, 9, 10)))]
    if program == "generic":
        for i, kwargs in enumerate(requests):
            kwargs.update(image=torch.rand(1, 3, kwargs["height"], kwargs["width"],
                                           generator=torch.Generator().manual_seed(i)),
                          _auto_resize=False, max_area=kwargs["height"] * kwargs["width"])
    plain = [pipe(**seeded(kwargs)).images for kwargs in requests]
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.6, min_steps=3), scheduler=config) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
        packed_calls.clear()
        with engine_held(sb, dict(requests[0], num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
    assert len(packed_calls) >= fail_at_call  # the failure happened, after a committed packed forward
    assert any("failed" in record.getMessage() for record in caplog.records)
    for got, want, exact in zip(results, solo, plain):
        assert max_diff(got, want) <= TOLERANCE
        assert max_diff(want, exact) > 1e-3  # TeaCache skipped steps


@pytest.mark.parametrize("program", ["generic", "dedicated"])
def test_requests_without_teacache_of_different_sizes_share_a_packed_teacache_forward(program, caplog):
    """Rows without TeaCache state compute; consecutive such rows of different sizes must not be read as one
    request's rows (they have no common token range)."""
    from diffusers import FluxKontextPipeline

    from diffusers_stepbatch.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(guidance_embeds=True)
    if program == "generic":
        pipe = FluxKontextPipeline(**pipe.components)
    pipe.set_progress_bar_config(disable=True)
    sizes, steps = [(48, 48), (32, 32), (32, 48), (48, 32)], [8, 8, 9, 10]
    requests = [dict(prompt=f"a shape {i}", height=h, width=w, num_inference_steps=n, max_sequence_length=16,
                     guidance_scale=3.5, output_type="pt", seed=i) for i, ((h, w), n) in enumerate(zip(sizes, steps))]
    if program == "generic":
        for i, kwargs in enumerate(requests):
            kwargs.update(image=torch.rand(1, 3, kwargs["height"], kwargs["width"],
                                           generator=torch.Generator().manual_seed(i)),
                          _auto_resize=False, max_area=kwargs["height"] * kwargs["width"])
    for kwargs in requests[:3]:  # three sizes without TeaCache, next to each other in the packed layout
        kwargs["teacache"] = None
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    caplog.set_level("WARNING")
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.6, min_steps=3), scheduler=config) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
        with engine_held(sb, dict(requests[3], num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(300).images for future in futures]
        mixed_calls = sb.stats()["mixed"]["calls"]
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert mixed_calls > 0
    for got, want in zip(results, solo):
        assert max_diff(got, want) <= TOLERANCE
