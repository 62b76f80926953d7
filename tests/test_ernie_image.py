"""ERNIE-Image (`ErnieImagePipeline`) through the generic program and `models/ernie_image.py`: prompts of other
token counts share forwards, their text zero-padded to the longest of the call and masked by the model."""

import functools

import pytest
import torch
from diffusers import AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel
from diffusers import FlowMatchEulerDiscreteScheduler

from diffusers_stepbatch.testing import tiny_qwen2_tokenizer

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

# transformer width, heads, RoPE axes, layers, VAE blocks (each after the first halves the latent's sides)
CONFIGS = {"narrow": (32, 2, (8, 4, 4), 2, 1), "wide": (48, 3, (4, 6, 6), 3, 2)}


def _text_encoder(vocab: int, hidden: int):
    from transformers import Mistral3Config, Mistral3Model, MistralConfig, PixtralVisionConfig

    text = MistralConfig(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=hidden // 2, vocab_size=vocab, max_position_embeddings=512)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8, head_dim=8)
    return Mistral3Model(Mistral3Config(text_config=text, vision_config=vision)).eval()


@functools.lru_cache(maxsize=None)
def tiny_ernie_image_pipeline(config: str) -> ErnieImagePipeline:
    width, heads, axes, layers, vae_blocks = CONFIGS[config]
    tokenizer = tiny_qwen2_tokenizer()
    torch.manual_seed(1)
    text_encoder = _text_encoder(len(tokenizer), 16)
    torch.manual_seed(0)
    transformer = ErnieImageTransformer2DModel(
        hidden_size=width, num_attention_heads=heads, num_layers=layers, ffn_hidden_size=width * 2, in_channels=4,
        out_channels=4, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=axes).eval()
    with torch.no_grad():  # NOTE: the model zero-inits its modulation and output layers: its output would be 0
        for layer in (transformer.adaLN_modulation[-1], transformer.final_linear):
            layer.weight.normal_(0, 0.05)
            layer.bias.normal_(0, 0.05)
    torch.manual_seed(2)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3,
                             down_block_types=("DownEncoderBlock2D",) * vae_blocks,
                             up_block_types=("UpDecoderBlock2D",) * vae_blocks, block_out_channels=(4,) * vae_blocks,
                             layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    pipe = ErnieImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              scheduler=FlowMatchEulerDiscreteScheduler(), pe=None, pe_tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("size", [(16, 16), (24, 32)])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_prompts_of_other_lengths_share_forwards_and_equal_their_plain_runs(config, size):
    pipe = tiny_ernie_image_pipeline(config)
    height, width = size
    common = dict(height=height, width=width, output_type="pt")
    requests = [dict(common, prompt="a red cat", negative_prompt="bad", num_inference_steps=3, seed=0),
                dict(common, prompt="a dog on the moon at night", num_inference_steps=4, seed=1, guidance_scale=3.0),
                dict(common, prompt="x", negative_prompt="blurry and dark", num_inference_steps=3, seed=2),
                dict(common, prompt="two birds", num_inference_steps=2, seed=3, guidance_scale=1.0)]
    runs = plain_and_wrapped(pipe, requests)
    for result, plain in zip(runs.wrapped, runs.plain):
        assert max_diff(result.images, plain.images) <= TOLERANCE
    # more rows than one request's CFG pair: prompts of other lengths in one call
    assert max(runs.wrapped_rows) >= 3, runs.wrapped_rows
    assert not any("text_bth" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
