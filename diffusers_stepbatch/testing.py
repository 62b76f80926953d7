"""Tiny, offline, seeded diffusers pipelines for tests, benchmarks and demos.

Everything here builds from configs with locally constructed tokenizers: no Hub access, no downloads.
The weights are random, so images are noise; what matters is that the real diffusers code runs.

>>> from diffusers_stepbatch.testing import tiny_flux_pipeline
>>> pipe = tiny_flux_pipeline(guidance_embeds=True)
>>> image = pipe("a cat", height=32, width=32, num_inference_steps=2).images[0]
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

__all__ = ["FluxSize", "tiny_clip_tokenizer", "tiny_t5_tokenizer", "tiny_flux_pipeline", "tiny_flux_transformer"]


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A byte-level CLIP tokenizer with no merges: every character is one token."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer over ASCII letters, digits and punctuation."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -1.5) for c in string.ascii_letters]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


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
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    latent_channels = size.in_channels // 4
    transformer = tiny_flux_transformer(size, guidance_embeds=guidance_embeds, seed=seed)

    torch.manual_seed(seed + 1)
    clip_tokenizer = tiny_clip_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=clip_tokenizer.bos_token_id,
            eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id,
            hidden_size=size.pooled_projection_dim,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=len(clip_tokenizer),
            max_position_embeddings=clip_tokenizer.model_max_length,
            hidden_act="gelu",
            projection_dim=32,
        )
    ).eval()

    torch.manual_seed(seed + 2)
    t5_tokenizer = tiny_t5_tokenizer()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=size.joint_attention_dim,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
            decoder_start_token_id=0,
        )
    ).eval()

    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,) * vae_blocks,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()

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
