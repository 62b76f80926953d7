"""Tiny offline pipelines of the newer image families (Z-Image, FLUX.2 dev and klein, Qwen-Image Edit and 2.1), for
tests and benchmarks.

Built from configs, seeded, with the byte-level Qwen tokenizer of `testing.components` plus a short chat template
(tokens are characters here, so prompts stay short).
"""

from __future__ import annotations

import functools

import torch

from .components import tiny_qwen2_tokenizer

_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_tokenizer():
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def qwen3_text_encoder(tokenizer, hidden: int, causal_lm: bool, seed: int):
    """A 2-layer Qwen3 text encoder of width `hidden` (Z-Image reads a `Qwen3Model`, klein a `Qwen3ForCausalLM`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=hidden // 2, vocab_size=len(tokenizer),
                         max_position_embeddings=512)
    torch.manual_seed(seed)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()


def tiny_z_image_pipeline(dim: int = 32, heads: int = 2, axes_dims: tuple[int, int, int] = (8, 4, 4), seed: int = 0,
                          pipeline_class=None, vae_blocks: int | None = None):
    """A ZImagePipeline (or `pipeline_class`, e.g. ZImageImg2ImgPipeline): sizes divisible by 16. `vae_blocks`: a
    VAE of that many 4-channel blocks (3: a latent at a quarter of the sides) instead of the 2-block 32/64-channel
    one."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = tiny_chat_tokenizer()
    text_encoder = qwen3_text_encoder(tokenizer, 16, causal_lm=False, seed=seed + 1)
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
    channels, groups = ([32, 64], 32) if vae_blocks is None else ([4] * vae_blocks, 4)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * len(channels),
                        up_block_types=["UpDecoderBlock2D"] * len(channels), block_out_channels=channels,
                        layers_per_block=1, latent_channels=16, norm_num_groups=groups, sample_size=32,
                        scaling_factor=0.3611, shift_factor=0.1159).eval()
    cls = pipeline_class or ZImagePipeline
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux2_klein_pipeline(heads: int = 2, head_dim: int = 16, axes_dims: tuple[int, ...] = (4, 4, 4, 4),
                              seed: int = 0, pipeline_class=None, vae_blocks: int = 1):
    """A Flux2KleinPipeline (or `pipeline_class`): pass `text_encoder_out_layers=(1,)` to calls. `vae_blocks`: the
    VAE's blocks, each after the first halving the latent's sides (1: a token per 2x2 pixels)."""
    from diffusers import Flux2KleinPipeline

    tokenizer = tiny_chat_tokenizer()
    text_encoder = qwen3_text_encoder(tokenizer, 16, causal_lm=True, seed=seed + 1)
    cls = pipeline_class or Flux2KleinPipeline
    return _flux2_pipeline(cls, tokenizer, text_encoder, heads, head_dim, axes_dims, seed, guidance_embeds=False,
                           vae_blocks=vae_blocks)


# NOTE: content may be a list of parts (FLUX.2 dev's messages); the system message is left out, since with
# one token per character it would fill max_sequence_length before the prompt
_FLUX2_DEV_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}")


def tiny_flux2_pipeline(heads: int = 2, head_dim: int = 16, axes_dims: tuple[int, ...] = (4, 4, 4, 4),
                        seed: int = 0, vae_blocks: int = 1):
    """A Flux2Pipeline (FLUX.2 dev: guidance embedding, Mistral3 text encoder): pass `text_encoder_out_layers=(1,)`
    to calls (`vae_blocks` as for klein). The processor is the tiny tokenizer with a chat template for FLUX.2's
    messages (transformers' PixtralProcessor needs torchvision), enough for text prompts; prompt upsampling is not
    supported."""
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
                           guidance_embeds=True, vae_blocks=vae_blocks)


def _flux2_pipeline(cls, tokenizer, text_encoder, heads, head_dim, axes_dims, seed, guidance_embeds: bool,
                    vae_blocks: int = 1):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=16, timestep_guidance_channels=256,
        axes_dims_rope=list(axes_dims), guidance_embeds=guidance_embeds,
    ).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3,
                             down_block_types=("DownEncoderBlock2D",) * vae_blocks,
                             up_block_types=("UpDecoderBlock2D",) * vae_blocks, block_out_channels=(4,) * vae_blocks,
                             layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
               transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.lru_cache(maxsize=None)
def _image_text_processor_class():
    from transformers import Qwen2VLProcessor

    class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
        """Without the video processor (it needs torchvision; the edit pipelines pass no videos)."""

        def __init__(self, image_processor=None, tokenizer=None):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer)

    return Qwen2VLImageTextProcessor


def tiny_qwen2_vl_processor(tokenizer, min_pixels: int = 28 * 28, max_pixels: int = 28 * 28 * 4):
    """A Qwen2VLProcessor over `tokenizer` (with `<|image_pad|>`); images resized to `min_pixels`..`max_pixels`
    (sides multiples of 28), so the vision tower sees a few patches (28 * 28 * 4: at most 4 image tokens)."""
    # NOTE: the PIL backend by name, as `Qwen2VLImageProcessor` picks without torchvision (with a warning)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return _image_text_processor_class()(image_processor=image_processor, tokenizer=tokenizer)


