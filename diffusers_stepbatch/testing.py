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
from typing import Any

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


# ---------------------------------------------------------------------------------------------------------------
# More families: SD3, Qwen-Image, SDXL, SD 1.5 and PixArt-Sigma (served by the generic program).
__all__ += [
    "tiny_clip_text_encoder", "tiny_t5_encoder", "tiny_vae", "tiny_qwen2_tokenizer", "tiny_sd3_pipeline",
    "tiny_qwenimage_pipeline", "tiny_sdxl_pipeline", "tiny_sd_pipeline", "tiny_pixart_or_sana_pipeline",
]


def tiny_clip_text_encoder(tokenizer, hidden_size: int = 32, projection_dim: int | None = None, layers: int = 3,
                           seed: int = 0):
    """A CLIPTextModel, or a CLIPTextModelWithProjection when `projection_dim` is given."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4,
        num_hidden_layers=layers, vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
        hidden_act="gelu", projection_dim=projection_dim or 32,
    )
    torch.manual_seed(seed)
    model_class = CLIPTextModel if projection_dim is None else CLIPTextModelWithProjection
    return model_class(config).eval()


def tiny_t5_encoder(tokenizer, d_model: int = 32, seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
        )
    ).eval()


def tiny_vae(latent_channels: int = 4, blocks: int = 2, seed: int = 0, **config):
    """An AutoencoderKL with vae_scale_factor = 2 ** (blocks - 1)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,) * blocks,
        down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=1, **config,
    ).eval()


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


_QWEN_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                        "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per character) plus Qwen's chat/vision tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for token in ("<|endoftext|>",) + _QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL_TOKENS)})
    return tokenizer


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


# NOTE: one group of target modules per adapter (names missing from a model, or naming other than Linear and Conv
# layers there, are dropped), so adapters touch different layers, Linear and Conv alike, including per-row [B, D]
# inputs (time embeddings) and video patch embeddings.
_LORA_TARGET_GROUPS = (
    ("to_q", "to_k", "to_v", "to_out.0"),
    ("proj_mlp", "proj_out", "ff.net.2", "linear_1", "conv1", "conv2", "time_emb_proj", "to_qkv_mlp_proj",
     "feed_forward.w2", "t_embedder.mlp.2", "all_final_layer.2-1.adaLN_modulation.1", "siglip_embedder.1"),
    ("add_q_proj", "add_k_proj", "to_add_out", "norm1.linear", "x_embedder", "context_embedder", "proj_in",
     "conv_in", "ff.net.0.proj", "to_q", "all_x_embedder.2-1", "cap_embedder.1",
     "layers.0.adaLN_modulation.0", "noise_refiner.0.adaLN_modulation.0", "feed_forward.w1", "patch_embedding",
     "x_embedder.proj"),
)
_LORA_LAYER_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def add_random_lora_adapters(model: torch.nn.Module, names: tuple[str, ...] = ("a", "b", "c"), rank: int = 4,
                             seed: int = 0) -> tuple[str, ...]:
    """Add non-zero random peft LoRA adapters (`init_lora_weights=False`) to a diffusers model, as diffusers does.

    Adapter i targets its own group of modules, has lora_alpha = rank * (i + 1) / 2 and every third one uses
    rsLoRA, so the per-layer scales differ. Leaves the last one active (as `add_adapter` does).

    >>> add_random_lora_adapters(pipe.transformer)
    ('a', 'b', 'c')
    """
    from peft import LoraConfig

    modules = dict(model.named_modules())

    def targetable(target: str) -> bool:  # NOTE: as peft matches names: the module itself or a suffix
        found = [module for m, module in modules.items() if m == target or m.endswith("." + target)]
        return bool(found) and all(isinstance(module, _LORA_LAYER_TYPES) for module in found)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, name in enumerate(names):
            group = _LORA_TARGET_GROUPS[i % len(_LORA_TARGET_GROUPS)]
            targets = [t for t in group if targetable(t)]
            config = LoraConfig(r=rank, lora_alpha=rank * (i + 1) / 2, target_modules=targets,
                                init_lora_weights=False, use_rslora=i % 3 == 2)
            model.add_adapter(config, adapter_name=name)
    return names


