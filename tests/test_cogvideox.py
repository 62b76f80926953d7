"""CogVideoX text- and image-to-video requests share forwards and equal their plain runs.

The model applies one `(cos, sin)` RoPE pair of `[tokens, dim]` to every row; a video of as many latent tokens as
its call has rows (a 1x1 patch grid, one token per frame) made that pair look like row inputs, and merged calls
raised. `models/cogvideox.py` shares it.
"""

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_stepbatch.testing import tiny_t5_encoder, tiny_t5_tokenizer

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@functools.lru_cache(maxsize=None)
def _pipe(image_to_video: bool, head_dim: int):
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=head_dim, in_channels=8 if image_to_video else 4, out_channels=4,
        time_embed_dim=2, text_embed_dim=32, num_layers=1, sample_width=2, sample_height=2, sample_frames=9,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=image_to_video).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                 latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, temporal_compression_ratio=4).eval()
    tokenizer = tiny_t5_tokenizer()
    pipeline_class = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    pipe = pipeline_class(tokenizer=tokenizer, text_encoder=tiny_t5_encoder(tokenizer), vae=vae,
                          transformer=transformer, scheduler=CogVideoXDDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("image_to_video", [False, True])
@pytest.mark.parametrize("frames", [8, 16])  # 2 and 4 latent frames of one token: as many tokens as a call's rows
def test_requests_share_forwards_and_equal_plain_runs(image_to_video, head_dim, frames):
    pipe = _pipe(image_to_video, head_dim)
    requests = [dict(prompt=prompt, negative_prompt="", height=16, width=16, num_frames=frames,
                     num_inference_steps=2 + i % 2, guidance_scale=6.0 + i, max_sequence_length=16,
                     output_type="pt", seed=i) for i, prompt in enumerate(("a cat", "a dog", "an owl", "a fox"))]
    if image_to_video:
        for i, request in enumerate(requests):
            request["image"] = _image(i)
    runs = plain_and_wrapped(pipe, requests, max_batch_size=8)
    assert max(max_diff(got.frames, want.frames) for got, want in zip(runs.wrapped, runs.plain)) <= TOLERANCE
    assert max(runs.wrapped_rows) > 2, f"no forward held several requests' rows: {runs.wrapped_rows}"
    assert not any("raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
