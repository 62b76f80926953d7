"""Tiny offline pipelines of the newer image families (Z-Image, FLUX.2 dev and klein), for tests and benchmarks.

Built from configs, seeded, with the byte-level Qwen tokenizer of `testing.py` plus a short chat template
(tokens are characters here, so prompts stay short).
"""

from __future__ import annotations

import torch

from .testing import tiny_qwen2_tokenizer

_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_tokenizer():
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _qwen3(tokenizer, hidden: int, causal_lm: bool, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=hidden // 2, vocab_size=len(tokenizer),
                         max_position_embeddings=512)
    torch.manual_seed(seed)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()


def tiny_z_image_pipeline(dim: int = 32, heads: int = 2, axes_dims: tuple[int, int, int] = (8, 4, 4), seed: int = 0,
                          pipeline_class=None):
    """A ZImagePipeline (or `pipeline_class`, e.g. ZImageImg2ImgPipeline): sizes divisible by 16."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = tiny_chat_tokenizer()
    text_encoder = _qwen3(tokenizer, 16, causal_lm=False, seed=seed + 1)
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=dim, n_layers=2, n_refiner_layers=1,
        n_heads=heads, n_kv_heads=heads, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0,
        t_scale=1000.0, axes_dims=list(axes_dims), axes_lens=[256, 32, 32],
    ).eval()
    with torch.no_grad():  # NOTE: the pad tokens start as torch.empty
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159).eval()
    cls = pipeline_class or ZImagePipeline
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux2_klein_pipeline(heads: int = 2, head_dim: int = 16, axes_dims: tuple[int, ...] = (4, 4, 4, 4),
                              seed: int = 0, pipeline_class=None):
    """A Flux2KleinPipeline (or `pipeline_class`): pass `text_encoder_out_layers=(1,)` to calls."""
    from diffusers import Flux2KleinPipeline

    tokenizer = tiny_chat_tokenizer()
    text_encoder = _qwen3(tokenizer, 16, causal_lm=True, seed=seed + 1)
    cls = pipeline_class or Flux2KleinPipeline
    return _flux2_pipeline(cls, tokenizer, text_encoder, heads, head_dim, axes_dims, seed, guidance_embeds=False)


# NOTE: content may be a list of parts (FLUX.2 dev's messages); the system message is left out, since with
# one token per character it would fill max_sequence_length before the prompt
_FLUX2_DEV_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}")


def tiny_flux2_pipeline(heads: int = 2, head_dim: int = 16, axes_dims: tuple[int, ...] = (4, 4, 4, 4),
                        seed: int = 0):
    """A Flux2Pipeline (FLUX.2 dev: guidance embedding, Mistral3 text encoder): pass `text_encoder_out_layers=(1,)`
    to calls. The processor is the tiny tokenizer with a chat template for FLUX.2's messages (transformers'
    PixtralProcessor needs torchvision), enough for text prompts; prompt upsampling is not supported."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _FLUX2_DEV_TEMPLATE
    text = MistralConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=512)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8, head_dim=8)
    torch.manual_seed(seed + 1)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision)).eval()
    return _flux2_pipeline(Flux2Pipeline, tokenizer, text_encoder, heads, head_dim, axes_dims, seed,
                           guidance_embeds=True)


def _flux2_pipeline(cls, tokenizer, text_encoder, heads, head_dim, axes_dims, seed, guidance_embeds: bool):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=16, timestep_guidance_channels=256,
        axes_dims_rope=list(axes_dims), guidance_embeds=guidance_embeds,
    ).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
