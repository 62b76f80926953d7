"""Bria FIBO 2 (`BriaFibo2Pipeline`) through the generic program.

Text-to-image requests whose prompts have one token count share the Qwen3-VL text encoder's and the transformer's
forwards. Edit requests of one image hand Qwen3-VL equal `pixel_values`, but its image patches are one sequence for
the whole call, not rows: those encoder calls run alone by rule (never merged, never a failed merge), while the
transformer's calls still share forwards.
"""

import functools
import json

import numpy as np
import pytest
import torch
from diffusers import (AutoencoderKLFlux2, BriaFibo2Pipeline, BriaFibo2Transformer2DModel,
                       FlowMatchEulerDiscreteScheduler)
from PIL import Image

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.testing.image_models import tiny_chat_tokenizer

from .references import TOLERANCE, max_diff, plain_and_wrapped, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT_HIDDEN = 8  # the transformer's cap_feat_dim is 3 * TEXT_HIDDEN: each text input bundles three encoder layers

CONFIGS = {
    # name: (transformer config, (height, width))
    "tiny": (dict(dim=32, n_layers=3, injection_layer_ids=(0, 1, 2, 2, 1), axes_dims=(4, 6, 6)), (16, 16)),
    "wide": (dict(dim=48, n_layers=2, injection_layer_ids=(0, 1, 1, 0, 1), axes_dims=(8, 8, 8)), (16, 32)),
}


def processor_and_text_encoder():
    """A Qwen3-VL processor (PIL images, 16 px patches, at most 4 image tokens) and a 36-layer width-8 Qwen3-VL: the
    pipeline reads hidden states of layers 5..35."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageTextProcessor(Qwen3VLProcessor):
        """Without the video processor (it needs torchvision; the pipeline passes no videos)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)

    tokenizer = tiny_chat_tokenizer()
    processor = ImageTextProcessor(image_processor=Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=32 * 32 * 4, patch_size=16, merge_size=2), tokenizer=tokenizer,
        chat_template=tokenizer.chat_template)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=16, num_hidden_layers=36, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, vocab_size=len(tokenizer), max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[]),
        image_token_id=token("<|image_pad|>"), vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"))
    torch.manual_seed(1)
    return processor, Qwen3VLForConditionalGeneration(config).eval()


@functools.lru_cache(maxsize=None)
def pipe_for(config: str) -> BriaFibo2Pipeline:
    transformer_config, _ = CONFIGS[config]
    processor, text_encoder = processor_and_text_encoder()
    torch.manual_seed(0)
    transformer = BriaFibo2Transformer2DModel(
        in_channels=4, patch_size=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=3 * TEXT_HIDDEN,
        perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=12, gist_step=4, gist_min_text_len=20,
        gist_max_text_len=200, axes_lens=(64, 32, 32), **transformer_config).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3,
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(4, 8), layers_per_block=1, latent_channels=4, norm_num_groups=1,
                             use_quant_conv=False, use_post_quant_conv=False).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    pipe = BriaFibo2Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def caption(description: str) -> str:
    return json.dumps({"short_description": description, "style_medium": "photograph"})


def edit_image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((32, 32, 3)) * 255).astype("uint8"))


def run_both(pipe, batch: list[dict]):
    """Each request of `batch` equal to its plain run, and transformer forwards of several rows; (plain transformer
    forwards, wrapped ones, stats)."""
    runs = plain_and_wrapped(pipe, batch)
    for kwargs, result, want in zip(batch, runs.wrapped, runs.plain):
        assert result.images.shape == want.images.shape
        assert max_diff(result.images, want.images) <= TOLERANCE, kwargs["prompt"]
    assert max(runs.wrapped_rows) > 1, runs.wrapped_rows
    assert not any("merged call raised" in reason for reason in runs.stats["splits"]), runs.stats["splits"]
    return runs.plain_rows, runs.wrapped_rows, runs.stats


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_text_to_image_requests_equal_their_plain_runs_and_share_forwards(config):
    height, width = CONFIGS[config][1]
    common = dict(height=height, width=width, output_type="np")
    batch = [dict(common, prompt=caption("a red bike"), num_inference_steps=2, guidance_scale=4.0, seed=0),
             dict(common, prompt=caption("a tan boat"), num_inference_steps=3, guidance_scale=3.0, seed=1),
             dict(common, prompt=caption("a big cake"), num_inference_steps=2, guidance_scale=1.0, seed=2),
             dict(common, prompt=caption("an old cat"), num_inference_steps=3, guidance_scale=5.0, seed=3,
                  negative_prompt=caption("a blur")),
             dict(common, prompt=caption("a much longer description of a car"), num_inference_steps=2, seed=4)]
    plain_sizes, sizes, stats = run_both(pipe_for(config), batch)
    assert len(sizes) < len(plain_sizes)
    assert max(stats["rows_histogram"]["encode"]) > 1  # prompts of one token count encode together


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_edits_of_one_image_encode_apart_by_rule_and_share_the_transformer(config):
    """Equal images make equal `pixel_values`: a merged Qwen3-VL call would hold one image's patches for two rows."""
    image = edit_image(0)
    height, width = CONFIGS[config][1]
    common = dict(image=image, height=height, width=width, output_type="np")
    batch = [dict(common, prompt="make it blue", num_inference_steps=2, guidance_scale=4.0, seed=0),
             dict(common, prompt="make it pink", num_inference_steps=3, guidance_scale=3.0, seed=1),
             dict(common, prompt="add a hat on", num_inference_steps=2, guidance_scale=1.0, seed=2)]
    pipe = pipe_for(config)
    image_calls = []  # rows of each Qwen3-VL call that sees the image

    def record(_module, args, kwargs):
        if kwargs.get("pixel_values") is not None:
            image_calls.append(int(kwargs.get("input_ids", args[0] if args else None).shape[0]))

    hook = pipe.text_encoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _, _, stats = run_both(pipe, batch)
    finally:
        hook.remove()
    assert image_calls == [1] * 2 * len(batch), image_calls  # plain, then wrapped: one prompt per call
    assert any("Qwen3-VL image patches are one sequence" in reason for reason in stats["splits"]), stats["splits"]


@pytest.mark.parametrize("sized", [True, False])
@pytest.mark.parametrize("image", ["single", "list"])
def test_a_bad_edit_prompt_is_refused_at_submit_with_the_pipelines_message(image, sized):
    """`__call__` wraps a single image in a list before its check, and takes the size from the image when none is
    given: the caller-side check does both, so a bad edit fails before it is queued, whatever form it takes."""
    pipe = pipe_for("tiny")
    height, width = CONFIGS["tiny"][1]
    reference = edit_image(0)
    kwargs = dict(prompt=caption("a red bike"), image=reference if image == "single" else [reference],
                  num_inference_steps=2, output_type="np", **(dict(height=height, width=width) if sized else {}))
    with pytest.raises(ValueError, match="edit_instruction") as plain:
        pipe(**kwargs)
    with StepBatched(pipe) as sb, pytest.raises(ValueError, match="edit_instruction") as wrapped:
        sb.submit(**kwargs)  # raises here, in the caller, not from the request's result
    assert str(wrapped.value) == str(plain.value)
