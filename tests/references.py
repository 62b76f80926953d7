"""Helpers shared by all tests: tiny offline pipelines (cached per config) and comparisons."""

import functools

import torch

from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline

TOLERANCE = 1e-4  # max abs difference against the unwrapped diffusers pipeline, fp32 on CPU

FLUX_CONFIGS = {
    # name: (guidance_embeds, transformer size, vae_blocks)
    "dev-tiny": (True, FluxSize(), 2),
    "schnell-tiny": (False, FluxSize(), 2),
    "dev-wide": (True, FluxSize(num_layers=2, num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                joint_attention_dim=24, pooled_projection_dim=40, in_channels=8), 3),
}


@functools.lru_cache(maxsize=None)
def flux_pipe(name: str = "dev-tiny"):
    guidance_embeds, size, vae_blocks = FLUX_CONFIGS[name]
    return tiny_flux_pipeline(guidance_embeds=guidance_embeds, size=size, vae_blocks=vae_blocks)


def seeded(kwargs: dict) -> dict:
    """Replace an int `seed` entry by a fresh torch.Generator (generators are consumed by a call)."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return kwargs


def max_diff(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def count_forwards(module: torch.nn.Module):
    """Record the batch size of every forward of `module`; returns (list, hook handle)."""
    sizes: list[int] = []

    def hook(_module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        sizes.append(int(hidden.shape[0]))

    return sizes, module.register_forward_pre_hook(hook, with_kwargs=True)
