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
layout (4 levels, 2 layers per block, 16 latent channels, mid attention) with its widths divided by 4 or by 32
(`VAE_SIZINGS`: the first keeps its activations relative to PiD's, the second its share of the FLOPs), and FLUX's
dynamic-shift schedule with its sequence lengths scaled by 1/16. What shifts: PiD's pixel stream cannot be
narrower than 4 (its sin/cos embedding), so its pixel block holds 50% of the small PiD's parameters
against 7.7% in the real one; FLOPs still follow parameters x tokens. PiD reads the pipeline's T5 embeddings
(the released one reads Gemma-2-2B's, a one-off caption encode per image).

>>> pipe, decoder = build_scaled_pair()
>>> counts = parameter_counts()       # the real and the scaled pair, counted from their configs
>>> vae_divisor("flops"), flop_counts(real=True)["vae_share_of_full_side"]     # 32, 0.0041
"""

from __future__ import annotations

import functools
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
# NOTE: a shrunk VAE keeps either its activations relative to PiD's ("activations": widths divided as PiD's pixel
# width is) or its share of side (a)'s FLOPs ("flops": the nearest divisor), not both; `vae_divisor` picks each.
VAE_SIZINGS = ("activations", "flops")
# NOTE: at 32 FLUX's widths are (4, 8, 16, 16): no narrower than PiD's pixel stream, which cannot go below 4.
VAE_DIVISOR_CANDIDATES = (4, 8, 16, 32)


def scaled_vae_config(width_divisor: int) -> dict[str, Any]:
    """FLUX's VAE with every width divided by `width_divisor` (`vae_divisor(sizing)` picks it)."""
    widths = tuple(c // width_divisor for c in REAL_FLUX_VAE["block_out_channels"])
    return dict(REAL_FLUX_VAE, block_out_channels=widths, norm_num_groups=min(widths[0], 32))


def vae_divisor(sizing: str) -> int:
    """The VAE width divisor of a sizing in `VAE_SIZINGS`, from the real and the scaled configs."""
    if sizing == "activations":
        from diffusers_stepbatch.decoders.pid.configs import get_official_config

        real = get_official_config(PID_CHECKPOINT).constructor["pixel_hidden_size"]
        return real // SCALED_PID_OVERRIDES["pixel_hidden_size"]
    if sizing == "flops":
        import math

        real = flop_counts(real=True)["vae_share_of_full_side"]
        return min(VAE_DIVISOR_CANDIDATES,
                   key=lambda d: abs(math.log(flop_counts(False, d)["vae_share_of_full_side"] / real)))  # fmt: skip
    raise ValueError(f"sizing={sizing!r} must be one of {VAE_SIZINGS}")


@functools.cache
def flop_counts(real: bool, vae_width_divisor: int = 1, steps: int = 28, exit_step: int = 24) -> dict[str, float]:
    """FLOPs of one forward of each network at the benchmark's sizes (real: 2048 px output), counted by
    `torch.utils.flop_counter` on the meta device (nothing allocated), and each decode's share of its side."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    from diffusers_stepbatch.decoders.pid import PiDDecoder
    from diffusers_stepbatch.decoders.pid.configs import get_official_config

    flux = REAL_FLUX_TRANSFORMER if real else SCALED_FLUX_TRANSFORMER
    vae_config = REAL_FLUX_VAE if real else scaled_vae_config(vae_width_divisor)
    pid_config = get_official_config(PID_CHECKPOINT).constructor if real else scaled_pid_config()
    output = OUTPUT_SIZE * (4 if real else 1)
    text = MAX_SEQUENCE_LENGTH * (16 if real else 1)

    def count(run) -> float:
        with torch.device("meta"), torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
        return float(counter.get_total_flops())

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**flux).eval()
        vae = AutoencoderKL(**vae_config).eval()
        pid = PiDDecoder(**pid_config).eval()

    def main_forward(size: int):
        n = (size // 16) ** 2
        return lambda: transformer(
            hidden_states=torch.randn(1, n, 64), encoder_hidden_states=torch.randn(1, text, flux["joint_attention_dim"]),
            pooled_projections=torch.randn(1, flux["pooled_projection_dim"]), timestep=torch.full((1,), 0.5),
            guidance=torch.full((1,), 3.5), img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(text, 3))  # fmt: skip

    counts = {
        "main_full": count(main_forward(output)),
        "main_low": count(main_forward(output // SR_SCALE)),
        "vae_decode": count(lambda: vae.decode(torch.randn(1, 16, output // 8, output // 8))),
        "pid_forward": count(lambda: pid(
            torch.randn(1, 3, output, output), torch.full((1,), 500.0),
            torch.randn(1, pid_config["txt_max_length"], pid_config["txt_embed_dim"]),
            lq_latent=torch.randn(1, 16, output // 32, output // 32), degrade_sigma=torch.full((1,), 0.2))),
    }  # fmt: skip
    full = steps * counts["main_full"] + counts["vae_decode"]
    pid_side = exit_step * counts["main_low"] + 4 * counts["pid_forward"]  # the 4-step distilled sampler
    return {**counts, "full_side": full, "pid_side": pid_side, "full_over_pid": full / pid_side,
            "vae_share_of_full_side": counts["vae_decode"] / full,
            "pid_share_of_pid_side": 4 * counts["pid_forward"] / pid_side}  # fmt: skip


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


def build_scaled_pair(seed: int = 0, vae_width_divisor: int | None = None):
    """(FluxPipeline with random weights, PiDDecoder with random weights), both float32 in eval mode; the VAE's
    widths divided by `vae_width_divisor` (default: the "activations" sizing)."""
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
    divisor = vae_width_divisor or vae_divisor("activations")
    vae = AutoencoderKL(**scaled_vae_config(divisor)).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
        tokenizer=clip_tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    decoder = PiDDecoder(**scaled_pid_config()).eval()
    return pipe, decoder
