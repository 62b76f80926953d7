"""Tiny, offline, seeded diffusers pipelines of the first families: FLUX.1, SD3, Qwen-Image, SDXL, SD 1.5 and
PixArt-Sigma / Sana.

Everything here builds from configs with locally constructed tokenizers: no Hub access, no downloads.
The weights are random, so images are noise; what matters is that the real diffusers code runs.

>>> from diffusers_stepbatch.testing import tiny_flux_pipeline
>>> pipe = tiny_flux_pipeline(guidance_embeds=True)
>>> image = pipe("a cat", height=32, width=32, num_inference_steps=2).images[0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .components import tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_qwen2_tokenizer, tiny_t5_encoder
from .components import tiny_t5_tokenizer, tiny_vae


@dataclass(frozen=True)
class FluxSize:
    """Shape of a Flux-architecture transformer (the real FLUX.1 is hidden 3072, 19 + 38 blocks)."""

    num_layers: int = 1
    num_single_layers: int = 1
    attention_head_dim: int = 16
    num_attention_heads: int = 2
    joint_attention_dim: int = 32
    pooled_projection_dim: int = 32
    in_channels: int = 16

    @property
    def axes_dims_rope(self) -> tuple[int, int, int]:
        # RoPE splits the head dimension over (text index, row, column); must sum to attention_head_dim.
        quarter = self.attention_head_dim // 4
        return (quarter, quarter, self.attention_head_dim - 2 * quarter)


def tiny_flux_transformer(size: FluxSize = FluxSize(), guidance_embeds: bool = False, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=size.in_channels,
        num_layers=size.num_layers,
        num_single_layers=size.num_single_layers,
        attention_head_dim=size.attention_head_dim,
        num_attention_heads=size.num_attention_heads,
        joint_attention_dim=size.joint_attention_dim,
        pooled_projection_dim=size.pooled_projection_dim,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=size.axes_dims_rope,
    ).eval()


def tiny_flux_pipeline(
    guidance_embeds: bool = False,
    size: FluxSize = FluxSize(),
    vae_blocks: int = 2,
    seed: int = 0,
):
    """A FluxPipeline with random tiny components; `vae_blocks` sets vae_scale_factor = 2 ** (vae_blocks - 1).

    Images must have height and width divisible by `2 * vae_scale_factor` (Flux packs 2x2 latent patches).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    transformer = tiny_flux_transformer(size, guidance_embeds=guidance_embeds, seed=seed)
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    text_encoder = tiny_clip_text_encoder(clip_tokenizer, hidden_size=size.pooled_projection_dim, layers=2,
                                          seed=seed + 1)
    text_encoder_2 = tiny_t5_encoder(t5_tokenizer, d_model=size.joint_attention_dim, seed=seed + 2)
    vae = tiny_vae(size.in_channels // 4, vae_blocks, seed + 3, use_quant_conv=False, use_post_quant_conv=False,
                   shift_factor=0.0609, scaling_factor=1.5035)

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_unet(cross_attention_dim: int, sdxl: bool, seed: int, projection_dim: int = 0):
    from diffusers import UNet2DConditionModel

    extra = {}
    if sdxl:  # SDXL's "text_time" conditioning: 6 size/crop numbers x addition_time_embed_dim + pooled text
        extra = dict(addition_embed_type="text_time", addition_time_embed_dim=8,
                     projection_class_embeddings_input_dim=6 * 8 + projection_dim, use_linear_projection=True)
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=(2, 4), norm_num_groups=2, **extra,
    ).eval()


def _unet_scheduler(name: str):
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    config = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
    if name == "euler":
        return EulerDiscreteScheduler(timestep_spacing="leading", **config)
    if name == "dpm":
        return DPMSolverMultistepScheduler(**config)
    raise ValueError(f"scheduler={name!r}; use 'euler' or 'dpm'")


