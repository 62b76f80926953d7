"""diffusers' cache hooks on the denoiser (`transformer.enable_cache(...)`) with StepBatched: each request's
forwards run alone, one per CFG branch, in its own cache contexts, so every output equals the plain pipeline's
with the same hooks, alone and with concurrent requests. PyramidAttentionBroadcast and FasterCache read the
request's timestep through `current_timestep_callback`, from the plain pipe or from the wrapper."""

import pytest
import torch
from diffusers import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)

from diffusers_stepbatch import StepBatched, disable_step_batching, enable_step_batching
from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline, tiny_qwenimage_pipeline

from .dropin_helpers import run
from .references import TOLERANCE, count_forwards, max_diff, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def configs(timestep):
    """Each hook as diffusers' own pipeline tests configure it; `timestep()` is the current timestep."""
    return {
        "first-block": FirstBlockCacheConfig(threshold=0.8),
        "taylorseer": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1,
                                            taylor_factors_dtype=torch.float32),
        "magcache": MagCacheConfig(threshold=0.5, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=4,
                                   mag_ratios=torch.ones(4)),
        "pab": PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(-1, 1001),
                                               spatial_attention_block_identifiers=["transformer_blocks"],
                                               current_timestep_callback=timestep),
        "fastercache": FasterCacheConfig(spatial_attention_block_skip_range=2,
                                         spatial_attention_timestep_skip_range=(-1, 901),
                                         unconditional_batch_skip_range=2, attention_weight_callback=lambda _: 0.5,
                                         is_guidance_distilled=True, current_timestep_callback=timestep),
    }


def build(family):
    if family == "flux":
        pipe = tiny_flux_pipeline(guidance_embeds=True, size=FluxSize(num_layers=2, num_single_layers=2))
    else:
        pipe = tiny_qwenimage_pipeline(num_layers=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def requests(hook):
    base = dict(prompt="a red circle", height=32, width=32, num_inference_steps=4, output_type="pt")
    steps = 4 if hook == "magcache" else 6  # MagCache's ratios are calibrated for one step count
    return [dict(base, seed=0),
            dict(base, prompt="a blue square", seed=1, num_inference_steps=steps),
            # NOTE: as long as the prompt: PAB and FasterCache reuse attention outputs across the CFG branches
            dict(base, seed=2, negative_prompt="a red square", true_cfg_scale=2.0)]


@pytest.mark.parametrize("family", ["flux", "qwen"])
@pytest.mark.parametrize("hook", ["first-block", "taylorseer", "magcache", "pab", "fastercache"])
def test_cache_hooks_equal_the_plain_pipeline(family, hook):
    pipe = build(family)
    source = {"pipe": pipe}
    pipe.transformer.enable_cache(configs(lambda: source["pipe"].current_timestep)[hook])
    calls = requests(hook)
    uncached = build(family)
    expected = [run(pipe, kwargs) for kwargs in calls]
    # the hook changes the output (so equality below means the hook ran as in the plain pipeline)
    assert max(max_diff(e, run(uncached, kwargs)) for e, kwargs in zip(expected, calls)) > 2 * TOLERANCE
    for reader in ("pipe", "wrapper"):
        with StepBatched(pipe) as sb:
            if reader == "wrapper":
                source["pipe"] = sb  # diffusers' documented usage: lambda: pipe.current_timestep on what you call
            assert max_diff(run(sb, calls[2]), expected[2]) <= TOLERANCE
            sizes, handle = count_forwards(pipe.transformer)
            futures = [sb.submit(**seeded(kwargs)) for kwargs in calls]
            got = [future.result(timeout=300).images for future in futures]
            handle.remove()
        for kwargs, image, want in zip(calls, got, expected):
            assert max_diff(image, want) <= TOLERANCE, (reader, kwargs)
        assert max(sizes) == 1  # one request and one branch per forward, as the plain pipeline runs them
    assert source["pipe"] is not pipe


@pytest.mark.parametrize("mode", ["wrapped", "hook"])
def test_generic_program_hooks_read_the_requests_timestep_through_the_wrapper(mode):
    """The generic program runs a hooked pipeline's whole call alone; PAB's callback reads `sb.current_timestep`
    (a FluxPipeline subclass with its own __call__, as FluxKontextPipeline: served by the generic program); in
    hook mode it reads `pipe.current_timestep` of the pipeline itself."""
    from diffusers import FluxPipeline

    from diffusers_stepbatch.programs import generic, program_for

    class OwnCallFlux(FluxPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    pipe = OwnCallFlux(**build("flux").components)
    pipe.set_progress_bar_config(disable=True)
    assert program_for(pipe) is generic.plan_generic
    source = {"pipe": pipe}
    pipe.transformer.enable_cache(configs(lambda: source["pipe"].current_timestep)["pab"])
    kwargs = requests("pab")[0]
    expected = [run(pipe, kwargs), run(pipe, dict(kwargs, seed=1))]
    if mode == "hook":
        sb = enable_step_batching(pipe)
        try:
            got = [future.result(timeout=300).images for future in
                   [sb.submit(**seeded(kwargs)), sb.submit(**seeded(dict(kwargs, seed=1)))]]
            got[0] = run(pipe, kwargs)  # and a plain call of the hooked pipeline
        finally:
            disable_step_batching(pipe)
    else:
        with StepBatched(pipe) as sb:
            source["pipe"] = sb
            got = [future.result(timeout=300).images for future in
                   [sb.submit(**seeded(kwargs)), sb.submit(**seeded(dict(kwargs, seed=1)))]]
    assert max_diff(got[0], expected[0]) <= TOLERANCE and max_diff(got[1], expected[1]) <= TOLERANCE
