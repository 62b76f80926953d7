"""Ideogram 4 (`Ideogram4Pipeline`) through the generic program.

Each step calls two denoisers: `transformer` on the text and image tokens, `unconditional_transformer` on the
image tokens alone (asymmetric CFG). Both are intercepted, so concurrent requests share the forwards of each.
"""

import functools

import pytest
import torch
from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline,
                       Ideogram4Transformer2DModel)

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.testing import tiny_qwen2_tokenizer

from .references import TOLERANCE, count_forwards, max_diff, seeded, single_thread, submit_all  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    # name: (transformer config, (height, width))
    "tiny": (dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, mrope_section=(4, 2, 2)), (16, 16)),
    "wide": (dict(num_layers=3, attention_head_dim=8, num_attention_heads=3, mrope_section=(2, 1, 1)), (16, 24)),
}

# A chat template that renders a message whose content is a list of parts (the pipeline builds its messages so)
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def text_encoder(vocab: int):
    """A width-16 Qwen3-VL of 36 layers: the pipeline taps the hidden states of 13 of layers 0..35."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=36, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, vocab_size=vocab, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           patch_size=8, num_position_embeddings=16, deepstack_visual_indexes=[0]))
    torch.manual_seed(1)
    return Qwen3VLModel(config).eval()


@functools.lru_cache(maxsize=None)
def pipe_for(config: str) -> Ideogram4Pipeline:
    transformer_config, _ = CONFIGS[config]
    heads, head_dim = transformer_config["num_attention_heads"], transformer_config["attention_head_dim"]

    def transformer(seed):
        torch.manual_seed(seed)
        return Ideogram4Transformer2DModel(in_channels=4, intermediate_size=2 * heads * head_dim, adaln_dim=32,
                                           llm_features_dim=13 * 16, rope_theta=10000, **transformer_config).eval()

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _TEMPLATE
    torch.manual_seed(2)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                             text_encoder=text_encoder(len(tokenizer)), tokenizer=tokenizer,
                             transformer=transformer(0), unconditional_transformer=transformer(5),
                             prompt_enhancer_head=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def requests(height: int, width: int) -> list[dict]:
    common = dict(height=height, width=width, max_sequence_length=48, guidance_schedule=None, output_type="np")
    return [dict(common, prompt="a red cat", num_inference_steps=2, guidance_scale=4.0, seed=0),
            dict(common, prompt="a dog on the moon", num_inference_steps=3, guidance_scale=2.5, seed=1),
            dict(common, prompt="a blue square", num_inference_steps=3, guidance_scale=None,
                 guidance_schedule=[5.0, 4.0, 2.0], seed=2),
            dict(common, prompt="a cow", num_inference_steps=2, guidance_scale=6.0, seed=3)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_concurrent_requests_equal_their_plain_runs_and_share_both_denoisers(config):
    pipe = pipe_for(config)
    batch = requests(*CONFIGS[config][1])
    conditional, hook = count_forwards(pipe.transformer)
    unconditional, unconditional_hook = count_forwards(pipe.unconditional_transformer)
    try:
        expected = [pipe(**seeded(kwargs)).images for kwargs in batch]
        plain = list(conditional), list(unconditional)
        conditional.clear()
        unconditional.clear()
        with StepBatched(pipe) as sb:
            results = submit_all(sb, batch)
            stats = sb.stats()
    finally:
        hook.remove()
        unconditional_hook.remove()
    for kwargs, result, want in zip(batch, results, expected):
        assert result.images.shape == want.shape
        assert max_diff(result.images, want) <= TOLERANCE, kwargs
    for wrapped, own in zip((conditional, unconditional), plain):
        assert len(wrapped) < len(own) == 10 and max(wrapped) > 1, wrapped
        assert sum(wrapped) == sum(own)  # each row ran once: trusted, no merge is checked against calls apart
    assert not any("merged call raised" in reason for reason in stats["splits"]), stats["splits"]
