"""Constructor values of the released nvidia/PiD checkpoints.

A released `model_ema_bf16.pth` holds weights only, so the network shape comes from this table. Values are
read from the reference repository nv-tlabs/PiD at commit `REFERENCE_COMMIT`: the net presets in
`pid/_src/configs/common/defaults/net.py` (`PID_SR4X`, `PID_SR4X_V1PT5`, `PID_SR4X_V1PT5_FOR_FLUX2`), the
per-experiment `net` overrides in `pid/_src/configs/pid/experiment_*/<family>.py`, and `PidNet`'s own
defaults (`pid/_src/networks/pid_net.py`) for arguments no preset sets (rope_mode, rope_ref_*,
lq_num_res_blocks, latent_spatial_down_factor, num_text_blocks).

>>> from diffusers_stepbatch.decoders.pid.configs import get_official_config
>>> get_official_config("PiD_res2k_sr4x_official_flux_distill_4step").constructor["hidden_size"]
1536
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["OFFICIAL_CONFIGS", "OfficialCheckpoint", "REFERENCE_COMMIT", "get_official_config"]

REFERENCE_COMMIT = "2c8814c2b91cc41a2be7809962c891e0d0ccff5f"
_NET_PY = "pid/_src/configs/common/defaults/net.py"

# `PID_SR4X` plus the `PidNet` defaults it relies on.
_V1: dict[str, Any] = dict(
    in_channels=3,
    num_groups=24,
    hidden_size=1536,
    pixel_hidden_size=16,
    pixel_attn_hidden_size=1152,
    pixel_num_groups=16,
    patch_depth=14,
    pixel_depth=2,
    num_text_blocks=4,
    patch_size=16,
    txt_embed_dim=2304,
    txt_max_length=300,
    use_text_rope=True,
    text_rope_theta=10000.0,
    rope_mode="ntk_aware",
    rope_ref_h=1024,
    rope_ref_w=1024,
    repa_encoder_index=6,
    lq_inject_mode="controlnet",
    lq_in_channels=0,
    lq_latent_channels=16,
    lq_hidden_dim=512,
    lq_num_res_blocks=4,
    lq_latent_unpatchify_factor=1,
    lq_aux_rgb_head=False,
    lq_aux_rgb_head_latent_block_idx=-1,
    lq_conv_padding_mode="zeros",
    lq_gate_type="sigma_aware_per_token_per_dim",
    lq_interval=2,
    zero_init_lq=True,
    train_lq_proj_only=False,
    sr_scale=4,
    latent_spatial_down_factor=8,
    pit_lq_inject=False,
)

# `PID_SR4X_V1PT5`; the v1.5 experiments set train_lq_proj_only back to False.
_V1PT5: dict[str, Any] = {
    **_V1,
    "lq_conv_padding_mode": "replicate",
    "rope_mode": "ntk_aware",
    "rope_ref_h": 2048,
    "rope_ref_w": 2048,
    "lq_aux_rgb_head": True,
    "pit_lq_inject": True,
    "lq_gate_type": "sigma_aware_per_token",
    "lq_interval": 2,
    "lq_hidden_dim": 1024,
    "lq_num_res_blocks": 4,
}


@dataclass(frozen=True)
class OfficialCheckpoint:
    """One released checkpoint: where it lives, what latent it decodes, and the network that loads it.

    Args:
        name: folder under `checkpoints/` in the Hub repository `nvidia/PiD`.
        families: main models whose latents it decodes (reference backbone tags).
        constructor: `PiDDecoder(**constructor)` builds the matching network.
        latent_frame: "flow" (x_t = (1 - s) x0 + s eps, scheduler sigma as is) or "vp" (SDXL: Euler latents and
            sigmas are divided by sqrt(sigma^2 + 1) before decoding).
        source: the reference config files the values come from.
    """

    name: str
    families: tuple[str, ...]
    constructor: Mapping[str, Any]
    latent_frame: str = "flow"
    source: str = ""
    notes: str = field(default="", compare=False)

    @property
    def filename(self) -> str:
        return f"checkpoints/{self.name}/model_ema_bf16.pth"


def _entry(name: str, families: tuple[str, ...], base: dict, overrides: dict, source: str, **kw) -> OfficialCheckpoint:
    return OfficialCheckpoint(
        name=name,
        families=families,
        constructor=MappingProxyType({**base, **overrides}),
        source=f"{source} @ nv-tlabs/PiD {REFERENCE_COMMIT[:7]}",
        **kw,
    )


_CHECKPOINTS = [
    _entry(
        "PiD_res2k_sr4x_official_flux_distill_4step",
        ("flux", "zimage", "zimage-turbo"),
        _V1,
        {},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2k/flux.py",
    ),
    _entry(
        "PiD_res2k_sr4x_official_flux2_distill_4step",
        ("flux2", "flux2-klein-4b", "flux2-klein-9b"),
        _V1,
        {"lq_latent_channels": 128, "latent_spatial_down_factor": 16},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2k/flux2.py",
        notes="takes Flux.2's packed, BN-normalised [B, 128, H/16, W/16] latent",
    ),
    _entry(
        "PiD_res2k_sr4x_official_sd3_distill_4step",
        ("sd3",),
        _V1,
        {},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2k/sd3.py",
    ),
    _entry(
        "PiD_res2kto4k_sr4x_official_sd3_distill_4step",
        ("sd3",),
        _V1,
        {},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2kto4k/sd3.py",
    ),
    _entry(
        "PiD_res2kto4k_sr4x_official_sdxl_distill_4step",
        ("sdxl",),
        _V1,
        {"lq_latent_channels": 4},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2kto4k/sdxl.py",
        latent_frame="vp",
    ),
    _entry(
        "PiD_v1pt5_res2kto4k_sr4x_official_flux_distill_4step",
        ("flux", "zimage", "zimage-turbo"),
        _V1PT5,
        {},
        f"{_NET_PY} PID_SR4X_V1PT5; pid/_src/configs/pid/experiment_2kto4k_v1pt5/flux.py",
    ),
    _entry(
        "PiD_v1pt5_res2kto4k_sr4x_official_flux2_distill_4step",
        ("flux2", "flux2-klein-4b", "flux2-klein-9b"),
        _V1PT5,
        {"lq_latent_channels": 128, "latent_spatial_down_factor": 16, "lq_latent_unpatchify_factor": 2},
        f"{_NET_PY} PID_SR4X_V1PT5_FOR_FLUX2; pid/_src/configs/pid/experiment_2kto4k_v1pt5/flux2.py",
    ),
    _entry(
        "PiD_v1pt5_res2kto4k_sr4x_official_qwenimage_distill_4step",
        ("qwenimage", "qwenimage-2512"),
        _V1PT5,
        {},
        f"{_NET_PY} PID_SR4X_V1PT5; pid/_src/configs/pid/experiment_2kto4k_v1pt5/qwenimage.py",
    ),
    _entry(
        "PiD_res2k_sr4x_official_dinov2_distill_4step",
        ("dinov2",),
        _V1,
        {"lq_latent_channels": 768, "latent_spatial_down_factor": 16},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2k/rae.py",
    ),
    _entry(
        "PiD_res2k_sr8x_official_siglip_distill_4step",
        ("siglip",),
        _V1,
        {"lq_latent_channels": 1152, "latent_spatial_down_factor": 16, "sr_scale": 8},
        f"{_NET_PY} PID_SR4X; pid/_src/configs/pid/experiment_2k/scale_rae.py",
    ),
]

OFFICIAL_CONFIGS: Mapping[str, OfficialCheckpoint] = MappingProxyType({c.name: c for c in _CHECKPOINTS})


def get_official_config(checkpoint: str) -> OfficialCheckpoint:
    """The table entry for a released checkpoint name; a ValueError lists the known names."""
    try:
        return OFFICIAL_CONFIGS[checkpoint]
    except KeyError:
        known = ", ".join(sorted(OFFICIAL_CONFIGS))
        raise ValueError(f"checkpoint={checkpoint!r} is not a known nvidia/PiD checkpoint; known: {known}") from None
