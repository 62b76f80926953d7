"""`POST /v1/images/edits` over tiny pipelines of the real families, driven by the official `openai` client.

A text-to-image model of each family (SD, SDXL, SD3, Qwen-Image) edits with the inpainting pipeline (with a mask)
or the img2img pipeline (without) that diffusers' AutoPipelines build over its components; a pipeline that takes
several reference images (FLUX.2 Klein) gets them all, each at its own size. Every answer is compared, to the
8-bit pixel, with the unwrapped diffusers pipeline called with the same inputs and seed.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("multipart", reason="edits need python-multipart (`pip install -e .[serve]`)")

from diffusers_stepbatch import testing

from .serve_helpers import Served, decode_b64, pixels

PROMPT = "a red circle"
FAMILIES = {
    "sd": (testing.tiny_sd_pipeline, {}),
    "sdxl": (testing.tiny_sdxl_pipeline, {}),
    "sd3": (testing.tiny_sd3_pipeline, {"in_channels": 16}),  # NOTE: SD3's inpainting needs 16 latent channels
    "qwenimage": (testing.tiny_qwenimage_pipeline, {}),
}


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------ several reference images
@pytest.fixture(scope="module")
def klein():
    from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

    pipe = tiny_flux2_klein_pipeline()
    with Served(pipe, "tiny-klein", call_defaults={"text_encoder_out_layers": (1,)}) as served:
        yield pipe, served


def test_several_reference_images_of_different_sizes_reach_the_pipeline_as_sent(klein):
    pipe, served = klein
    images = [noise_image(64, 64, 1), noise_image(96, 64, 2), noise_image(64, 128, 3)]
    assert {task: type(sb.pipe).__name__ for task, sb in served.model.edits.items()} == {
        "reference": "Flux2KleinPipeline"}
    result = served.client.images.edit(model=served.name, prompt=PROMPT,
                                       image=[(f"{i}.png", png(im), "image/png") for i, im in enumerate(images)],
                                       size="32x32", extra_body={"seed": 7, "num_inference_steps": 2})
    got = decode_b64(result.data[0].b64_json)
    assert got.size == (32, 32) and result.size == "32x32"
    # the usage counts every input image at the size it was sent (16x16-pixel patches)
    assert result.usage.input_tokens_details.image_tokens == 16 + 24 + 32
    want = pipe(prompt=PROMPT, image=images, height=32, width=32, num_inference_steps=2, text_encoder_out_layers=(1,),
                generator=torch.Generator().manual_seed(7)).images[0]
    assert np.array_equal(pixels(got), pixels(want))
    # the images matter, and their order: the first two swapped give another picture
    swapped = pipe(prompt=PROMPT, image=[images[1], images[0], images[2]], height=32, width=32, num_inference_steps=2,
                   text_encoder_out_layers=(1,), generator=torch.Generator().manual_seed(7)).images[0]
    assert np.abs(pixels(swapped) - pixels(want)).max() > 0


def test_a_reference_image_the_pipeline_refuses_is_a_400_before_queueing(klein):
    _, served = klein
    before = served.finished()
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.images.edit(model=served.name, prompt=PROMPT,
                                  image=[("a.png", png(noise_image(64, 64, 1)), "image/png"),
                                         ("b.png", png(noise_image(48, 64, 2)), "image/png")])
    assert served.finished() == before
    error = caught.value.body
    assert error["param"] == "image[1]" and error["code"] == "invalid_image", error
    assert "48" in error["message"] and "64px" in error["message"]  # FLUX.2's own words: sides of at least 64px


def test_a_one_image_reference_pipeline_refuses_several_images():
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline(**testing.tiny_flux_pipeline().components)
    with Served(pipe, "tiny-kontext") as served:
        assert {task: type(sb.pipe).__name__ for task, sb in served.model.edits.items()} == {
            "reference": "FluxKontextPipeline"}
        before = served.finished()
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.images.edit(model=served.name, prompt=PROMPT,
                                      image=[("a.png", png(noise_image(64, 64, 1)), "image/png"),
                                             ("b.png", png(noise_image(96, 64, 2)), "image/png")])
        assert served.finished() == before  # nothing was queued
    error = caught.value.body
    assert error["param"] == "image" and error["code"] == "too_many_images", error
    assert "2 images" in error["message"] and "FluxKontextPipeline" in error["message"]


# ---------------------------------------------------------------------- inpainting and img2img per family
@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    build, options = FAMILIES[request.param]
    pipe = build(**options)
    plain = {"inpaint": AutoPipelineForInpainting.from_pipe(pipe),
             "img2img": AutoPipelineForImage2Image.from_pipe(pipe)}
    for edit_pipe in plain.values():
        edit_pipe.set_progress_bar_config(disable=True)
    with Served(pipe, f"tiny-{request.param}") as served:
        yield plain, served


def _quadrant_masks(size: int = 64) -> tuple[Image.Image, Image.Image]:
    """OpenAI's mask (transparent = edit here) and diffusers' (white = repaint) of the top-left quadrant."""
    openai_mask = Image.new("RGBA", (size, size), (0, 0, 0, 255))
    openai_mask.paste((0, 0, 0, 0), (0, 0, size // 2, size // 2))
    diffusers_mask = Image.new("L", (size, size), 0)
    diffusers_mask.paste(255, (0, 0, size // 2, size // 2))
    return openai_mask, diffusers_mask


def test_an_edit_with_a_mask_is_the_familys_inpainting_and_keeps_the_rest(family):
    plain, served = family
    image = noise_image(64, 64, 4)
    openai_mask, mask = _quadrant_masks()
    assert type(served.model.edits["inpaint"].pipe) is type(plain["inpaint"])
    result = served.client.images.edit(model=served.name, prompt=PROMPT, image=("a.png", png(image), "image/png"),
                                       mask=("m.png", png(openai_mask), "image/png"),
                                       extra_body={"seed": 11, "num_inference_steps": 3})
    got = decode_b64(result.data[0].b64_json)
    # OpenAI's edits redraw the masked part entirely (strength 1) and keep the rest: diffusers' overlay
    repainted = plain["inpaint"](PROMPT, image=image, mask_image=mask, height=64, width=64, strength=1.0,
                                 num_inference_steps=3, generator=torch.Generator().manual_seed(11)).images[0]
    want = plain["inpaint"].image_processor.apply_overlay(mask, image, repainted)
    assert np.array_equal(pixels(got), pixels(want))
    outside = np.asarray(mask) == 0
    assert np.array_equal(pixels(got)[outside], pixels(image)[outside])
    assert np.abs(pixels(got) - pixels(image))[~outside].mean() > 10  # the masked quadrant was redrawn


def test_an_edit_without_a_mask_is_the_familys_img2img(family):
    plain, served = family
    image = noise_image(64, 64, 5)
    assert type(served.model.edits["img2img"].pipe) is type(plain["img2img"])
    result = served.client.images.edit(model=served.name, prompt=PROMPT, image=("a.png", png(image), "image/png"),
                                       extra_body={"seed": 12, "num_inference_steps": 3, "strength": 0.7})
    got = decode_b64(result.data[0].b64_json)
    want = plain["img2img"](PROMPT, image=image, height=64, width=64, strength=0.7, num_inference_steps=3,
                            generator=torch.Generator().manual_seed(12)).images[0]
    assert np.array_equal(pixels(got), pixels(want))
    assert np.abs(pixels(got) - pixels(image)).mean() > 10  # it redrew the picture
