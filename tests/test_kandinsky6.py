"""Kandinsky 6 (`Kandinsky6TI2VAPipeline`) through the generic program and `models/kandinsky6.py`.

Text-to-video and image-to-video requests (other seeds, steps, guidance, frame counts and sizes) share denoiser
forwards and equal their plain runs, video and audio. Image-to-video passes `visual_rope_pos`, one tuple of position
ranges per call: at a 1x1 patch grid (16x16 here) a range is as long as a call's rows, and calls still share it.
"""

import functools

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline,
                       Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder)
from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va
from PIL import Image

from diffusers_stepbatch.testing import tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_qwen2_tokenizer
from diffusers_stepbatch.testing.image_models import tiny_qwen2_vl_processor

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

# name: (transformer width, visual blocks)
CONFIGS = {"tiny": (16, 2), "wide": (32, 1)}
LATENT = 4


def qwen2_5_vl_encoder(tokenizer, hidden: int = 16, seed: int = 1):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@functools.lru_cache(maxsize=None)
def pipe_for(config: str) -> Kandinsky6TI2VAPipeline:
    width, blocks = CONFIGS[config]
    torch.manual_seed(0)
    transformer = Kandinsky6Transformer3DModel(
        in_visual_dim=LATENT, out_visual_dim=LATENT, in_text_dim=16, in_text_dim2=32, time_dim=16,
        patch_size=(1, 2, 2), model_dim=width, ff_dim=32, num_text_blocks=1, num_visual_blocks=blocks,
        axes_dims=(2, 2, 4) if width == 16 else (4, 4, 8), visual_cond=True, in_audio_dim=LATENT,
        out_audio_dim=LATENT, model_dim_a=16, time_dim_a=16, ff_dim_a=32, text_token_padding=True, ca_rope=True,
        cross_gates=True, fix_modulation=True, visual_token_type_num_embeddings=2).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLHunyuanVideo(  # 8x spatial, 4x temporal compression
        in_channels=3, out_channels=3, latent_channels=LATENT, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True).eval()
    torch.manual_seed(3)
    audio_vae = MMAudioVAE(mel_bins=8, latent_channels=LATENT, hidden_channels=8, channel_multipliers=(1, 2),
                           layers_per_block=1, sample_rate=16000, n_fft=128, hop_length=64).eval()
    torch.manual_seed(4)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=16, upsample_rates=(4, 4, 4),
                             upsample_kernel_sizes=(8, 8, 8), resblock_kernel_sizes=(3,),
                             resblock_dilation_sizes=((1, 3),)).eval()
    tokenizer = tiny_qwen2_tokenizer()
    clip_tokenizer = tiny_clip_tokenizer()
    pipe = Kandinsky6TI2VAPipeline(
        transformer=transformer, vae=vae, text_encoder=qwen2_5_vl_encoder(tokenizer),
        tokenizer=tiny_qwen2_vl_processor(tokenizer), text_encoder_2=tiny_clip_text_encoder(clip_tokenizer, layers=2),
        tokenizer_2=clip_tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), audio_vae=audio_vae,
        vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.lru_cache(maxsize=None)
def max_sequence_length() -> int:
    """The pipeline keeps `max_sequence_length` tokens after its template's first 129: here (a token per character)
    the template's tokens before the prompt, less those 129, and room for a short prompt."""
    template = pipeline_kandinsky6_ti2va._PROMPT_TEMPLATE.split("{}")[0]
    return len(tiny_qwen2_tokenizer()(template).input_ids) - pipeline_kandinsky6_ti2va._QWEN_CROP_START + 24


def first_frame(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def video(prompt: str, height: int, width: int, frames: int, steps: int, guidance: float, seed: int,
          image: bool = False) -> dict:
    kwargs = dict(prompt=prompt, negative_prompt="low quality", height=height, width=width, num_frames=frames,
                  num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=max_sequence_length(),
                  output_type="pt", seed=seed)
    if image:
        kwargs["image"] = first_frame(height, width, seed)
    return kwargs


def assert_equal_to_plain(results, expected) -> None:
    for got, want in zip(results, expected):
        assert got.frames.shape == want.frames.shape
        assert max_diff(got.frames, want.frames) <= TOLERANCE
        assert max_diff(got.audio, want.audio) <= TOLERANCE


# name: (height, width, frames of the text-to-video requests, frames of the image-to-video ones)
SIZES = {"tiny": (32, 32, 5, 9), "wide": (48, 32, 9, 5)}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_text_and_image_to_video_requests_share_forwards_and_equal_their_plain_runs(config):
    pipe = pipe_for(config)
    height, width, text_frames, image_frames = SIZES[config]
    requests = [video("a cat bakes", height, width, text_frames, 2, 4.0, seed=0),
                video("a dog runs", height, width, text_frames, 3, 2.5, seed=1),
                video("a cow sings", height, width, image_frames, 2, 4.0, seed=2, image=True),
                video("a fox jumps", height, width, image_frames, 3, 6.0, seed=3, image=True)]
    runs = plain_and_wrapped(pipe, requests)
    assert_equal_to_plain(runs.wrapped, runs.plain)
    assert max(runs.wrapped_rows) >= 2, runs.wrapped_rows  # each call holds one request's branch: 2+ requests
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_image_to_video_at_one_patch_shares_its_position_ranges(config):
    """At 16x16 the height and width position ranges hold one entry, as a one-row call holds one row: they are
    still one tuple for the whole call, equal between requests of one size."""
    pipe = pipe_for(config)
    requests = [video("a cow sings", 16, 16, 5, 2, 4.0, seed=0, image=True),
                video("a fox jumps", 16, 16, 5, 3, 2.0, seed=1, image=True),
                video("a hen naps", 16, 16, 5, 2, 5.0, seed=2, image=True)]
    runs = plain_and_wrapped(pipe, requests)
    assert_equal_to_plain(runs.wrapped, runs.plain)
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
    assert max(runs.wrapped_rows) >= 2, runs.wrapped_rows
    # fewer forwards than plain
    assert len(runs.wrapped_rows) < sum(2 * kwargs["num_inference_steps"] for kwargs in requests)
