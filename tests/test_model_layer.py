"""The model layer through the generic program: rows by denoiser class, never a silently wrong output.

Z-Image's per-image lists share forwards across sizes; FLUX.2's position ids are read from row 0, so requests
of equal token count but another aspect ratio must not merge in a plain forward (they pack); PAG runs whole
calls; FLUX.2 klein KV and LTX latent upsampling run wrapped as they run plain; a model without proven row rules
that mixes rows is caught by the check of its first merged call.
"""

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models import DEFAULT_SUPPORT, support_for
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_z_image_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, ToyLoopPipeline, count_forwards, max_diff, seeded, single_thread, submit_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _run(pipe, requests, denoiser, max_batch_size=16):
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    calls, hook = count_forwards(denoiser)
    try:
        with StepBatched(pipe, max_batch_size=max_batch_size) as sb:
            results = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        hook.remove()
    differences = [max_diff(got.images, want) for got, want in zip(results, expected)]
    return differences, calls, stats


Z_IMAGE_CONFIGS = {"tiny": {}, "wide": dict(dim=48, heads=3, axes_dims=(8, 4, 4)),
                   "rope": dict(dim=32, heads=2, axes_dims=(4, 6, 6)), "quarter-vae": dict(vae_blocks=3)}


@pytest.mark.parametrize("config", sorted(Z_IMAGE_CONFIGS))
def test_z_image_requests_of_different_sizes_share_forwards(config):
    pipe = tiny_z_image_pipeline(**Z_IMAGE_CONFIGS[config])
    common = dict(output_type="pt", max_sequence_length=16)
    requests = [
        dict(prompt="a cat", height=32, width=32, num_inference_steps=2, guidance_scale=3.0, negative_prompt="bad",
             seed=0, **common),
        dict(prompt="a dog runs fast", height=32, width=64, num_inference_steps=3, guidance_scale=0.0, seed=1,
             **common),
        dict(prompt="x", height=64, width=32, num_inference_steps=2, guidance_scale=2.0, negative_prompt="ugly",
             cfg_normalization=True, seed=2, **common),
        dict(prompt="a red bird", height=48, width=48, num_inference_steps=4, guidance_scale=4.0, cfg_truncation=0.5,
             negative_prompt="", seed=3, **common),
    ]
    differences, calls, stats = _run(pipe, requests, pipe.transformer)
    assert max(differences) <= TOLERANCE, differences
    assert max(calls) >= 4, f"no forward held rows of several sizes: {calls}"
    assert not any("alone" in reason for reason in stats["splits"])


@pytest.mark.parametrize("heads, head_dim, axes", [(2, 16, (4, 4, 4, 4)), (4, 8, (2, 2, 2, 2))])
def test_flux2_aspect_ratios_of_equal_token_count_never_merge_wrongly(heads, head_dim, axes):
    pipe = tiny_flux2_klein_pipeline(heads=heads, head_dim=head_dim, axes_dims=axes)
    common = dict(output_type="pt", text_encoder_out_layers=(1,), max_sequence_length=32, guidance_scale=1.0)
    requests = [dict(prompt="a cat", height=32, width=64, num_inference_steps=2, seed=0, **common),
                dict(prompt="a dog", height=64, width=32, num_inference_steps=2, seed=1, **common),
                dict(prompt="a bird", height=64, width=32, num_inference_steps=3, seed=2, **common)]
    differences, calls, stats = _run(pipe, requests, pipe.transformer)
    assert max(differences) <= TOLERANCE, differences
    # NOTE: packed calls (models/flux2/packing.py) drive the submodules, so `calls` counts plain forwards only: one
    # never holds the 32x64 request's rows beside the 64x32 ones, which share packed calls with it instead
    assert max(calls, default=0) <= 2 and stats["mixed"]["calls"] > 0, (calls, stats["mixed"])


def test_flux2_klein_kv_runs_wrapped_as_plain():
    from diffusers import Flux2KleinKVPipeline

    pipe = tiny_flux2_klein_pipeline(pipeline_class=Flux2KleinKVPipeline)
    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    common = dict(height=32, width=32, output_type="pt", text_encoder_out_layers=(1,), max_sequence_length=32)
    requests = [dict(prompt="a cat", image=image, num_inference_steps=3, seed=0, **common),
                dict(prompt="a dog", num_inference_steps=2, seed=1, **common),
                dict(prompt="a b", image=[image, image.resize((64, 96))], num_inference_steps=2, seed=2, **common)]
    differences, _, _ = _run(pipe, requests, pipe.transformer)
    assert max(differences) <= TOLERANCE, differences  # (their caches' row rules: tests/test_row_states.py)