def add_random_ip_adapter(pipe: Any, image_embed_dim: int = 16, tokens: int = 4, seed: int = 0,
                          faceid: bool = False) -> None:
    """Load a random IP-Adapter (as `load_ip_adapter` would) and a tiny CLIP image encoder into an SD, SDXL or
    Flux pipeline.

    The adapter's key/value projections match each cross-attention layer (Flux: each double-stream block); its
    `ImageProjection` maps the image encoder's `image_embed_dim`-wide embedding to `tokens` tokens. Scale 1.0, as
    after `load_ip_adapter`. `faceid=True` (UNets): an IP-Adapter FaceID projection
    (`IPAdapterFaceIDImageProjection`, face embeddings of `image_embed_dim`) and no image encoder: requests pass
    `ip_adapter_image_embeds` of shape [2, 1, 1, image_embed_dim] under CFG.

    >>> add_random_ip_adapter(pipe); pipe(prompt, ip_adapter_image=image)
    """
    from diffusers.models.embeddings import ImageProjection
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    flux = hasattr(pipe, "transformer")  # else a UNet pipeline
    model = pipe.transformer if flux else pipe.unet
    cross_dim = model.config.joint_attention_dim if flux else model.config.cross_attention_dim
    modules = dict(model.named_modules())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = {}
        if flux:  # one IP projection pair (with biases) per double-stream block, numbered from 0
            for key_id in range(len(model.transformer_blocks)):
                for projection in ("to_k_ip", "to_v_ip"):
                    attention[f"{key_id}.{projection}.weight"] = torch.randn(model.inner_dim, cross_dim) * 0.3
                    attention[f"{key_id}.{projection}.bias"] = torch.randn(model.inner_dim) * 0.1
        else:  # one pair per cross-attention layer, numbered 1, 3, 5, ...
            key_id = 1
            for name in model.attn_processors:
                if name.endswith("attn1.processor"):
                    continue
                to_k = modules[name[: -len(".processor")]].to_k
                for projection in ("to_k_ip", "to_v_ip"):
                    attention[f"{key_id}.{projection}.weight"] = torch.randn(to_k.out_features, to_k.in_features) * 0.3
                key_id += 2
        if faceid:
            from diffusers.models.embeddings import IPAdapterFaceIDImageProjection

            sd = IPAdapterFaceIDImageProjection(cross_attention_dim=cross_dim, image_embed_dim=image_embed_dim,
                                                mult=2, num_tokens=tokens).state_dict()
            projection = {"proj.0.weight": sd["ff.net.0.proj.weight"], "proj.0.bias": sd["ff.net.0.proj.bias"],
                          "proj.2.weight": sd["ff.net.2.weight"], "proj.2.bias": sd["ff.net.2.bias"],
                          "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]}
        else:
            sd = ImageProjection(cross_attention_dim=cross_dim, image_embed_dim=image_embed_dim,
                                 num_image_text_embeds=tokens).state_dict()
            projection = {"proj.weight": sd["image_embeds.weight"], "proj.bias": sd["image_embeds.bias"],
                          "norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]}
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, projection_dim=image_embed_dim, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, image_size=32, patch_size=8,
        )).eval()
    model._load_ip_adapter_weights([{"image_proj": projection, "ip_adapter": attention}])
    if faceid:  # NOTE: FaceID takes face embeddings (e.g. insightface's), never images
        return
    processor = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    pipe.register_modules(image_encoder=encoder, feature_extractor=processor)


def add_random_sd3_ip_adapter(pipe: Any, tokens: int = 4, seed: int = 0) -> None:
    """Load a random SD3 IP-Adapter (as `load_ip_adapter` would) and a tiny SigLIP image encoder into a
    StableDiffusion3Pipeline.

    The resampler (`IPAdapterTimeImageProjection`, 4 blocks of one 64-wide head, as the loader infers them) maps
    the encoder's penultimate hidden states to `tokens` image tokens; each block gets an
    `SD3IPAdapterJointAttnProcessor2_0`. Scale 0.5, as after `load_ip_adapter`.

    >>> add_random_sd3_ip_adapter(pipe); pipe(prompt, ip_adapter_image=image)
    """
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    model = pipe.transformer
    inner = model.config.attention_head_dim * model.config.num_attention_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8,
        )).eval()
        projection = IPAdapterTimeImageProjection(embed_dim=32, output_dim=inner, hidden_dim=64, heads=1,
                                                  num_queries=tokens, timestep_in_dim=32)
        attention = {}
        for index in range(len(model.attn_processors)):
            processor = SD3IPAdapterJointAttnProcessor2_0(hidden_size=inner, ip_hidden_states_dim=inner,
                                                          head_dim=model.config.attention_head_dim,
                                                          timesteps_emb_dim=64)
            for name, value in processor.state_dict().items():  # NOTE: non-trivial norms, a visible image branch
                attention[f"{index}.{name}"] = value + 0.3 * torch.randn_like(value)
    model._load_ip_adapter_weights({"image_proj": projection.state_dict(), "ip_adapter": attention})
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    pipe.register_modules(image_encoder=encoder, feature_extractor=processor)
