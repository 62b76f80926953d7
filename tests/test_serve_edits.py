"""`POST /v1/images/edits` and the server's limits, driven by the official `openai` client over loopback.

The toy model edits through `ToyFluxInpaintPipeline` (with a mask) and `ToyFluxImg2ImgPipeline` (without), built
from its components and run on the same engine as its generations. Images are checked against the unwrapped
diffusers pipelines (same seed) and with the toy judge.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("multipart", reason="edits need python-multipart (`pip install -e .[serve]`)")

from diffusers_stepbatch.serve import ServeConfig, ServingModel, create_app
from diffusers_stepbatch.toy import load_pipeline
from diffusers_stepbatch.toy.judge import judge_image
from diffusers_stepbatch.toy.pipeline import ToyFluxImg2ImgPipeline, ToyFluxInpaintPipeline
from diffusers_stepbatch.toy.scenes import Scene, render_scene

from .serve_helpers import TOY_CALL, ServerThread, decode_b64, pixels

MODEL = "toy-shapes"
RED_TOP_LEFT = "a red circle at the top left on a white background"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain():
    pipe = load_pipeline()
    return {"inpaint": ToyFluxInpaintPipeline(**pipe.components), "img2img": ToyFluxImg2ImgPipeline(**pipe.components)}


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def base_image(size=(64, 64)) -> Image.Image:
    return render_scene(Scene("blue", "square", "at the bottom right", "white"), size)


def quadrant_mask(size=(64, 64)) -> Image.Image:
    """OpenAI's mask: opaque everywhere but the transparent top-left quadrant (the part to edit)."""
    width, height = size
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, width // 2, height // 2))
    return mask


def finished(served) -> int:
    return sum(served.sb.stats()["requests_finished"].values())


# ------------------------------------------------------------------------------------------------- edits
def test_inpaint_repaints_the_masked_part_and_keeps_the_rest(client, plain):
    image, mask = base_image(), quadrant_mask()
    result = client.images.edit(model=MODEL, image=("base.png", png(image), "image/png"),
                                mask=("mask.png", png(mask), "image/png"), prompt=RED_TOP_LEFT, extra_body={"seed": 5})
    edited = decode_b64(result.data[0].b64_json).convert("RGB")
    assert edited.size == (64, 64) and result.size == "64x64"
    assert result.usage.input_tokens_details.image_tokens == 16 and result.usage.output_tokens == 16
    # the same as the unwrapped diffusers pipeline (white = repaint in diffusers' convention)
    want = plain["inpaint"](RED_TOP_LEFT, image=image, mask_image=_diffusers_mask(), height=64, width=64,
                            strength=1.0, generator=torch.Generator().manual_seed(5), **TOY_CALL).images[0]
    want = plain["inpaint"].image_processor.apply_overlay(_diffusers_mask(), image, want)  # unmasked: the original
    assert np.abs(pixels(edited) - pixels(want)).max() <= 1
    # the masked quadrant shows the asked shape's colour; outside it (away from the mask's edge) the picture stays
    verdict = judge_image(np.asarray(edited))
    assert verdict.color in ("red", "blue")
    top_left = judge_image(np.asarray(edited)[:32, :32])
    assert top_left.color == "red" and top_left.foreground_fraction > 0.1, top_left
    bottom_right = judge_image(np.asarray(edited)[32:, 32:])
    assert bottom_right.color == "blue" and bottom_right.foreground_fraction > 0.2, bottom_right
    rest = np.ones((64, 64), dtype=bool)
    rest[:32, :32] = False
    assert np.abs(pixels(edited) - pixels(image))[rest].max() == 0, "the unmasked part changed"


def _diffusers_mask() -> Image.Image:
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 32))
    return mask


def test_edit_without_mask_is_img2img(client, plain):
    image = base_image()
    result = client.images.edit(model=MODEL, image=("base.png", png(image), "image/png"),
                                prompt="a blue square at the bottom right on a gray background",
                                extra_body={"seed": 2, "strength": 0.7})
    want = plain["img2img"]("a blue square at the bottom right on a gray background", image=image, strength=0.7,
                            height=64, width=64, generator=torch.Generator().manual_seed(2), **TOY_CALL).images[0]
    got = decode_b64(result.data[0].b64_json)
    assert np.abs(pixels(got) - pixels(want)).max() <= 1
    assert np.abs(pixels(got) - pixels(image)).mean() > 10  # it did redraw (a gray background was asked for)


