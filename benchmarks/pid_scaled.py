"""The scale PiD was made for, shrunk to a CPU: a FLUX-architecture pipeline and a PiD at the real pair's ratios.

The real pair: FLUX.1-dev's transformer (black-forest-labs/FLUX.1-dev `transformer/config.json`: 19 + 38 blocks,
24 heads x 128, joint_attention_dim 4096, pooled 768; 11.90B parameters) and the released flux PiD
(`PiD_res2k_sr4x_official_flux_distill_4step`, `OFFICIAL_CONFIGS`; 1.362B): 8.74x the parameters. At a 2048 px
output the main model runs at 512 px (1024 image tokens + 512 T5 tokens) for K steps against 2048 px (16384
tokens) for all N, and PiD works on 16384 patch tokens + 300 caption tokens.

Here every linear size is 1/4 (output 512 px, main model 128 px), so every token count is 1/16 of the real one
(64 image + 32 text tokens, 1024 + 32 at full size; PiD 1024 patch + 19 caption tokens: the same ratios), and the
widths and depths are cut until the parameter ratio is the real one (main 5.63M, PiD 0.644M: 8.74x). What is
kept: both architectures, FLUX's 1:2 double:single block ratio (5 + 10 blocks, 2 heads x 64), PiD's patch size
16, sr 4, 16-channel latent at 1/8 and its adapter layout (3 patch blocks, 1 pixel block, hidden 40), FLUX's VAE
layout (4 levels, 2 layers per block, 16 latent channels, mid attention) at 1/16 of its widths (or 1/4), and FLUX's
dynamic-shift schedule with its sequence lengths scaled by 1/16. What shifts: PiD's pixel stream cannot be
narrower than 4 (its sin/cos embedding), so its pixel block holds 50% of the small PiD's parameters
against 7.7% in the real one; FLOPs still follow parameters x tokens. PiD reads the pipeline's T5 embeddings
(the released one reads Gemma-2-2B's, a one-off caption encode per image).

>>> pipe, decoder = build_scaled_pair()
>>> counts = parameter_counts()       # the real and the scaled pair, counted from their configs
"""

from __future__ import annotations

from typing import Any

OUTPUT_SIZE = 512  # the real comparison's 2048 px at 1/4
SR_SCALE = 4
MAX_SEQUENCE_LENGTH = 32  # FLUX.1-dev's 512 T5 tokens at 1/16
PID_CHECKPOINT = "PiD_res2k_sr4x_official_flux_distill_4step"

REAL_FLUX_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
SCALED_FLUX_TRANSFORMER = dict(
    REAL_FLUX_TRANSFORMER, num_layers=5, num_single_layers=10, attention_head_dim=64, num_attention_heads=2,
    joint_attention_dim=128, pooled_projection_dim=32, axes_dims_rope=(8, 28, 28),
)  # fmt: skip
# Overrides of the released flux PiD config (which is patch 16, sr 4, 16-channel latents at 1/8).
SCALED_PID_OVERRIDES = dict(
    hidden_size=40, num_groups=1, patch_depth=3, pixel_depth=1, pixel_hidden_size=4, pixel_attn_hidden_size=32,
    pixel_num_groups=1, txt_embed_dim=128, txt_max_length=19, lq_hidden_dim=32, rope_ref_h=256, rope_ref_w=256,
)  # fmt: skip
REAL_FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
    scaling_factor=0.3611, shift_factor=0.1159,
)  # fmt: skip
VAE_WIDTH_DIVISOR = 16  # default: the VAE decode costs ~10% of side (a) here (real: a few %)


def scaled_vae_config(width_divisor: int = VAE_WIDTH_DIVISOR) -> dict[str, Any]:
    """FLUX's VAE with every width divided by `width_divisor` (4 keeps the real VAE : PiD per-pixel width ratio,
    128 : 16, as 32 : 4; 16 keeps its share of side (a)'s time closer to the real one)."""
    widths = tuple(c // width_divisor for c in REAL_FLUX_VAE["block_out_channels"])
    return dict(REAL_FLUX_VAE, block_out_channels=widths, norm_num_groups=min(widths[0], 32))
# FLUX.1-dev's scheduler, its sequence lengths at 1/16 so each size gets the real size's shift.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256 // 16,
    max_image_seq_len=4096 // 16, base_shift=0.5, max_shift=1.15,
)  # fmt: skip


def scaled_pid_config() -> dict[str, Any]:
    from diffusers_stepbatch.decoders.pid.configs import get_official_config

    return {**get_official_config(PID_CHECKPOINT).constructor, **SCALED_PID_OVERRIDES}


def parameter_counts() -> dict[str, int]:
    """Parameters of the real and the scaled transformer and PiD, built on the meta device (nothing allocated)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from diffusers_stepbatch.decoders.pid import PiDDecoder
    from diffusers_stepbatch.decoders.pid.configs import get_official_config

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        return {
            "real_main": count(FluxTransformer2DModel(**REAL_FLUX_TRANSFORMER)),
            "real_pid": count(PiDDecoder(**get_official_config(PID_CHECKPOINT).constructor)),
            "scaled_main": count(FluxTransformer2DModel(**SCALED_FLUX_TRANSFORMER)),
            "scaled_pid": count(PiDDecoder(**scaled_pid_config())),
        }


def token_counts(output_size: int = OUTPUT_SIZE, text_tokens: int = MAX_SEQUENCE_LENGTH,
                 pid_text_tokens: int = SCALED_PID_OVERRIDES["txt_max_length"]) -> dict[str, int]:
    """Tokens per row of each forward: the main model at full and at 1/sr_scale size, and PiD at the output size."""
    full = (output_size // 16) ** 2  # vae_scale_factor 8 x 2x2 packing
    return {"main_full": full + text_tokens, "main_low": full // SR_SCALE**2 + text_tokens,
            "pid": (output_size // 16) ** 2 + pid_text_tokens}  # fmt: skip


def build_scaled_pair(seed: int = 0, vae_width_divisor: int = VAE_WIDTH_DIVISOR):
    """(FluxPipeline with random weights, PiDDecoder with random weights), both float32 in eval mode."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffusers_stepbatch.decoders.pid import PiDDecoder
    from diffusers_stepbatch.testing import tiny_clip_tokenizer, tiny_t5_tokenizer

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**SCALED_FLUX_TRANSFORMER).eval()
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id, hidden_size=SCALED_FLUX_TRANSFORMER["pooled_projection_dim"],
        intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(clip_tokenizer),
        max_position_embeddings=clip_tokenizer.model_max_length, projection_dim=32,
    )).eval()  # fmt: skip
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=SCALED_FLUX_TRANSFORMER["joint_attention_dim"], d_kv=32, d_ff=256,
        num_layers=2, num_heads=4, pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
        decoder_start_token_id=0,
    )).eval()  # fmt: skip
    vae = AutoencoderKL(**scaled_vae_config(vae_width_divisor)).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
        tokenizer=clip_tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    decoder = PiDDecoder(**scaled_pid_config()).eval()
    return pipe, decoder
