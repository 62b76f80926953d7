"""Tiny FLUX.2 pipelines and inputs shared by the FLUX.2 packing and TeaCache tests."""

import functools

import numpy as np
import torch
from diffusers import Flux2Transformer2DModel
from PIL import Image

from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_flux2_pipeline

# configs: attention heads, head dim, RoPE axes (4 axes: time, height, width, text position), VAE blocks (3: a
# latent of a quarter of the image's sides)
CONFIGS = {"narrow": dict(heads=2, head_dim=16, axes_dims=(4, 4, 4, 4)),
           "wide": dict(heads=4, head_dim=8, axes_dims=(2, 2, 2, 2), vae_blocks=3)}
BUILDERS = {"klein": tiny_flux2_klein_pipeline, "dev": tiny_flux2_pipeline}
COMMON = dict(output_type="pt", text_encoder_out_layers=(1,), max_sequence_length=32)


@functools.cache
def flux2_pipe(variant, config):
    return BUILDERS[variant](**CONFIGS[config])


def reference_image(height, width, seed):
    # NOTE: the FLUX.2 image processor wants both sides >= 64 px
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def flux2_transformer(config, guidance_embeds):
    """A tiny `Flux2Transformer2DModel` of `CONFIGS[config]`."""
    spec = CONFIGS[config]
    torch.manual_seed(0)
    return Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                   attention_head_dim=spec["head_dim"], num_attention_heads=spec["heads"],
                                   joint_attention_dim=16, axes_dims_rope=list(spec["axes_dims"]),
                                   guidance_embeds=guidance_embeds).eval()


def flux2_call(model, rows=3, height=3, width=4, references=((2, 2),), text=5):
    """A call as the FLUX.2 pipelines make it: an edit row's reference tokens appended, with their own ids."""
    def grid(h, w, t):
        return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1))

    generator = torch.Generator().manual_seed(1)
    img_ids = torch.cat([grid(height, width, 0)] + [grid(h, w, 10 + 10 * i) for i, (h, w) in enumerate(references)])
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
    guidance = 4 * torch.rand(rows, generator=generator) if model.config.guidance_embeds else None
    return dict(hidden_states=torch.randn(rows, img_ids.shape[0], 4, generator=generator),
                encoder_hidden_states=torch.randn(rows, text, 16, generator=generator),
                timestep=torch.rand(rows, generator=generator), guidance=guidance,
                img_ids=img_ids[None].expand(rows, -1, -1), txt_ids=txt_ids[None].expand(rows, -1, -1),
                return_dict=False)