def tiny_sd3_pipeline(num_layers: int = 2, attention_head_dim: int = 8, num_attention_heads: int = 2,
                      patch_size: int = 1, in_channels: int = 4, vae_blocks: int = 2, clip_max_length: int = 16,
                      seed: int = 0):
    """A StableDiffusion3Pipeline with two tiny CLIPs (hidden 32, projection 16) and a tiny T5 (d_model 64).

    Heights and widths must be divisible by vae_scale_factor * patch_size (vae_scale_factor = 2 ** (vae_blocks - 1)).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=patch_size, in_channels=in_channels, num_layers=num_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads, joint_attention_dim=64,
        caption_projection_dim=attention_head_dim * num_attention_heads, pooled_projection_dim=32,
        out_channels=in_channels, pos_embed_max_size=32,
    ).eval()
    clip_tokenizer = tiny_clip_tokenizer(clip_max_length)
    t5_tokenizer = tiny_t5_tokenizer()
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(in_channels, vae_blocks, seed + 4, shift_factor=0.0609, scaling_factor=1.5035,
                     use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=tiny_clip_text_encoder(clip_tokenizer, projection_dim=16, seed=seed + 1),
        tokenizer=clip_tokenizer,
        text_encoder_2=tiny_clip_text_encoder(clip_tokenizer, projection_dim=16, seed=seed + 2),
        tokenizer_2=clip_tokenizer,
        text_encoder_3=tiny_t5_encoder(t5_tokenizer, d_model=64, seed=seed + 3),
        tokenizer_3=t5_tokenizer,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwenimage_pipeline(num_layers: int = 1, attention_head_dim: int = 16, num_attention_heads: int = 2,
                            text_hidden: int = 32, seed: int = 0, vae_base_dim: int = 24):
    """A QwenImagePipeline: tiny Qwen2.5-VL text encoder, Qwen-Image transformer and Qwen-Image VAE (scale 4;
    `vae_base_dim` channels at full resolution, 2x and 4x that below).

    The system prompt of the encode template is shortened (tokens are characters here), so prompts stay short;
    heights and widths must be divisible by 8 (vae_scale_factor * 2).
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    half = text_hidden // 2 // 2  # multimodal RoPE splits half of each (2-head) text attention head in 3 sections
    mrope = [half // 4, half // 4, half - 2 * (half // 4)]
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": text_hidden, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": mrope, "rope_type": "default", "type": "default"},
            "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|endoftext|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text_hidden},
        vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        vision_token_id=ids("<|vision_pad|>"), bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|endoftext|>"),
    )
    torch.manual_seed(seed + 1)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()

    torch.manual_seed(seed)
    side = attention_head_dim * 3 // 8 // 2 * 2  # RoPE over (frame, row, column); every part even
    rope = (attention_head_dim - 2 * side, side, side)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers, attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads, joint_attention_dim=text_hidden, axes_dims_rope=rope,
    ).eval()

    z_dim = 4
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=vae_base_dim, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    ).eval()

    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer)
    prefix = "<|im_start|>system\nDescribe the image.<|im_end|>\n<|im_start|>user\n"
    pipe.prompt_template_encode = prefix + "{}<|im_end|>\n<|im_start|>assistant\n"
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_pipeline(scheduler: str = "euler", seed: int = 0):
    """A StableDiffusionXLPipeline: CLIP (hidden 32) + CLIP with projection (hidden 32, projection 16), tiny UNet.

    `scheduler` is "euler" (EulerDiscreteScheduler) or "dpm" (DPMSolverMultistepScheduler); sizes divisible by 8.
    """
    from diffusers import StableDiffusionXLPipeline

    tokenizer = tiny_clip_tokenizer(16)
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(4, 2, seed + 3),
        text_encoder=tiny_clip_text_encoder(tokenizer, seed=seed + 1),
        text_encoder_2=tiny_clip_text_encoder(tokenizer, projection_dim=16, seed=seed + 2),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=_tiny_unet(64, sdxl=True, seed=seed, projection_dim=16),
        scheduler=_unet_scheduler(scheduler),
        force_zeros_for_empty_prompt=False,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sd_pipeline(scheduler: str = "euler", seed: int = 0):
    """A StableDiffusionPipeline (SD 1.5 layout): one CLIP (hidden 32), tiny UNet, no safety checker."""
    from diffusers import StableDiffusionPipeline

    tokenizer = tiny_clip_tokenizer(16)
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(4, 2, seed + 3),
        text_encoder=tiny_clip_text_encoder(tokenizer, seed=seed + 1),
        tokenizer=tokenizer,
        unet=_tiny_unet(32, sdxl=False, seed=seed),
        scheduler=_unet_scheduler(scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_pixart_or_sana_pipeline(num_layers: int = 1, attention_head_dim: int = 8, num_attention_heads: int = 2,
                                 seed: int = 0):
    """A PixArtSigmaPipeline (no step program: served by the generic one) with a DPM-Solver multistep scheduler.

    Call it with `use_resolution_binning=False` and `clean_caption=False`; sizes divisible by 4.
    """
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    torch.manual_seed(seed)
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=num_layers, patch_size=2, attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads, caption_channels=32, in_channels=4,
        cross_attention_dim=attention_head_dim * num_attention_heads, out_channels=8, attention_bias=True,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6,
    ).eval()
    tokenizer = tiny_t5_tokenizer()
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5_encoder(tokenizer, d_model=32, seed=seed + 1),
        vae=tiny_vae(4, 2, seed + 2),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