def test_pag_pipelines_run_whole_calls_with_the_reason():
    from diffusers import StableDiffusionPAGPipeline

    from diffusers_stepbatch.testing import tiny_sd_pipeline

    base = tiny_sd_pipeline()
    pipe = StableDiffusionPAGPipeline(**base.components, pag_applied_layers=["mid"])
    pipe.set_progress_bar_config(disable=True)
    requests = [dict(prompt=f"p{i}", height=32, width=32, num_inference_steps=2 + i % 2, guidance_scale=2.0 + i,
                     pag_scale=1.0 + i, seed=i, output_type="pt") for i in range(3)]
    requests.append(dict(requests[0], pag_scale=0.0, seed=7))  # without PAG: an ordinary batched request
    differences, calls, stats = _run(pipe, requests, pipe.unet)
    assert max(differences) <= TOLERANCE, differences
    assert any("perturbed-attention guidance" in reason for reason in stats["splits"])


def test_ltx_latent_upsampling_runs_wrapped_as_plain():
    from diffusers import AutoencoderKLLTXVideo, LTXLatentUpsamplePipeline
    from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8,) * 4,
        decoder_block_out_channels=(8,) * 4, layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    upsampler = LTXLatentUpsamplerModel(in_channels=8, mid_channels=32, num_blocks_per_stage=1, dims=3,
                                        spatial_upsample=True, temporal_upsample=False)
    pipe = LTXLatentUpsamplePipeline(vae=vae, latent_upsampler=upsampler)
    videos = [torch.randn((frames, 3, 32, 32), generator=torch.Generator().manual_seed(frames)) for frames in (5, 9)]
    requests = [dict(video=video, height=16, width=16, output_type="pt", seed=i) for i, video in enumerate(videos)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
    assert all(max_diff(r.frames, e) <= TOLERANCE for r, e in zip(results, expected))


class _BatchMixing(torch.nn.Module):
    """A denoiser whose rows are not independent (it subtracts the batch mean): merging changes its outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, timestep):
        out = self.linear(hidden_states) * timestep[:, None]
        return out - out.mean(dim=0, keepdim=True) + 0.5 * out


@pytest.mark.parametrize("steps", [1, 3])
def test_unproven_models_that_mix_rows_are_caught_and_run_alone(caplog, steps, monkeypatch):
    """Also with one step: the merged call that is caught says why in `splits`, not only the later ones."""
    from diffusers import DDIMScheduler

    from diffusers_stepbatch.models import merge_checks

    monkeypatch.setattr(merge_checks, "_logged", set())  # NOTE: each reason is logged once per process

    pipe = ToyLoopPipeline(_BatchMixing(), DDIMScheduler(timestep_spacing="trailing"))  # one step: t=999, not 0
    assert support_for(pipe.unet) is DEFAULT_SUPPORT
    requests = [dict(batch_size=2, num_inference_steps=steps, seed=i) for i in range(4)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with caplog.at_level(logging.INFO), StepBatched(pipe) as sb:
        results = submit_all(sb, requests)
        stats = sb.stats()
    assert all(max_diff(r, e) <= TOLERANCE for r, e in zip(results, expected))
    assert "differed from separate calls" in caplog.text
    assert any("differed from separate calls" in reason for reason in stats["splits"])


def test_what_merged_calls_showed_goes_with_the_model_not_its_address():
    """A model freed takes its record along: one made later at its address is checked afresh, not trusted or
    refused by what another model showed."""
    import gc

    from diffusers import DDIMScheduler

    from diffusers_stepbatch.models import merge_checks

    pipe = ToyLoopPipeline(_BatchMixing(), DDIMScheduler(timestep_spacing="trailing"))
    requests = [dict(batch_size=2, num_inference_steps=2, seed=i) for i in range(3)]
    with StepBatched(pipe) as sb:
        submit_all(sb, requests)
    record = merge_checks._row_records.get(pipe.unet)
    assert record is not None and record.not_rowwise and record.methods_not_rowwise == {"forward"}
    gc.collect()  # NOTE: earlier tests' models, so that only this one goes below
    held = len(merge_checks._row_records)
    del pipe, sb, record
    gc.collect()
    assert len(merge_checks._row_records) == held - 1


def test_per_request_lora_on_a_model_without_row_mapped_layers_is_refused_in_the_caller():
    from diffusers_stepbatch.testing import tiny_pixart_or_sana_pipeline

    pipe = tiny_pixart_or_sana_pipeline()  # NOTE: PixArt's model has no model-layer module (no lora_rows)
    with StepBatched(pipe) as sb:
        with pytest.raises(ValueError, match="adapters= is not supported for PixArtTransformer2DModel"):
            sb.submit(prompt="a cat", height=32, width=32, num_inference_steps=2, use_resolution_binning=False,
                      clean_caption=False, adapters={"a": 1.0})
        assert sb.stats()["waiting"] == 0 and sb.stats()["running"] == 0