def tiny_qwenimage_vae(base_dim: int = 4, seed: int = 2):
    """An AutoencoderKLQwenImage of scale 16 (the most edit pipelines allow: references are rounded to multiples
    of 32), so a ~1024x1024 reference is 32x32 tokens; no level residual blocks, as full-resolution 3-D convs
    dominate the encode (~0.8 s an image on one CPU thread, most of it `conv_in`)."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=base_dim, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                                  temperal_downsample=[False] * 4, latents_mean=[0.0] * 4,
                                  latents_std=[1.0] * 4).eval()


def tiny_qwenimage_edit_pipeline(pipeline_class=None, num_layers: int = 1, attention_head_dim: int = 16,
                                 num_attention_heads: int = 2, text_hidden: int = 32, vae_base_dim: int = 4,
                                 max_pixels: int = 28 * 28 * 4, seed: int = 0, models_of=None):
    """A QwenImageEditPipeline (or `pipeline_class`: QwenImageEditPlusPipeline, QwenImagePipeline) over the tiny
    Qwen-Image components of `testing.pipelines.tiny_qwenimage_pipeline`, a scale-16 VAE and a local Qwen2VLProcessor.

    Output heights and widths must be multiples of 32; pass small ones (the default is ~1024x1024). The encode
    templates keep their structure (system, user with the image placeholders, assistant) with a short system
    prompt, since tokens are characters here. `models_of`: another pipeline of this builder whose models to share
    (e.g. for `StepBatched.sibling`).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImagePipeline

    from .pipelines import tiny_qwenimage_pipeline

    if models_of is None:
        base = tiny_qwenimage_pipeline(num_layers=num_layers, attention_head_dim=attention_head_dim,
                                       num_attention_heads=num_attention_heads, text_hidden=text_hidden, seed=seed)
        models_of = dict(vae=tiny_qwenimage_vae(vae_base_dim, seed=seed + 2), text_encoder=base.text_encoder,
                         tokenizer=base.tokenizer, transformer=base.transformer)
    else:
        models_of = {name: getattr(models_of, name) for name in ("vae", "text_encoder", "tokenizer", "transformer")}
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(), **models_of)
    tokenizer = components["tokenizer"]
    cls = pipeline_class or QwenImageEditPipeline
    if cls is QwenImagePipeline:
        pipe = cls(**components)
        prefix = "<|im_start|>system\nDescribe the image.<|im_end|>\n<|im_start|>user\n"
        image = ""
    else:
        pipe = cls(processor=tiny_qwen2_vl_processor(tokenizer, max_pixels=max_pixels), **components)
        prefix = "<|im_start|>system\nEdit the image.<|im_end|>\n<|im_start|>user\n"
        # NOTE: Edit puts one image placeholder in its template; Edit-Plus prefixes the prompt with
        # "Picture i: <placeholder>" per image and keeps a template without one
        image = "<|vision_start|><|image_pad|><|vision_end|>" if "<|image_pad|>" in pipe.prompt_template_encode else ""
    pipe.prompt_template_encode = prefix + image + "{}<|im_end|>\n<|im_start|>assistant\n"
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# A chat template that also renders a message whose content is a list of text parts (Qwen-Image 2.1 counts the
# tokens of its system message that way)
_PARTS_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwenimage21_pipeline(heads: int = 2, head_dim: int = 16, axes_dims: tuple[int, int, int] = (4, 6, 6),
                              latent_channels: int = 8, text_hidden: int = 32, seed: int = 0):
    """A QwenImage21Pipeline: a 2-layer Qwen3-VL encoder (16 px patches), a 2-block transformer and a 4-channel
    (RGBA) VAE of scale 16 with no residual blocks; sizes are multiples of 32."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class Qwen3VLImageTextProcessor(Qwen3VLProcessor):
        """Without the video processor (it needs torchvision; the pipeline passes no videos)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)

    tokenizer = tiny_chat_tokenizer()
    tokenizer.chat_template = _PARTS_CHAT_TEMPLATE
    processor = Qwen3VLImageTextProcessor(image_processor=Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=32 * 32 * 4, patch_size=16, merge_size=2), tokenizer=tokenizer,
        chat_template=tokenizer.chat_template)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=text_hidden, intermediate_size=text_hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=text_hidden // 2,
                         vocab_size=len(tokenizer), max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text_hidden,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=token("<|image_pad|>"), vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(seed + 1)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(
        in_channels=latent_channels, out_channels=latent_channels, num_layers=2, attention_head_dim=head_dim,
        num_attention_heads=heads, context_in_dim=text_hidden, axes_dims_rope=axes_dims).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=latent_channels, dim_mult=[1] * 5,
                                   num_res_blocks=1, temperal_downsample=[False] * 4,
                                   latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels).eval()
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                               text_encoder=text_encoder, processor=processor, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