def test_edit_n2_and_a_non_square_size(client):
    image, mask = base_image((96, 48)), quadrant_mask((96, 48))
    result = client.images.edit(model=MODEL, image=("base.png", png(image), "image/png"),
                                mask=("mask.png", png(mask), "image/png"), prompt=RED_TOP_LEFT, n=2,
                                extra_body={"num_inference_steps": 8})
    images = [decode_b64(item.b64_json) for item in result.data]
    assert [im.size for im in images] == [(96, 48)] * 2 and result.size == "96x48"
    assert np.abs(pixels(images[0]) - pixels(images[1])).mean() > 0.5  # two samples, not one twice


def test_edit_auto_size_picks_the_nearest_size_the_model_draws(client):
    image = base_image((200, 100))
    result = client.images.edit(model=MODEL, image=("base.png", png(image), "image/png"), prompt=RED_TOP_LEFT,
                                extra_body={"num_inference_steps": 4})
    assert result.size == "128x64"  # 2:1, the largest 2:1 size within 48-128 px


def test_edit_stream_sends_partial_images_then_the_completed_one(client):
    events = list(client.images.edit(model=MODEL, image=("base.png", png(base_image()), "image/png"),
                                     mask=("mask.png", png(quadrant_mask()), "image/png"), prompt=RED_TOP_LEFT,
                                     stream=True, partial_images=2, extra_body={"seed": 3}))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = decode_b64(events[-1].b64_json)
    assert final.size == (64, 64) and events[-1].usage.output_tokens == 16


def test_json_form_with_data_urls_equals_the_multipart_form(client, base_url):
    image, mask = base_image(), quadrant_mask()
    multipart = client.images.edit(model=MODEL, image=("base.png", png(image), "image/png"),
                                   mask=("mask.png", png(mask), "image/png"), prompt=RED_TOP_LEFT,
                                   extra_body={"seed": 9, "num_inference_steps": 6})
    body = {"model": MODEL, "prompt": RED_TOP_LEFT, "images": [{"image_url": data_url(image)}],
            "mask": {"image_url": data_url(mask)}, "seed": 9, "num_inference_steps": 6}
    response = httpx.post(f"{base_url}/v1/images/edits", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert np.array_equal(pixels(decode_b64(response.json()["data"][0]["b64_json"])),
                          pixels(decode_b64(multipart.data[0].b64_json)))


def test_several_images_go_to_a_reference_edit_pipeline(served):
    """A model whose edit pipeline takes reference images gets them all, in order (the toy has none)."""
    from diffusers import FluxKontextPipeline, QwenImageEditPlusPipeline

    from diffusers_stepbatch.serve.generation import plan_edit
    from diffusers_stepbatch.serve.inputs import EditInputs
    from diffusers_stepbatch.serve.protocol import ImageEditRequest

    class Kontext(FluxKontextPipeline):
        def __init__(self):
            pass

    class ReferencePipeline(QwenImageEditPlusPipeline):
        def __init__(self):  # NOTE: only its class matters here: plan_edit reads its __call__'s arguments
            pass

    class Engine:
        pipe = ReferencePipeline()

    model = ServingModel(sb=served.sb, name=MODEL, call_defaults={}, sizes=served.sizes,
                         edits={"reference": Engine()})
    images = [base_image(), base_image((128, 64)), base_image((48, 96))]
    generation = plan_edit(model, ImageEditRequest(prompt="x", size="64x64"), EditInputs(images, None), 100)
    assert generation.task == "reference" and generation.kind == "edit"
    # reference-edit pipelines size their inputs themselves: each image goes as sent (the output is `size`)
    assert [im.size for im in generation.kwargs["image"]] == [(64, 64), (128, 64), (48, 96)]
    assert (generation.width, generation.height) == (64, 64)
    single = ServingModel(sb=served.sb, name=MODEL, edits={"reference": type("E", (), {"pipe": Kontext()})()})
    with pytest.raises(Exception) as caught:  # a one-image reference pipeline: several images are a 400
        plan_edit(single, ImageEditRequest(prompt="x", size="64x64"), EditInputs(images, None), 100)
    assert caught.value.status == 400 and caught.value.code == "too_many_images"


def test_edits_and_generations_share_forwards(client, served):
    before = dict(served.sb.stats()["rows_histogram"].get("denoise", {}))
    steps = {"num_inference_steps": 120}
    stream = client.images.edit(model=MODEL, image=("base.png", png(base_image()), "image/png"),
                                mask=("mask.png", png(quadrant_mask()), "image/png"), prompt=RED_TOP_LEFT,
                                stream=True, partial_images=3, extra_body=steps)
    events = iter(stream)
    assert next(events).type == "image_edit.partial_image"  # the edit is running now
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        generation = pool.submit(client.images.generate, model=MODEL, prompt="a green cross in the center on a "
                                 "black background", extra_body={"num_inference_steps": 30})
        rest = list(events)
        assert len(generation.result().data) == 1
    assert rest[-1].type == "image_edit.completed"
    after = served.sb.stats()["rows_histogram"]["denoise"]
    # one row each (guidance-distilled, n=1): a 2-row forward held the edit's row and the generation's
    assert after.get(2, 0) - before.get(2, 0) > 0, (before, after)


# ------------------------------------------------------------------------------------------------ errors
def _edit_error(client, served, **kwargs) -> dict:
    before = finished(served)
    kwargs.setdefault("image", ("base.png", png(base_image()), "image/png"))
    with pytest.raises(openai.APIStatusError) as caught:
        client.images.edit(model=MODEL, prompt=kwargs.pop("prompt", RED_TOP_LEFT), **kwargs)
    assert finished(served) == before  # nothing was queued
    return {"status": caught.value.status_code, **caught.value.body}


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"image": ("bad.png", b"not an image at all", "image/png")}, "image", "invalid_image_format"),
    ({"image": ("gif.gif", png(Image.new("RGB", (64, 64)), "GIF"), "image/gif")}, "image", "invalid_image_format"),
    ({"image": ("empty.png", b"", "image/png")}, "image", "invalid_image"),
    ({"mask": ("mask.png", png(quadrant_mask((64, 48))), "image/png")}, "mask", "invalid_mask_size"),
    ({"image": [("a.png", png(base_image()), "image/png")] * 17}, "image", "too_many_images"),
    ({"image": [("a.png", png(base_image()), "image/png")] * 2}, "image", "too_many_images"),
    ({"size": "256x256"}, "size", "unsupported_size"),
    ({"prompt": "x" * 32_001}, "prompt", "string_above_max_length"),
    ({"n": 11}, "n", None),
    ({"extra_body": {"strength": 1.5}}, "strength", None),
    ({"extra_body": {"num_inference_steps": 0}}, "num_inference_steps", "invalid_value"),
])
def test_bad_edits_are_400s_naming_the_field(client, served, kwargs, param, code):
    error = _edit_error(client, served, **kwargs)
    assert error["status"] == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error


