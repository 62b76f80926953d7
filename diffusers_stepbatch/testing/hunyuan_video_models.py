"""Tiny offline HunyuanVideo 1.5 pipelines (text and image to video), for tests and benchmarks.

Built from configs, seeded, as diffusers' own fast tests build them, with local tokenizers: the character-level
Qwen2 tokenizer of `testing.components` (with a short chat template and system message, so prompts stay a few dozen
tokens) and ByT5's byte tokenizer. Heights and widths are multiples of 16 here, frame counts 2k + 1.

>>> pipe = tiny_hunyuan_video15_pipeline()
>>> video = pipe("a cat", height=16, width=32, num_frames=5, num_inference_steps=2, output_type="pt").frames
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .components import tiny_qwen2_tokenizer, tiny_t5_encoder

# NOTE: one line per message; the pipeline crops the system part (its tokens) off the encoder's output.
_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SYSTEM = "Describe the video."


@dataclass(frozen=True)
class HunyuanVideo15Size:
    """The transformer's shape (the rest of the pipeline is fixed)."""

    heads: int = 2
    head_dim: int = 8
    layers: int = 1
    refiner_layers: int = 1
    rope_axes_dim: tuple[int, int, int] = (2, 2, 4)
    patch_size: int = 1


def tiny_hunyuan_video15_transformer(size: HunyuanVideo15Size = HunyuanVideo15Size(), seed: int = 0):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=size.heads, attention_head_dim=size.head_dim,
        num_layers=size.layers, num_refiner_layers=size.refiner_layers, mlp_ratio=2.0, patch_size=size.patch_size,
        patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=size.rope_axes_dim,
        target_size=16, task_type="t2v",
    ).eval()


def tiny_hunyuan_video15_pipeline(size: HunyuanVideo15Size = HunyuanVideo15Size(), guidance_scale: float = 1.0,
                                  image_to_video: bool = False, seed: int = 0):
    """A HunyuanVideo15Pipeline, or with `image_to_video` a HunyuanVideo15ImageToVideoPipeline (a tiny SigLIP
    image encoder); `guidance_scale` > 1 sets its guider to classifier-free guidance."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    transformer = tiny_hunyuan_video15_transformer(size, seed)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False,
    ).eval()
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed + 2)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(tokenizer), rope_theta=1000000.0,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        pad_token_id=end, bos_token_id=end, eos_token_id=end)).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = tiny_t5_encoder(tokenizer_2, d_model=32, seed=seed + 3)
    components = dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                      text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                      tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    if image_to_video:
        components.update(_tiny_siglip(transformer.config.image_embed_dim, seed + 4))
        pipe = HunyuanVideo15ImageToVideoPipeline(**components)
    else:
        pipe = HunyuanVideo15Pipeline(**components)
    pipe.system_message = _SYSTEM
    prefix = tokenizer.apply_chat_template([[{"role": "system", "content": _SYSTEM}]], tokenize=True,
                                           return_dict=True)["input_ids"][0]
    pipe.prompt_template_encode_start_idx = len(prefix) + len(tokenizer("<|im_start|>user\n").input_ids)
    pipe.tokenizer_max_length = 24
    pipe.tokenizer_2_max_length = 16
    pipe.vision_num_semantic_tokens = 4
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_siglip(hidden: int, seed: int) -> dict:
    """A SigLIP vision encoder of `hidden` channels: 4 tokens per image (16 px, patches of 8)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    config = SiglipVisionConfig(hidden_size=hidden, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    return dict(image_encoder=SiglipVisionModel(config).eval(),
                feature_extractor=SiglipImageProcessor(size={"height": 16, "width": 16}))
