"""Video VAE work through the generic program: decodes of requests that finish together run as one call, with
diffusers' tiling too (a decode that would not fit at once), and equal the plain pipeline. Tiny Wan 2.1, and
Qwen-Image's VAE (built on Wan's) for its encodes and decodes."""

import pytest

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import (  # noqa: F401  (single_thread is a fixture)
    TOLERANCE, count_forwards, engine_held, max_diff, seeded, single_thread,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _video(seed: int, frames: int, height: int, width: int) -> dict:
    return dict(prompt=f"a ball {seed}", negative_prompt="blur", num_frames=frames, height=height, width=width,
                num_inference_steps=2, guidance_scale=4.0 + seed, output_type="pt", max_sequence_length=16,
                seed=seed)


@pytest.mark.parametrize("tiling", [False, True])
@pytest.mark.parametrize("frames, height, width", [(5, 32, 48), (9, 48, 32)])
def test_decodes_of_requests_that_finish_together_share_one_call(tiling, frames, height, width):
    pipe = tiny_wan_pipeline(layers=1)
    if tiling:  # tiles of 16 px with overlap: several tiles per frame
        pipe.vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                               tile_sample_stride_width=8)
    requests = [_video(seed, frames, height, width) for seed in range(3)]
    try:
        expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
        decodes, original = [], pipe.vae.decode

        def counting_decode(z, *args, **kwargs):
            decodes.append(z.shape[0])
            return original(z, *args, **kwargs)

        pipe.vae.decode = counting_decode
        try:
            with StepBatched(pipe, max_batch_size=8) as sb:
                with engine_held(sb, dict(_video(9, frames, height, width), num_inference_steps=1)):
                    futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]  # NOTE: all start together
                results = [future.result(timeout=300) for future in futures]
        finally:
            del pipe.vae.decode
    finally:
        pipe.vae.disable_tiling()
    assert max(max_diff(got.frames, want) for got, want in zip(results, expected)) <= TOLERANCE
    # NOTE: the one-step blocker's decode, then one merged decode, no separate check calls: the Wan VAE is trusted
    assert decodes == [1, 3], decodes


@pytest.mark.parametrize("tiling", [False, True])
@pytest.mark.parametrize("side, vae_base_dim", [(32, 8), (48, 4)])
def test_qwenimage_vae_encodes_and_decodes_of_requests_together_are_one_call_each(tiling, side, vae_base_dim):
    import torch
    from diffusers import QwenImageImg2ImgPipeline

    from diffusers_stepbatch.testing import tiny_qwenimage_pipeline

    pipe = QwenImageImg2ImgPipeline(**tiny_qwenimage_pipeline(vae_base_dim=vae_base_dim).components)
    pipe.set_progress_bar_config(disable=True)
    if tiling:
        pipe.vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                               tile_sample_stride_width=8)
    requests = [dict(prompt=f"a shape {seed}", height=side, width=side, strength=0.8,  # the same steps: one end
                     image=torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(seed)),
                     num_inference_steps=3, output_type="pt", max_sequence_length=16, seed=seed)
                for seed in range(3)]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    calls = {"encode": [], "decode": []}
    for name, rows in calls.items():
        original = getattr(pipe.vae, name)
        setattr(pipe.vae, name, lambda x, *args, _call=original, _rows=rows, **kwargs: _rows.append(x.shape[0])
                or _call(x, *args, **kwargs))
    try:
        with StepBatched(pipe, max_batch_size=8) as sb:
            # NOTE: the blocker's prompt is its own: a request whose prompt it shared would find its embeddings
            # cached and reach the VAE a call ahead of the others
            with engine_held(sb, dict(requests[0], prompt="a blocker", seed=9, strength=1.0, num_inference_steps=1)):
                futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]  # NOTE: all start together
            results = [future.result(timeout=300) for future in futures]
    finally:
        del pipe.vae.encode, pipe.vae.decode
    assert max(max_diff(got.images, want) for got, want in zip(results, expected)) <= TOLERANCE
    # NOTE: the one-step blocker's encode and decode, then one merged call each, no separate check calls: the
    # Qwen-Image VAE is trusted
    assert calls == {"encode": [1, 3], "decode": [1, 3]}, calls
