"""Tiny PiD configurations and helpers shared by the PiD tests (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Test vectors from the reference PiD network (see its README), kept in the repo so CI always has them.
GOLDEN_DIR = Path(os.environ.get("PID_GOLDEN_DIR", Path(__file__).resolve().parent / "data" / "pid-golden"))
GOLDEN_NAMES = ("pid_v1_tiny", "pid_v1pt5_tiny")

# The v1 2k structure at toy width; variants below exercise each branch of the network.
_TINY_V1 = dict(
    num_groups=2,
    hidden_size=32,
    pixel_hidden_size=8,
    pixel_attn_hidden_size=16,
    pixel_num_groups=2,
    patch_depth=3,
    pixel_depth=1,
    patch_size=16,
    txt_embed_dim=24,
    txt_max_length=12,
    rope_ref_h=64,
    rope_ref_w=64,
    lq_latent_channels=16,
    lq_hidden_dim=16,
    lq_num_res_blocks=1,
    lq_interval=2,
    sr_scale=4,
    latent_spatial_down_factor=8,
)
_V1PT5 = dict(
    lq_conv_padding_mode="replicate",
    lq_aux_rgb_head=True,
    lq_gate_type="sigma_aware_per_token",
    pit_lq_inject=True,
    rope_ref_h=128,
    rope_ref_w=128,
)
TINY_CONFIGS: dict[str, dict] = {
    "v1": dict(_TINY_V1),
    "v1pt5": {**_TINY_V1, **_V1PT5},
    "v1pt5_packed_latent": {
        **_TINY_V1,
        **_V1PT5,
        "lq_latent_channels": 16,
        "latent_spatial_down_factor": 16,
        "lq_latent_unpatchify_factor": 2,
    },
    "sdxl_4ch_interval1_original_rope": {
        **_TINY_V1,
        "lq_latent_channels": 4,
        "lq_interval": 1,
        "rope_mode": "original",
    },
    "folded_latent": {**_TINY_V1, "sr_scale": 2, "latent_spatial_down_factor": 4},
}


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Add noise to every parameter (matrices N(0, 1/fan_in), vectors N(0, 0.09)) so no path is zero-initialised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                std = param[0].numel() ** -0.5
            else:
                std = 0.3
            param.add_(torch.randn(param.shape, generator=gen) * std)
    return model


def tiny_decoder(name: str = "v1", seed: int = 0):
    from diffusers_stepbatch.decoders.pid import PiDDecoder

    torch.manual_seed(seed)
    return perturb_(PiDDecoder(**TINY_CONFIGS[name]), seed).eval()


def latent_size(config: dict, image_hw: tuple[int, int]) -> tuple[int, int]:
    """Latent height and width whose decode is `image_hw` pixels."""
    scale = config["sr_scale"] * config["latent_spatial_down_factor"]
    return image_hw[0] // scale, image_hw[1] // scale


def inputs(config: dict, batch: int, latent_hw: tuple[int, int], seed: int = 0, text_len: int = 12):
    """Random latent [B, C, h, w] and text embeddings [B, L, D]."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, config["lq_latent_channels"], *latent_hw, generator=gen)
    text = torch.randn(batch, text_len, config["txt_embed_dim"], generator=gen)
    return latent, text


def single_thread():
    """Context for a test module: one intra-op thread (the tiny models are faster so on a busy 2-core box)."""
    import contextlib

    @contextlib.contextmanager
    def _ctx():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return _ctx()
