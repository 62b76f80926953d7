"""`StepBatched.stream` on a video pipeline: previews every k steps as short clips (one frame per latent frame),
then the output, equal to the plain pipeline's. Tiny Wan 2.1."""

import pytest

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.toy.video import tiny_wan_pipeline
from diffusers_stepbatch.video_preview import StreamVideoPreview

from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("frames, height, width, every", [(5, 16, 32, 2), (9, 32, 16, 3)])
def test_video_previews_every_k_steps_then_the_exact_output(frames, height, width, every):
    pipe = tiny_wan_pipeline(layers=1)
    kwargs = dict(prompt="a ball", negative_prompt="blur", num_frames=frames, height=height, width=width,
                  num_inference_steps=7, guidance_scale=4.0, output_type="pt", max_sequence_length=16, seed=0)
    expected = pipe(**seeded(kwargs)).frames
    with StepBatched(pipe) as sb:
        items = list(sb.stream(**seeded(kwargs), preview_every=every))
    previews, output = items[:-1], items[-1]
    assert [p.step for p in previews] == list(range(every, 7, every))
    latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
    for preview in previews:
        assert isinstance(preview, StreamVideoPreview) and preview.num_steps == 7
        assert preview.frames.shape[0] == latent_frames and preview.frames.shape[-1] == 3
        assert len(preview.images) == latent_frames
    assert max_diff(output.frames, expected) <= TOLERANCE
    assert (previews[-1].frames.astype(int) - previews[0].frames.astype(int)).any()  # the clip evolves
