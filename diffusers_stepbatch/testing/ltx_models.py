"""Tiny offline LTX-2 pipelines (video + audio), for tests and benchmarks.

Built from configs, seeded: a tiny Gemma 3 text encoder with a local character-level Gemma tokenizer, the text
connectors, an LTX-2 transformer, the video and audio VAEs and the vocoder. Heights and widths are multiples of
32 here (the video VAE's spatial compression), frame counts 4k + 1 (its temporal compression).

>>> pipe = tiny_ltx2_pipeline()
>>> out = pipe("a robot", height=32, width=64, num_frames=9, num_inference_steps=2, output_type="pt", **LTX2_PLAIN)
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

# NOTE: the pipeline's defaults switch on STG, modality guidance and rescaling (LTX-2.3 sampling); these keep
# plain (optionally CFG-guided) sampling, as diffusers' own tests do.
LTX2_PLAIN = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0,
                  audio_modality_scale=1.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
                  max_sequence_length=16)


@dataclass(frozen=True)
class LTX2Size:
    """The transformer's shape and options (the rest of the pipeline is fixed)."""

    heads: int = 2
    head_dim: int = 8
    audio_heads: int = 2
    audio_head_dim: int = 4
    layers: int = 2
    rope_type: str = "split"
    gated_attn: bool = False
    cross_attn_mod: bool = False  # LTX-2.3's prompt (and query) modulation by the timestep


def tiny_gemma_tokenizer():
    """A Gemma tokenizer with no merges over ASCII letters, digits and punctuation: one token per character."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    pieces = specials + list(string.ascii_letters + string.digits + string.punctuation) + ["\u2581"]
    return GemmaTokenizer(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[])


def tiny_gemma3_encoder(tokenizer, hidden: int = 32, layers: int = 2, seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=8,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=2, eoi_token_index=1, image_token_index=4,
    )
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2_transformer(size: LTX2Size = LTX2Size(), caption_channels: int = 32, seed: int = 0):
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    return LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=size.heads,
        attention_head_dim=size.head_dim, cross_attention_dim=size.heads * size.head_dim, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=size.audio_heads, audio_attention_head_dim=size.audio_head_dim,
        audio_cross_attention_dim=size.audio_heads * size.audio_head_dim, num_layers=size.layers,
        qk_norm="rms_norm_across_heads", caption_channels=caption_channels, rope_double_precision=False,
        rope_type=size.rope_type, gated_attn=size.gated_attn, audio_gated_attn=size.gated_attn,
        cross_attn_mod=size.cross_attn_mod, audio_cross_attn_mod=size.cross_attn_mod,
    ).eval()


def tiny_ltx2_pipeline(size: LTX2Size = LTX2Size(), seed: int = 0):
    """An LTX2Pipeline (text to video with audio) from tiny configs, as diffusers' own fast tests build it."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = tiny_gemma_tokenizer()
    text_encoder = tiny_gemma3_encoder(tokenizer, seed=seed + 1)
    text_config = text_encoder.config.text_config
    transformer = tiny_ltx2_transformer(size, caption_channels=text_config.hidden_size, seed=seed)
    torch.manual_seed(seed + 2)
    connectors = LTX2TextConnectors(
        caption_channels=text_config.hidden_size, text_proj_in_factor=text_config.num_hidden_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split",
    ).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    ).eval()
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
                        vocoder=vocoder, processor=None, prompt_enhancer=None, duration_head=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe
