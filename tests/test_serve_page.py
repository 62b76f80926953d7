"""The web page's controls in a real headless Chromium (Debian's `chromium`, Playwright), on the toy model
served with two LoRA adapters: forms only in their mode; negative prompt, guidance, true CFG and `n` where the
pipeline takes them; a LoRA choice; the images equal the API's for the same fields; download and "edit this"
on gallery cards; the gallery kept across reloads."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("peft", reason="LoRA needs `pip install -e .[lora]`")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs `pip install playwright`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.testing import add_random_lora_adapters
from diffusers_stepbatch.toy import load_pipeline

from .serve_helpers import ServerThread, decode_b64, pixels
from .test_serve_browser import CHROMIUM, CHROMIUM_FLAGS, SCREENSHOTS

if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
    pytest.skip("Debian's chromium is not installed (`apt-get install chromium`; .ci/run does)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from peft.utils import get_peft_model_state_dict

    folder = tmp_path_factory.mktemp("loras")
    pipe = load_pipeline()
    add_random_lora_adapters(pipe.transformer, names=("ink", "pixel"))
    for name in ("ink", "pixel"):
        type(pipe).save_lora_weights(folder / name, transformer_lora_layers=get_peft_model_state_dict(
            pipe.transformer, adapter_name=name))
    config = ServeConfig(lora_modules={name: str(folder / name) for name in ("ink", "pixel")})
    model = load_model(config)
    try:
        with ServerThread(create_app(config, model=model)) as url:
            yield url
    finally:
        model.close()


def image_of(source: str) -> np.ndarray:
    assert source.startswith("data:image/png;base64,")
    return pixels(Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))))


def shot(page, name: str, tmp_path) -> None:
    folder = SCREENSHOTS or str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    page.screenshot(path=os.path.join(folder, name), full_page=True)


def test_controls_lora_gallery_download_and_edit_this(server, tmp_path):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        page = context.new_page()
        page.goto(server + "/")
        page.wait_for_function("document.querySelector('#lora').options.length === 3")
        # forms only in their mode: no video form for an image model, strength only when editing
        assert page.is_hidden("#video-form") and page.is_disabled("#mode-video") and page.is_hidden("#strength")
        for control in ("#negative", "#guidance", "#true-cfg", "#n", "#lora", "#lora-weight"):
            assert page.is_visible(control), control
        assert page.input_value("#steps") == "20"  # the toy's default call
        page.fill("#prompt", "a red circle at the top left on a white background")
        page.fill("#negative", "a blue square")
        page.fill("#guidance", "3")
        page.fill("#true-cfg", "1.5")
        page.fill("#n", "2")
        page.select_option("#lora", "pixel")
        page.fill("#lora-weight", "0.8")
        page.fill("#steps", "8")
        page.fill("#seed", "3")
        page.click("#submit")
        page.wait_for_function("window.completed === true", timeout=90_000)
        assert page.locator("#gallery .card").count() == 2
        shot(page, "page_generated.png", tmp_path)
        sources = [page.locator("#gallery .card img").nth(i).get_attribute("src") for i in (1, 0)]  # newest first
        want = client.images.generate(
            model="toy-shapes", prompt="a red circle at the top left on a white background", n=2, size="64x64",
            extra_body={"negative_prompt": "a blue square", "guidance_scale": 3, "true_cfg_scale": 1.5,
                        "lora": {"pixel": 0.8}, "num_inference_steps": 8, "seed": 3})
        for source, image in zip(sources, want.data):
            assert np.array_equal(image_of(source), pixels(decode_b64(image.b64_json)))
        assert "LoRA pixel 0.8" in page.text_content("#gallery .card .meta")
        link = page.locator("#gallery .card .download").first
        assert link.get_attribute("href") == page.locator("#gallery .card img").first.get_attribute("src")
        with page.expect_download() as download:
            link.click()
        assert download.value.suggested_filename.endswith(".png")

        page.locator("#gallery .card .edit-this").first.click()  # "edit this": the image becomes the edit's input
        page.wait_for_function("document.querySelector('#mask-canvas').width === 64")
        assert page.get_attribute("#mode-edit", "aria-pressed") == "true" and page.is_visible("#strength")
        page.fill("#prompt", "a blue square at the bottom right on a white background")
        page.fill("#n", "1")
        page.fill("#strength", "0.6")
        page.click("#submit")
        page.wait_for_function("window.completed === true", timeout=90_000)
        assert "edit" in page.text_content("#gallery .card .meta") and page.locator("#gallery .card").count() == 3
        shot(page, "page_edited.png", tmp_path)

        page.reload()  # the gallery is kept in the browser's storage
        page.wait_for_function("document.querySelectorAll('#gallery .card img').length === 3")
        assert image_of(page.locator("#gallery .card img").nth(2).get_attribute("src")).shape == (64, 64, 3)
        assert page.is_visible("#gallery .card .edit-this")
        shot(page, "page_reloaded.png", tmp_path)
        browser.close()
