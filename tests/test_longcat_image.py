"""LongCat-Image (`LongCatImagePipeline`, `LongCatImageEditPipeline`) through the generic program and
`models/longcat_image.py`.

The transformer reads its position ids (`img_ids`, `txt_ids`: `[tokens, 3]`) once per call, so they are shared, not
rows: requests of one image size share forwards whatever their prompts, steps, seeds and guidance, and a 1-token
image (whose `img_ids` has as many entries as a 1-row call has rows) merges too.
"""

import functools

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, LongCatImageEditPipeline, LongCatImagePipeline,
                       LongCatImageTransformer2DModel)
from PIL import Image

from diffusers_stepbatch.testing import tiny_qwenimage_pipeline
from diffusers_stepbatch.testing.image_models import tiny_qwen2_vl_processor

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    # name: (transformer config, VAE blocks (scale 2 ** (blocks - 1)), (height, width) of the shared size)
    "tiny": (dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                  axes_dims_rope=[4, 6, 6]), 2, (16, 16)),
    "wide": (dict(num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=3,
                  axes_dims_rope=[2, 2, 4]), 3, (32, 48)),
}


def tiny_vae(blocks: int) -> AutoencoderKL:
    torch.manual_seed(2)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * blocks,
                         up_block_types=["UpDecoderBlock2D"] * blocks, block_out_channels=[4] * blocks,
                         layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=32,
                         scaling_factor=0.3611, shift_factor=0.1159).eval()


@functools.lru_cache(maxsize=None)
def pipe_for(config: str, edit: bool = False, vae_blocks: int | None = None):
    """The tiny Qwen2.5-VL text encoder and byte-level tokenizer of `tiny_qwenimage_pipeline`, a local processor, a
    LongCat transformer and a 16-channel AutoencoderKL; the pipelines' own system prompts (text padded to 512)."""
    transformer_config, blocks, _ = CONFIGS[config]
    base = tiny_qwenimage_pipeline(text_hidden=32, vae_base_dim=4)
    torch.manual_seed(0)
    transformer = LongCatImageTransformer2DModel(patch_size=1, in_channels=64, joint_attention_dim=32,
                                                 pooled_projection_dim=32, **transformer_config).eval()
    cls = LongCatImageEditPipeline if edit else LongCatImagePipeline
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(vae_blocks or blocks),
               text_encoder=base.text_encoder, tokenizer=base.tokenizer,
               text_processor=tiny_qwen2_vl_processor(base.tokenizer), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def requests(height: int, width: int) -> list[dict]:
    common = dict(height=height, width=width, enable_prompt_rewrite=False, output_type="np")
    return [dict(common, prompt="a red cat", negative_prompt="blurry", num_inference_steps=2, guidance_scale=4.5,
                 seed=0),
            dict(common, prompt="a sign that says \"hi\"", num_inference_steps=3, guidance_scale=3.0, seed=1),
            dict(common, prompt="a blue dog on grass", num_inference_steps=2, guidance_scale=1.0, seed=2),
            dict(common, prompt="a cow", negative_prompt="dark", num_inference_steps=3, guidance_scale=5.0,
                 enable_cfg_renorm=False, seed=3)]


def assert_shared(sizes: list[int], plain_sizes: list[int]) -> None:
    assert len(sizes) < len(plain_sizes) and max(sizes) > 1, sizes
    assert sum(sizes) == sum(plain_sizes)  # each row ran once: trusted, no merge is checked against calls apart


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_concurrent_requests_equal_their_plain_runs_and_share_forwards(config):
    height, width = CONFIGS[config][2]
    batch = requests(height, width) + [dict(requests(height, width)[0], height=2 * height, seed=4)]
    runs = plain_and_wrapped(pipe_for(config), batch)
    for kwargs, result, plain in zip(batch, runs.wrapped, runs.plain):
        assert result.images.shape == plain.images.shape
        assert max_diff(result.images, plain.images) <= TOLERANCE, kwargs
    assert_shared(runs.wrapped_rows, runs.plain_rows)
    assert any("argument img_ids" in reason for reason in runs.stats["splits"])  # the other size keeps its calls apart
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_one_token_images_merge_with_their_ids_shared(config):
    """A 1-token image's `img_ids` ([1, 3]) has a 1-row call's rows on dim 0, yet is read once for the call."""
    side = 2 ** (CONFIGS[config][1] - 1) * 2  # one 2x2 latent patch
    batch = [dict(kwargs, height=side, width=side) for kwargs in requests(side, side)]
    runs = plain_and_wrapped(pipe_for(config), batch)
    for kwargs, result, plain in zip(batch, runs.wrapped, runs.plain):
        assert result.images.shape == plain.images.shape == (1, side, side, 3)
        assert max_diff(result.images, plain.images) <= TOLERANCE, kwargs
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
    assert_shared(runs.wrapped_rows, runs.plain_rows)


def edit_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_edit_requests_with_one_image_size_share_forwards(config):
    """The edit pipeline resizes every image to ~1024x1024 px: a VAE of scale 64 (4 channels) keeps that at 8x8
    tokens, plus as many reference tokens."""
    pipe = pipe_for(config, edit=True, vae_blocks=7)
    common = dict(output_type="np")
    batch = [dict(common, image=edit_image(32, 32, 0), prompt="make it blue", negative_prompt="blurry",
                  num_inference_steps=2, guidance_scale=4.5, seed=0),
             dict(common, image=edit_image(32, 32, 1), prompt="add a hat", num_inference_steps=3, guidance_scale=3.0,
                  seed=1),
             dict(common, image=edit_image(48, 48, 2), prompt="make it red", num_inference_steps=2,
                  guidance_scale=1.0, seed=2)]
    runs = plain_and_wrapped(pipe, batch)
    for kwargs, result, plain in zip(batch, runs.wrapped, runs.plain):
        assert result.images.shape == plain.images.shape
        assert max_diff(result.images, plain.images) <= TOLERANCE, kwargs["prompt"]
    assert_shared(runs.wrapped_rows, runs.plain_rows)
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