def test_remote_image_urls_are_refused_unless_allowed(base_url, served):
    before = finished(served)
    body = {"model": MODEL, "prompt": RED_TOP_LEFT, "images": [{"image_url": "https://example.com/cat.png"}]}
    response = httpx.post(f"{base_url}/v1/images/edits", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "images[0]", error
    assert error["code"] == "remote_images_disabled" and "--allow-remote-images" in error["message"]
    bad = httpx.post(f"{base_url}/v1/images/edits", json={**body, "images": ["data:image/png;base64,@@@"]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_image_url"
    assert finished(served) == before


def test_remote_image_urls_are_fetched_when_allowed(served):
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    picture = png(base_image())
    images = Starlette(routes=[Route("/scene.png", lambda request: Response(picture, media_type="image/png"))])
    with ServerThread(images) as image_host, ServerThread(create_app(ServeConfig(allow_remote_images=True),
                                                                     model=served, close_model=False)) as url:
        body = {"model": MODEL, "prompt": RED_TOP_LEFT, "images": [{"image_url": f"{image_host}/scene.png"}],
                "seed": 4, "num_inference_steps": 4}
        remote = httpx.post(f"{url}/v1/images/edits", json=body, timeout=60)
        inline = httpx.post(f"{url}/v1/images/edits", json={**body, "images": [data_url(base_image())]}, timeout=60)
        missing = httpx.post(f"{url}/v1/images/edits", json={**body, "images": [f"{image_host}/nothing.png"]})
    assert remote.status_code == 200 and inline.status_code == 200, remote.text
    assert np.array_equal(pixels(decode_b64(remote.json()["data"][0]["b64_json"])),
                          pixels(decode_b64(inline.json()["data"][0]["b64_json"])))
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "invalid_image_url"


def test_a_model_that_cannot_edit_is_a_400(served):
    model = ServingModel(sb=served.sb, name=MODEL, call_defaults=served.call_defaults, sizes=served.sizes)
    with ServerThread(create_app(ServeConfig(), model=model, close_model=False)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.edit(model=MODEL, image=("a.png", png(base_image()), "image/png"), prompt=RED_TOP_LEFT)
    assert caught.value.body["code"] == "edits_not_supported" and caught.value.body["param"] == "image"
    assert "/v1/images/generations" in caught.value.body["message"]


def test_too_many_pixels_is_a_400_before_decoding(served):
    with ServerThread(create_app(ServeConfig(max_image_pixels=64 * 64), model=served, close_model=False)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.edit(model=MODEL, image=("a.png", png(base_image((128, 64))), "image/png"),
                               prompt=RED_TOP_LEFT)
    assert caught.value.body["code"] == "image_too_large" and caught.value.body["param"] == "image"
    assert "8192 pixels" in caught.value.body["message"] and "4096" in caught.value.body["message"]


# ------------------------------------------------------------------------------------------------ limits
def test_over_limit_bodies_are_413s_before_they_are_read(served):
    with ServerThread(create_app(ServeConfig(max_body_bytes=20_000), model=served, close_model=False)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (128, 128, 3), dtype=np.uint8))
        with pytest.raises(openai.APIStatusError) as caught:
            client.images.edit(model=MODEL, image=("noise.png", png(noise), "image/png"), prompt=RED_TOP_LEFT)
        assert caught.value.status_code == 413 and caught.value.body["code"] == "request_too_large"
        with pytest.raises(openai.APIStatusError) as caught:
            client.images.generate(model=MODEL, prompt="a red circle " * 2000)
        assert caught.value.status_code == 413 and "20000 bytes" in caught.value.body["message"]

        def chunks():  # no Content-Length: refused once the body passes the limit
            for _ in range(50):
                yield b'{"prompt": "' + b"x" * 1000

        response = httpx.post(f"{url}/v1/images/generations", content=chunks(),
                              headers={"content-type": "application/json"})
        assert response.status_code == 413 and "chunked" in response.json()["error"]["message"]
        small = client.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 2})
        assert len(small.data) == 1  # under the limit: served


def test_prompt_length_limit_is_configurable(served):
    with ServerThread(create_app(ServeConfig(max_prompt_chars=40), model=served, close_model=False)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = RED_TOP_LEFT + " please"
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.generate(model=MODEL, prompt=prompt)
        assert caught.value.body["param"] == "prompt" and caught.value.body["code"] == "string_above_max_length"
        assert f"{len(prompt)} characters" in caught.value.body["message"] and "40" in caught.value.body["message"]
        assert len(client.images.generate(model=MODEL, prompt="a red circle",
                                          extra_body={"num_inference_steps": 2}).data) == 1


def test_a_32001_character_prompt_is_refused_by_default(client, served):
    before = finished(served)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model=MODEL, prompt="a" * 32_001)
    assert caught.value.body["param"] == "prompt" and "32000" in caught.value.body["message"]
    assert finished(served) == before


# --------------------------------------------------------------------------------------- models, OpenAPI
def test_models_advertise_sizes_and_edits(client, base_url):
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["default_size"] == "64x64"
    sizes = card["sizes"]
    assert (sizes["min_side"], sizes["max_side"], sizes["multiple"], sizes["max_aspect_ratio"]) == (48, 128, 16, 2)
    assert {"48x48", "64x64", "128x128", "96x48", "64x128"} <= set(sizes["sizes"]) and "128x48" not in sizes["sizes"]
    assert card["edits"] == {"inpaint": "ToyFluxInpaintPipeline", "img2img": "ToyFluxImg2ImgPipeline"}


def test_openapi_documents_edits_and_errors(base_url):
    schema = httpx.get(f"{base_url}/openapi.json").json()
    edit = schema["paths"]["/v1/images/edits"]["post"]
    content = edit["requestBody"]["content"]
    assert {"multipart/form-data", "application/json"} <= set(content)
    form = content["multipart/form-data"]["schema"]["properties"]
    assert {"image", "mask", "prompt", "n", "size", "stream", "partial_images", "strength"} <= set(form)
    assert {"400", "413", "429", "503"} <= set(edit["responses"])
    assert "ImageEditRequest" in schema["components"]["schemas"] and "ErrorResponse" in schema["components"]["schemas"]
    generations = schema["paths"]["/v1/images/generations"]["post"]
    assert {"400", "413", "429"} <= set(generations["responses"])


# ------------------------------------------------------------------------------------------------ routing
def test_edit_pipelines_are_found_for_other_families():
    """A text-to-image FLUX model gets diffusers' inpainting and img2img pipelines over its components; a served
    edit pipeline serves its own kind; every edit pipeline runs on the served engine."""
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline

    from diffusers_stepbatch import StepBatched
    from diffusers_stepbatch.serve.edits import edit_pipelines, edit_task
    from diffusers_stepbatch.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    with StepBatched(pipe) as sb:
        routes = edit_pipelines(sb)
        assert {task: type(e.pipe) for task, e in routes.items()} == {"inpaint": FluxInpaintPipeline,
                                                                      "img2img": FluxImg2ImgPipeline}
        assert all(e.engine is sb.engine and e.pipe.transformer is pipe.transformer for e in routes.values())
    assert (edit_task(FluxInpaintPipeline), edit_task(FluxImg2ImgPipeline)) == ("inpaint", "img2img")
    assert edit_task(FluxKontextPipeline) == "reference" and edit_task(type(pipe)) is None
    with StepBatched(FluxInpaintPipeline(**pipe.components)) as served_inpaint:
        assert edit_pipelines(served_inpaint) == {"inpaint": served_inpaint}
