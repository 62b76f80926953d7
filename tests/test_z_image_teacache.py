"""Z-Image TeaCache per request: the same skips in shared forwards as alone (`models/z_image/teacache.py`).

Z-Image calls take one list entry per image and pad them, so requests of different sizes share forwards; each
request's TeaCache state decides for its own rows (both CFG rows of its one call), on its own tokens only.
"""

import pytest
import torch

from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.cache.teacache_fit import fit_coefficients
from diffusers_stepbatch.models.z_image.teacache import signal_hook, teacache_call
from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    assert_polynomial_beats_a_constant, assert_teacache_shared_equals_alone, held_out_changes, max_diff, single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")
COMMON = dict(output_type="pt", max_sequence_length=16)


def test_teacache_forward_with_every_row_computing_is_the_model_forward():
    model = tiny_z_image_pipeline().transformer
    generator = torch.Generator().manual_seed(0)
    x = [torch.randn(16, 1, h, w, generator=generator) for h, w in [(4, 4), (4, 8), (8, 4)]]
    cap_feats = [torch.randn(n, 16, generator=generator) for n in (5, 40, 12)]
    t = torch.rand(3, generator=generator)
    with torch.no_grad():
        own = model(x, t, cap_feats, return_dict=False)[0]
        got = teacache_call(model, [None] * 3, dict(x=x, t=t, cap_feats=cap_feats, return_dict=False))[0]
    assert max(max_diff(a, b) for a, b in zip(got, own)) == 0.0
    # omni calls (nested lists) and ControlNet residuals compute as the model does
    assert teacache_call(model, [None], dict(x=[x[:1]], t=t[:1], cap_feats=[cap_feats[:1]])) is None
    assert teacache_call(model, [None], dict(x=x[:1], t=t[:1], cap_feats=cap_feats[:1],
                                             controlnet_block_samples={0: torch.zeros(1)})) is None


def test_teacache_in_shared_forwards_equals_teacache_alone():
    pipe = tiny_z_image_pipeline()
    requests = [
        dict(prompt="a cat", height=32, width=32, num_inference_steps=12, guidance_scale=3.0, negative_prompt="bad",
             seed=0, **COMMON),
        dict(prompt="a dog runs fast", height=32, width=64, num_inference_steps=14, guidance_scale=0.0, seed=1,
             **COMMON),
        # CFG ends half-way: the request's rows change, and that step computes
        dict(prompt="x", height=64, width=32, num_inference_steps=13, guidance_scale=2.0, negative_prompt="ugly",
             cfg_truncation=0.5, seed=2, **COMMON),
        dict(prompt="a red bird", height=48, width=48, num_inference_steps=12, guidance_scale=4.0,
             negative_prompt="", seed=3, teacache=None, **COMMON),  # computes every step, beside the others
    ]
    blocker = dict(prompt="a blocker", height=32, width=32, num_inference_steps=1, **COMMON)
    stats = assert_teacache_shared_equals_alone(pipe, requests, TeaCacheConfig(threshold=0.5), blocker)
    rows = stats["rows_histogram"]["denoise"]
    assert max(rows) > 2, rows  # a forward held rows of several requests


def test_fitted_coefficients_explain_the_output_change():
    pipe = tiny_z_image_pipeline()
    call = dict(height=32, width=32, num_inference_steps=12, guidance_scale=3.0, negative_prompt="bad",
                output_type="latent", max_sequence_length=16)
    coefficients = fit_coefficients(pipe, ["a red circle", "a blue square"], degree=2, signal=signal_hook, **call)
    assert_polynomial_beats_a_constant(coefficients, *held_out_changes(pipe, "a yellow cross", signal_hook, **call))
