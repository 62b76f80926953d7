"""SANA-WM (`SanaWMPipeline`, camera-controlled image-to-video) and its LTX-2 refiner (`SanaWMLTX2Refiner`)
through the generic program.

Stage-1 requests (other seeds, steps, guidance, prompts and camera actions) share forwards and equal their plain runs.
The refiner runs its blocks against a sliding-window KV cache of the request's own earlier blocks; its calls each
take the request's cache, so they run as they come: as many forwards as plain, none predicted as a CFG branch of
another (a stale guess ran as extra rows and raised before branch pairs required the first call's batch input).
"""

import functools

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, SanaWMPipeline, SanaWMTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2RefinerTransformer3DModel
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.sana_wm import SanaWMLTX2Refiner
from PIL import Image

from diffusers_stepbatch.testing.ltx_models import tiny_gemma3_encoder, tiny_gemma_tokenizer

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def ltx2_vae(seed: int) -> AutoencoderKLLTX2Video:
    """An LTX-2 video VAE of spatial and temporal compression 2, 4 latent channels."""
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False).eval()
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return vae


# stage 1, name: (transformer width, layers, a softmax attention layer every n); sizes: (height, width, frames)
SANA_CONFIGS = {"tiny": (32, 2, 2), "wide": (48, 3, 3)}
SANA_SIZES = {"tiny": (16, 16, 5), "wide": (16, 32, 9)}


@functools.lru_cache(maxsize=None)
def sana_pipe(config: str) -> SanaWMPipeline:
    from transformers import Gemma2Config, Gemma2Model

    width, layers, softmax_every_n = SANA_CONFIGS[config]
    tokenizer = tiny_gemma_tokenizer()
    torch.manual_seed(1)
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=8, hidden_size=8, intermediate_size=16, max_position_embeddings=4096, num_attention_heads=2,
        num_hidden_layers=2, num_key_value_heads=1, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager")).eval()
    torch.manual_seed(0)
    transformer = SanaWMTransformer3DModel(
        in_channels=4, num_layers=layers, hidden_size=width, num_attention_heads=2, patch_size=(1, 1, 1),
        softmax_every_n=softmax_every_n, linear_head_dim=width // 2, chunk_plucker_channels=6 * 2,
        chunk_plucker_post_attn_blocks=layers, image_size=32, caption_channels=8, mlp_ratio=2.0).eval()
    pipe = SanaWMPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=ltx2_vae(2), transformer=transformer,
                          scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def camera_video(config: str, prompt: str, action: str, steps: int, guidance: float, seed: int) -> dict:
    height, width, frames = SANA_SIZES[config]
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (24, 20, 3), dtype=np.uint8))
    return dict(image=image, prompt=prompt, action=action, intrinsics=[20.0, 20.0, 10.0, 12.0], height=height,
                width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                negative_prompt="blurry", max_sequence_length=16, output_type="pt", seed=seed)


@pytest.mark.parametrize("config", sorted(SANA_CONFIGS))
def test_camera_video_requests_share_forwards_and_equal_their_plain_runs(config):
    pipe = sana_pipe(config)
    # NOTE: each action has a pose for every frame of both sizes (a shorter one would cut the video)
    requests = [camera_video(config, "a car drives through a desert", "w-8", 2, 4.0, seed=0),
                camera_video(config, "forest", "a-4,jw-4", 3, 3.0, seed=1),
                camera_video(config, "a city at night in the rain", "s-8", 2, 5.5, seed=2),
                camera_video(config, "x", "w-3,jw-3,d-3", 3, 4.0, seed=3)]
    runs = plain_and_wrapped(pipe, requests)
    for got, want in zip(runs.wrapped, runs.plain):
        assert got.frames.shape == want.frames.shape
        assert max_diff(got.frames, want.frames) <= TOLERANCE
    # a request's call holds its two CFG rows: 4+ rows are 2+ requests
    assert max(runs.wrapped_rows) >= 4, runs.wrapped_rows
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]


# refiner, name: (layers, latent frames, latent height and width, frames per block, most frames kept in the cache)
REFINER_CONFIGS = {"tiny": (2, 5, (4, 4), 2, 3), "long": (3, 9, (4, 8), 3, 5)}


@functools.lru_cache(maxsize=None)
def refiner_pipe(config: str) -> SanaWMLTX2Refiner:
    layers = REFINER_CONFIGS[config][0]
    tokenizer = tiny_gemma_tokenizer()
    text_encoder = tiny_gemma3_encoder(tokenizer, seed=1)
    text_config = text_encoder.config.text_config
    torch.manual_seed(0)
    transformer = SanaWMLTX2RefinerTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=layers, qk_norm="rms_norm_across_heads",
        caption_channels=text_config.hidden_size, rope_double_precision=False, rope_type="split",
        vae_scale_factors=(2, 2, 2)).eval()
    torch.manual_seed(2)
    connectors = LTX2TextConnectors(
        caption_channels=text_config.hidden_size, text_proj_in_factor=text_config.num_hidden_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split").eval()
    pipe = SanaWMLTX2Refiner(transformer=transformer, connectors=connectors, tokenizer=tokenizer,
                             text_encoder=text_encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                             vae=ltx2_vae(3), text_max_sequence_length=16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def refinement(config: str, prompt: str, seed: int) -> dict:
    _, frames, latent_hw, block_size, kv_max_frames = REFINER_CONFIGS[config]
    latent = torch.randn((1, 4, frames, *latent_hw), generator=torch.Generator().manual_seed(1000 + seed))
    return dict(sana_latent=latent, prompt=prompt, fps=16.0, block_size=block_size, kv_max_frames=kv_max_frames,
                output_type="pt", seed=seed)


@pytest.mark.parametrize("requests", [1, 3])
@pytest.mark.parametrize("config", sorted(REFINER_CONFIGS))
def test_refiner_requests_run_their_cached_calls_as_plain(config, requests):
    pipe = refiner_pipe(config)
    batch = [refinement(config, prompt, seed) for seed, prompt in
             enumerate(("a car drives through a desert", "a boat at sea", "snow"))][:requests]
    runs = plain_and_wrapped(pipe, batch)
    splits = runs.stats["splits"]
    for got, want in zip(runs.wrapped, runs.plain):
        assert max_diff(got, want) <= TOLERANCE
    assert len(runs.wrapped_rows) == len(runs.plain_rows)  # no predicted branch ran as extra rows
    assert not any("merged call raised" in reason for reason in splits), splits
    if requests > 1:  # each request's calls read and fill its own cache
        assert any("argument kv_cache" in reason for reason in splits), splits
