"""Tiny random Wan 2.1 / 2.2 video pipelines (text- and image-to-video): the demo server's `tiny-wan` models,
also built by tests and benchmarks.

Built from configs, seeded, with the local T5 tokenizer of `toy.tiny_text`; random weights (no training), so
videos are noise. Sizes are multiples of 16 and frame counts 4k + 1, as the real pipelines want.
"""

from __future__ import annotations

import torch

from .tiny_text import tiny_t5_encoder, tiny_t5_tokenizer


def tiny_wan_transformer(in_channels: int = 16, heads: int = 2, head_dim: int = 12, layers: int = 2,
                         image_dim: int | None = None, seed: int = 0, image_kv: bool = False,
                         pos_embed_seq_len: int | None = None):
    """A tiny WanTransformer3DModel; `image_kv` gives cross-attention its own image key/value projections
    (`added_kv_proj_dim`, as the real Wan 2.1 I2V has), which split each context before its last 512 tokens;
    `pos_embed_seq_len` (first-last-frame-to-video) folds each video's two image embeddings into one."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=in_channels,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=image_dim,
        added_kv_proj_dim=heads * head_dim if image_kv else None, pos_embed_seq_len=pos_embed_seq_len,
    ).eval()


def tiny_wan_vae(seed: int = 0):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def tiny_wan_pipeline(heads: int = 2, head_dim: int = 12, layers: int = 2, experts: bool = False,
                      boundary_ratio: float = 0.875, image_to_video: bool = False, seed: int = 0,
                      image_kv: bool = False, expand_timesteps: bool = False):
    """A WanPipeline (Wan 2.1 text-to-video), or with `experts` Wan 2.2's two transformers switched at
    `boundary_ratio`; with `image_to_video` a WanImageToVideoPipeline (2.1: with a CLIP image encoder;
    2.2: the image only as latent conditioning). `image_kv`: the 2.1 image-to-video transformer attends to the
    image tokens through their own key/value projections, as the real one does. `expand_timesteps`: Wan 2.2
    TI2V's per-token timesteps (image-to-video: the first frame as clean latents, no CLIP encoder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanImageToVideoPipeline
    from diffusers import WanPipeline

    tokenizer = tiny_t5_tokenizer()
    text_encoder = tiny_t5_encoder(tokenizer, d_model=32, seed=seed + 1)
    in_channels = 36 if image_to_video and not expand_timesteps else 16
    image_dim = 4 if image_to_video and not experts and not expand_timesteps else None
    image_kv = image_kv and image_dim is not None
    transformer = tiny_wan_transformer(in_channels, heads, head_dim, layers, image_dim, seed, image_kv)
    components = dict(transformer=transformer, vae=tiny_wan_vae(seed + 2), text_encoder=text_encoder,
                      tokenizer=tokenizer)
    if experts:
        components.update(transformer_2=tiny_wan_transformer(in_channels, heads, head_dim, layers, image_dim,
                                                             seed + 3, image_kv),
                          boundary_ratio=boundary_ratio,
                          scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                            flow_shift=3.0))
    else:
        components.update(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    if expand_timesteps:
        components.update(expand_timesteps=True)
    if image_to_video:
        cls = WanImageToVideoPipeline
        if image_dim is not None:
            components.update(_tiny_clip_image_encoder(seed + 4))
    else:
        cls = WanPipeline
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_clip_image_encoder(seed: int) -> dict:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    config = CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, intermediate_size=16, patch_size=1)
    return dict(image_encoder=CLIPVisionModelWithProjection(config).eval(),
                image_processor=CLIPImageProcessor(crop_size=32, size=32))
