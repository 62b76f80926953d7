"""The shipped toy-shapes FLUX pipeline: scene grammar, pixel judge, and its quality targets at every size.

Quality is measured on held-out captions (never used in training) with the plain diffusers pipeline, seeded.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from diffusers_stepbatch.toy import DEFAULT_GUIDANCE, DEFAULT_STEPS, MAX_SEQUENCE_LENGTH, WEIGHTS_DIR, load_pipeline
from diffusers_stepbatch.toy.build import JUDGED_SIZES
from diffusers_stepbatch.toy.judge import evaluate_vae, judge_image, score_images
from diffusers_stepbatch.toy.scenes import (
    COLORS,
    POSITIONS,
    Scene,
    all_captions,
    caption,
    heldout_captions,
    parse_caption,
    render_scene,
    sample_scene,
    train_captions,
)

# --- scenes and judge (fast) ---


def test_caption_grammar_round_trips():
    captions = all_captions()
    assert len(captions) == len(set(captions)) == 440  # (6 colours x 3 + 2 x 2 backgrounds) x 4 shapes x 5 positions
    for text in captions:
        assert caption(parse_caption(text)) == text


@pytest.mark.parametrize(
    "text",
    ["a red circle at the top on a white background", "a pink circle in the center on a white background", "red circle"],
)
def test_parse_caption_rejects_other_text(text):
    with pytest.raises(ValueError, match="caption|color"):
        parse_caption(text)


def test_scene_rejects_colour_equal_to_background():
    with pytest.raises(ValueError, match="background='white'"):
        Scene("white", "circle", "in the center", "white")


def test_heldout_split_is_disjoint_and_covers_every_colour_and_position():
    held, train = heldout_captions(), train_captions()
    assert len(held) == 80 and not set(held) & set(train) and len(held) + len(train) == 440
    pairs = {(s.color, s.position) for s in map(parse_caption, held)}
    assert pairs == {(c, p) for c in COLORS for p in POSITIONS}


def test_render_is_deterministic_and_resolution_independent():
    scene = sample_scene(np.random.default_rng(7))
    assert sample_scene(np.random.default_rng(7)) == scene
    small = np.asarray(render_scene(scene, 64), dtype=np.float32)
    large = np.asarray(render_scene(scene, 256), dtype=np.float32)
    assert large.shape == (256, 256, 3)
    downsampled = large.reshape(64, 4, 64, 4, 3).mean(axis=(1, 3))
    assert np.abs(downsampled - small).mean() < 1.0  # out of 255


@pytest.mark.parametrize("size", [64, 256])
def test_judge_reads_renders_correctly(size):
    rng = np.random.default_rng(size)
    scenes = [sample_scene(rng) for _ in range(200)]
    verdicts = [judge_image(render_scene(scene, size)) for scene in scenes]
    assert [v.color for v in verdicts] == [s.color for s in scenes]
    assert [v.position for v in verdicts] == [s.position for s in scenes]


def test_judge_finds_nothing_on_a_blank_image():
    verdict = judge_image(np.full((64, 64, 3), 128, dtype=np.uint8))
    assert verdict.color is None and verdict.position is None and verdict.foreground_fraction == 0.0


# --- the shipped weights ---


@pytest.fixture(scope="module")
def pipe():
    # NOTE: runs on the test run's one intra-op thread (conftest): on a shared 2-core CPU a second thread made
    # the 80-image generation slower, not faster.
    return load_pipeline()


def test_weights_are_small_safetensors_in_diffusers_layout():
    files = [p for p in WEIGHTS_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    for folder in ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        assert (WEIGHTS_DIR / folder).is_dir(), folder


def test_pipeline_components(pipe):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from diffusers_stepbatch.programs import program_for
    from diffusers_stepbatch.programs.dedicated import flux
    from diffusers_stepbatch.toy.pipeline import ToyFluxPipeline

    assert type(pipe) is ToyFluxPipeline and isinstance(pipe, FluxPipeline)
    assert "__call__" not in vars(ToyFluxPipeline) and program_for(pipe) is flux.plan_flux
    assert isinstance(pipe.transformer, FluxTransformer2DModel) and pipe.transformer.config.guidance_embeds
    assert isinstance(pipe.vae, AutoencoderKL) and pipe.vae.config.latent_channels == 16
    assert pipe.vae_scale_factor == 8
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    # one token per word, so every caption fits the 16-token budget of both encoders
    for text in all_captions():
        assert len(pipe.tokenizer(text).input_ids) == len(text.split()) + 2
        assert len(pipe.tokenizer_2(text).input_ids) == len(text.split()) + 1 <= MAX_SEQUENCE_LENGTH


def test_plain_call_defaults_to_native_size(pipe):
    image = pipe(
        "a blue square in the center on a gray background",
        num_inference_steps=4,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)


def test_generation_matches_heldout_captions(pipe):
    captions = heldout_captions()  # 80 captions never seen in training, one image each
    images = pipe(
        captions,
        height=64,
        width=64,
        num_inference_steps=DEFAULT_STEPS,
        guidance_scale=DEFAULT_GUIDANCE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(0),
    ).images
    scores = score_images(images, captions)
    assert scores.count >= 50
    assert scores.color >= 0.90, scores
    assert scores.position >= 0.80, scores


def test_fluxpipeline_defaults_draw_the_trained_picture(pipe):
    """`pipe(caption, height=64, width=64)` with FluxPipeline's defaults (max_sequence_length=512, 28 steps,
    guidance 3.5) equals the call at the trained 16 T5 tokens, and matches held-out captions."""
    captions = heldout_captions()[:24]
    defaults = pipe(captions, height=64, width=64, generator=torch.Generator().manual_seed(0), output_type="np").images
    trained = pipe(captions, height=64, width=64, max_sequence_length=MAX_SEQUENCE_LENGTH, output_type="np",
                   generator=torch.Generator().manual_seed(0)).images
    assert np.abs(defaults - trained).max() == 0.0
    scores = score_images([(image * 255).round().astype(np.uint8) for image in defaults], captions)
    assert scores.color >= 0.90 and scores.position >= 0.80, scores


@pytest.mark.parametrize("size", JUDGED_SIZES, ids=lambda size: "{}x{}".format(*size))
def test_generation_matches_heldout_captions_at_every_trained_size(pipe, size):
    """With FluxPipeline's defaults (28 steps, guidance 3.5), square and non-square sizes from 48 to 128 px."""
    width, height = size
    captions = heldout_captions()
    images = pipe(captions, height=height, width=width, generator=torch.Generator().manual_seed(0)).images
    assert images[0].size == (width, height)
    scores = score_images(images, captions)
    assert scores.color >= 0.95 and scores.position >= 0.95, scores


def test_render_and_judge_non_square_scenes():
    rng = np.random.default_rng(3)
    for width, height in [(128, 64), (48, 96)]:
        scenes = [sample_scene(rng) for _ in range(100)]
        verdicts = [judge_image(render_scene(scene, (width, height))) for scene in scenes]
        assert [v.color for v in verdicts] == [s.color for s in scenes]
        assert [v.position for v in verdicts] == [s.position for s in scenes]
    image = render_scene(Scene("red", "circle", "in the center", "white"), (128, 64))
    mask = np.asarray(image, dtype=np.int16)[..., 1] < 128  # the red object
    ys, xs = np.nonzero(mask)
    assert abs((xs.max() - xs.min()) - (ys.max() - ys.min())) <= 1  # a circle, not an ellipse


def test_vae_round_trip_keeps_pixels_and_hues(pipe):
    scores = evaluate_vae(pipe.vae, count=256, seed=1234)
    assert scores.psnr >= 26.0, scores
    assert scores.color >= 0.95, scores
