"""`PiDDecoder`: the PiD pixel-diffusion decoder network (PixelDiT backbone + latent condition adapter).

Our own implementation of the network of the released nvidia/PiD checkpoints (reference: nv-tlabs/PiD,
`PidNet`). Constructor arguments carry the reference names, so a reference config maps one to one, and the
parameter names match the released state dicts after the `net.` prefix is removed (see `hub.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from .adapter import LatentConditionAdapter, build_gate
from .configs import get_official_config
from .hub import (
    DEFAULT_REVISION,
    OFFICIAL_REPO_ID,
    download_official_checkpoint,
    load_official_state_dict,
    read_checkpoint,
    verify_cached_file,
)
from .blocks import PatchBlock, PixelBlock
from .layers import FinalLayer, PixelEmbedder, TimestepEmbedder, TokenEmbedder, patchify, unpatchify_pixels
from .rope import ROPE_MODES, grid_rope, text_rope

__all__ = ["PiDDecoder", "load_official_decoder"]


class PiDDecoder(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="diffusers-stepbatch",
    pipeline_tag="image-to-image",
    tags=["pid", "pixel-diffusion", "super-resolution", "diffusers-stepbatch"],
    paper_url="https://arxiv.org/abs/2605.23902",
):
    """Pixel-space diffusion decoder: low-resolution latent + text embeddings -> image at `sr_scale` x the size.

    Defaults are the released Flux 2k checkpoint (`configs.OFFICIAL_CONFIGS`); arguments that only matter to
    training (`repa_encoder_index`, `zero_init_lq` apart from initialisation, `train_lq_proj_only`,
    `lq_aux_rgb_head_latent_block_idx`, `num_text_blocks`) are kept so reference configs load unchanged.

    >>> decoder = PiDDecoder.from_pretrained("nvidia/PiD", checkpoint="PiD_res2k_sr4x_official_flux_distill_4step")
    >>> velocity = decoder(x_t, t * 1000, text_embeds, lq_latent=latent, degrade_sigma=sigma)
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_groups: int = 24,
        hidden_size: int = 1536,
        pixel_hidden_size: int = 16,
        pixel_attn_hidden_size: int | None = 1152,
        pixel_num_groups: int | None = 16,
        patch_depth: int = 14,
        pixel_depth: int = 2,
        num_text_blocks: int = 4,
        patch_size: int = 16,
        txt_embed_dim: int = 2304,
        txt_max_length: int = 300,
        use_text_rope: bool = True,
        text_rope_theta: float = 10000.0,
        rope_mode: str = "ntk_aware",
        rope_ref_h: int = 1024,
        rope_ref_w: int = 1024,
        repa_encoder_index: int = 6,
        enable_ed: bool = False,
        lq_inject_mode: str = "controlnet",
        lq_in_channels: int = 0,
        lq_latent_channels: int = 16,
        lq_hidden_dim: int = 512,
        lq_num_res_blocks: int = 4,
        lq_latent_unpatchify_factor: int = 1,
        lq_aux_rgb_head: bool = False,
        lq_aux_rgb_head_latent_block_idx: int = -1,
        lq_conv_padding_mode: str = "zeros",
        lq_gate_type: str = "sigma_aware_per_token_per_dim",
        lq_interval: int = 2,
        zero_init_lq: bool = True,
        train_lq_proj_only: bool = False,
        sr_scale: int = 4,
        latent_spatial_down_factor: int = 8,
        pit_lq_inject: bool = False,
    ):
        super().__init__()
        pixel_attn_hidden_size = pixel_attn_hidden_size or hidden_size
        pixel_num_groups = pixel_num_groups or num_groups
        _validate(locals())
        self.in_channels = in_channels
        self.hidden_size = hidden_size
        self.patch_size = patch_size
        self.patch_depth = patch_depth
        self.txt_max_length = txt_max_length
        self.text_head_dim = hidden_size // num_groups
        self.num_groups = num_groups
        self.use_text_rope = use_text_rope
        self.text_rope_theta = text_rope_theta
        self.rope_mode = rope_mode
        self.rope_ref_grid = (rope_ref_h // patch_size, rope_ref_w // patch_size)
        self.lq_interval = lq_interval
        self.sr_scale = sr_scale
        self.latent_spatial_down_factor = latent_spatial_down_factor
        self.lq_latent_channels = lq_latent_channels

        self.pixel_embedder = PixelEmbedder(in_channels, pixel_hidden_size)
        self.s_embedder = TokenEmbedder(in_channels * patch_size**2, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = TokenEmbedder(txt_embed_dim, hidden_size, norm=True)
        self.y_pos_embedding = nn.Parameter(torch.randn(1, txt_max_length, hidden_size))
        self.patch_blocks = nn.ModuleList(PatchBlock(hidden_size, num_groups) for _ in range(patch_depth))
        self.pixel_blocks = nn.ModuleList(
            PixelBlock(
                pixel_hidden_size,
                hidden_size,
                patch_size,
                pixel_attn_hidden_size,
                pixel_num_groups,
                rope_mode=rope_mode,
                rope_ref_grid=self.rope_ref_grid,
            )
            for _ in range(pixel_depth)
        )
        self.final_layer = FinalLayer(pixel_hidden_size, in_channels)
        self.lq_proj = LatentConditionAdapter(
            latent_channels=lq_latent_channels,
            hidden_dim=lq_hidden_dim,
            out_dim=hidden_size,
            patch_size=patch_size,
            sr_scale=sr_scale,
            latent_spatial_down_factor=latent_spatial_down_factor,
            unpatchify_factor=lq_latent_unpatchify_factor,
            num_res_blocks=lq_num_res_blocks,
            num_outputs=-(-patch_depth // lq_interval),
            gate_type=lq_gate_type,
            padding_mode=lq_conv_padding_mode,
            pixel_output=pit_lq_inject,
            aux_rgb_head=lq_aux_rgb_head,
        )
        self.pit_lq_gate = build_gate(lq_gate_type, hidden_size) if pit_lq_inject else None
        self._init_weights(zero_init_lq)

    def _init_weights(self, zero_init_lq: bool) -> None:
        # NOTE: only shapes a fresh (trainable) decoder; released checkpoints overwrite everything.
        nn.init.xavier_uniform_(self.s_embedder.proj.weight)
        nn.init.zeros_(self.s_embedder.proj.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
        for module in self.lq_proj.latent_proj.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        heads = list(self.lq_proj.output_heads)
        if self.lq_proj.pit_head is not None:
            heads.append(self.lq_proj.pit_head)
        for head in heads:
            if zero_init_lq:
                nn.init.zeros_(head.weight)
            else:
                nn.init.trunc_normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)

    @property
    def latent_scale(self) -> int:
        """Output pixels per latent pixel: `sr_scale * latent_spatial_down_factor`."""
        return self.sr_scale * self.latent_spatial_down_factor

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        lq_latent: torch.Tensor | None = None,
        degrade_sigma: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the velocity (noise - image) for a noisy image.

        Args:
            x: noisy image [B, 3, H, W], H and W multiples of `patch_size`.
            t: [B] timesteps in the network's units (flow time x 1000; `sampler.py` scales them).
            y: text embeddings [B, L, txt_embed_dim]; only the first `txt_max_length` tokens are used.
            lq_latent: the low-resolution latent [B, lq_latent_channels, h, w]; None runs unconditioned.
            degrade_sigma: [B] noise level of each row's latent (0 for a clean latent); needed with `lq_latent`.
        """
        b, _, h, w = x.shape
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"image size {h}x{w} must be a multiple of patch_size={self.patch_size}")
        if y.dim() != 3:
            raise ValueError(f"text embeddings must be [B, L, D], got shape {tuple(y.shape)}")
        grid = (h // self.patch_size, w // self.patch_size)
        device = x.device

        lq_tokens, lq_pixel_tokens = None, None
        if lq_latent is not None:
            if degrade_sigma is None:
                raise ValueError("degrade_sigma ([B], 0 for a clean latent) is required with lq_latent")
            degrade_sigma = torch.as_tensor(degrade_sigma, device=device).reshape(-1).expand(b)
            lq_tokens, lq_pixel_tokens = self.lq_proj(lq_latent, grid)

        t_emb = self.t_embedder(t.reshape(-1).expand(b)).view(b, 1, self.hidden_size)
        cond = F.silu(t_emb)
        n_text = min(y.shape[1], self.txt_max_length)
        text = self.y_embedder(y[:, :n_text])
        text = text + self.y_pos_embedding[:, :n_text].to(text.dtype)
        rope_x = grid_rope(
            self.text_head_dim,
            *grid,
            mode=self.rope_mode,
            ref_height=self.rope_ref_grid[0],
            ref_width=self.rope_ref_grid[1],
            device=device,
        )
        rope_y = text_rope(self.text_head_dim, n_text, theta=self.text_rope_theta, device=device)
        rope_y = rope_y if self.use_text_rope else None

        tokens = self.s_embedder(patchify(x, self.patch_size))
        for i, block in enumerate(self.patch_blocks):
            if lq_tokens is not None and i % self.lq_interval == 0:
                index = i // self.lq_interval
                tokens = self.lq_proj.inject(index, tokens, lq_tokens[index], degrade_sigma)
            tokens, text = block(tokens, text, cond, rope_x, rope_y)
        tokens = F.silu(t_emb + tokens)
        if self.pit_lq_gate is not None and lq_pixel_tokens is not None:
            tokens = self.pit_lq_gate(tokens, lq_pixel_tokens, degrade_sigma)

        pixel_cond = tokens.reshape(-1, self.hidden_size)
        pixels = self.pixel_embedder(x, self.patch_size)
        for block in self.pixel_blocks:
            pixels = block(pixels, pixel_cond, grid)
        return unpatchify_pixels(self.final_layer(pixels), b, h, w, self.patch_size)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        checkpoint: str | None = None,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        **model_kwargs: Any,
    ) -> "PiDDecoder":
        """Load our own format (config.json + model.safetensors), or a released checkpoint by name.

        With `checkpoint`, `revision` defaults to `hub.DEFAULT_REVISION` and extra keyword arguments go to
        `load_official_decoder` (`torch_dtype`, `device`, `verify_checksum`, config overrides).

        >>> PiDDecoder.from_pretrained("my-org/pid-toy-adapter")                      # our format
        >>> PiDDecoder.from_pretrained("nvidia/PiD", checkpoint="PiD_v1pt5_res2kto4k_sr4x_official_flux_distill_4step")
        """
        if checkpoint is not None:
            return load_official_decoder(
                checkpoint,
                repo_id=str(pretrained_model_name_or_path),
                # NOTE: pinned unless asked otherwise; pass revision="main" for the newest files.
                revision=revision or DEFAULT_REVISION,
                cache_dir=cache_dir,
                force_download=force_download,
                local_files_only=local_files_only,
                token=token,
                **model_kwargs,
            )
        return super().from_pretrained(
            pretrained_model_name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
            **model_kwargs,
        )

    @classmethod
    def _from_pretrained(cls, *, strict: bool = True, **kwargs: Any) -> "PiDDecoder":
        # NOTE: the mixin loads non-strictly by default; a decoder with silently random layers is worse than an error.
        return super()._from_pretrained(strict=strict, **kwargs)


def _validate(args: dict[str, Any]) -> None:
    """Reject configurations this implementation does not build, naming the value and the fix."""
    checks = [
        (args["lq_inject_mode"] == "controlnet", "lq_inject_mode={!r}: only 'controlnet' exists", "lq_inject_mode"),
        (args["lq_in_channels"] == 0, "lq_in_channels={!r}: released PiD is latent-only; use 0", "lq_in_channels"),
        (args["lq_latent_channels"] > 0, "lq_latent_channels={!r} must be > 0", "lq_latent_channels"),
        (not args["enable_ed"], "enable_ed={!r}: the encoder-decoder variant is not supported", "enable_ed"),
        (args["pixel_depth"] > 0, "pixel_depth={!r} must be > 0", "pixel_depth"),
        (args["lq_interval"] > 0, "lq_interval={!r} must be > 0", "lq_interval"),
        (args["rope_mode"] in ROPE_MODES, f"rope_mode={{!r}} is not supported; use one of {ROPE_MODES}", "rope_mode"),
    ]
    for ok, message, name in checks:
        if not ok:
            raise ValueError(message.format(args[name]))
    for dim, heads in (("hidden_size", "num_groups"), ("pixel_attn_hidden_size", "pixel_num_groups")):
        if args[dim] % args[heads] or (args[dim] // args[heads]) % 4:
            raise ValueError(
                f"{dim}={args[dim]} must be {heads}={args[heads]} times a multiple of 4 (the 2D RoPE head size)"
            )


def _to(value: Any, device: str | torch.device, dtype: torch.dtype) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)


def load_official_decoder(
    checkpoint: str,
    *,
    repo_id: str = OFFICIAL_REPO_ID,
    revision: str | None = DEFAULT_REVISION,
    cache_dir: str | Path | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    verify_checksum: bool = True,
    **config_overrides: Any,
) -> "PiDDecoder":
    """Build the network of a released checkpoint and load its weights (the layout: `hub.py`).

    `torch_dtype=torch.bfloat16` keeps the file's own precision; `config_overrides` replace table values
    (for a checkpoint whose layout differs from the table; a strict load still checks every key).

    >>> decoder = load_official_decoder("PiD_res2k_sr4x_official_flux_distill_4step")
    """
    entry = get_official_config(checkpoint)
    path = download_official_checkpoint(
        checkpoint,
        repo_id=repo_id,
        revision=revision,
        cache_dir=cache_dir,
        force_download=force_download,
        local_files_only=local_files_only,
        token=token,
    )
    if verify_checksum:
        verify_cached_file(path)
    state = read_checkpoint(path)
    # NOTE: build on the meta device and assign the checkpoint's tensors: no random init of ~1.3B parameters.
    with torch.device("meta"):
        model = PiDDecoder(**{**entry.constructor, **config_overrides})
    state = {k: _to(v, device, torch_dtype) for k, v in state.items()}
    load_official_state_dict(model, state, source=f"{repo_id}/{entry.filename}", assign=True)
    return model.eval()
