"""Tiny FLUX.2 pipelines and inputs shared by the FLUX.2 packing and TeaCache tests."""

import functools

import numpy as np
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
