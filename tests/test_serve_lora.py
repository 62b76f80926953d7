"""LoRA over HTTP with the official openai client, on two families (FLUX.1 and Qwen-Image): adapters named at
launch (`--lora-modules`) and found on first use (`--lora-dir`), picked per request with
`extra_body={"lora": {...}}` on generations and edits. Concurrent requests with different adapters share
forwards, and each equals the plain pipeline after `set_adapters` for its adapters and weights."""

from __future__ import annotations

import concurrent.futures
import functools
import shutil

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("peft", reason="LoRA needs `pip install -e .[lora]`")

from diffusers_stepbatch.testing import add_random_lora_adapters, tiny_flux_pipeline, tiny_qwenimage_pipeline

from .serve_helpers import Served, decode_b64, pixels

FAMILIES = {
    "flux": (functools.partial(tiny_flux_pipeline, guidance_embeds=True), {"max_sequence_length": 16}),
    "qwenimage": (tiny_qwenimage_pipeline, {"negative_prompt": "blurry", "true_cfg_scale": 3.0}),
}
# (lora field, prompt, seed): "c" lives in --lora-dir and loads on first use
REQUESTS = [
    ({"a": 1.0}, "a red circle", 0),
    ({"b": 0.5}, "a red circle", 0),
    ({"a": 0.7, "b": 0.3}, "a blue square", 1),
    (None, "a red circle", 0),
    ({"c": 0.8, "a": 0.2}, "a green cross", 2),
]


def save_adapters(build, folder):
    """Three random adapters of `build()`'s transformer, saved as diffusers LoRA files: a/, b/ and dir/c/."""
    from peft.utils import get_peft_model_state_dict

    pipe = build()
    add_random_lora_adapters(pipe.transformer)
    paths = {"a": folder / "a", "b": folder / "b", "c": folder / "dir" / "c"}
    for name, path in paths.items():
        type(pipe).save_lora_weights(path, transformer_lora_layers=get_peft_model_state_dict(
            pipe.transformer, adapter_name=name))
    shutil.copytree(paths["a"], folder / "dir" / "d")  # "d": a's weights under another name, in --lora-dir
    return paths


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    build, extra = FAMILIES[request.param]
    paths = save_adapters(build, tmp_path_factory.mktemp(request.param))
    plain = build()
    for name, path in paths.items():
        plain.load_lora_weights(path, adapter_name=name)
    config = {"lora_modules": {"a": str(paths["a"]), "b": str(paths["b"])}, "lora_dir": str(paths["c"].parent),
              "max_loras": 1, "max_batch_size": 16}
    with Served(build(), f"tiny-{request.param}", **config) as served:
        yield served, plain, extra


def plain_image(pipe, lora, prompt, seed, extra, **call):
    if lora:
        pipe.enable_lora()
        pipe.set_adapters(list(lora), list(lora.values()))
    else:
        pipe.disable_lora()
    try:
        return pipe(prompt, height=32, width=32, num_inference_steps=3, generator=torch.Generator().manual_seed(seed),
                    **extra, **call).images[0]
    finally:
        pipe.enable_lora()


def test_models_lists_the_adapters(family):
    served, _, _ = family
    card = served.client.models.retrieve(served.name).model_extra["lora"]
    assert card["adapters"] == ["a", "b", "c", "d"] and card["loaded"] == ["a", "b"] and card["max_loras"] == 1
    models = served.client.models.list().data  # and as vLLM lists adapters: models whose parent is the served one
    assert [m.id for m in models] == [served.name, "a", "b", "c", "d"]
    assert {m.model_extra.get("parent") for m in models[1:]} == {served.name}
    assert served.client.models.retrieve("b").model_extra["parent"] == served.name


def test_an_adapters_name_as_the_model_picks_it(family):
    served, plain, extra = family
    result = served.client.images.generate(model="b", prompt="a cat", size="32x32",
                                           extra_body={"seed": 6, "num_inference_steps": 3, **extra})
    want = plain_image(plain, {"b": 1.0}, "a cat", 6, extra)
    assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1
    with pytest.raises(openai.NotFoundError):
        served.client.images.generate(model="nope", prompt="a cat")


def test_requests_with_different_adapters_share_forwards_and_equal_set_adapters(family):
    served, plain, extra = family
    before = dict(served.model.sb.stats()["rows_histogram"].get("denoise", {}))

    def generate(request):
        lora, prompt, seed = request
        body = {"seed": seed, "num_inference_steps": 3, **extra}
        if lora is not None:
            body["lora"] = lora
        return served.client.images.generate(model=served.name, prompt=prompt, size="32x32", extra_body=body)

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        results = list(pool.map(generate, REQUESTS))
    for (lora, prompt, seed), result in zip(REQUESTS, results):
        want = plain_image(plain, lora, prompt, seed, extra)
        assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1, lora
    # the adapters matter, and forwards held rows of several requests
    first, second = (pixels(decode_b64(r.data[0].b64_json)) for r in results[:2])
    assert np.abs(first - second).max() > 2
    after = served.model.sb.stats()["rows_histogram"]["denoise"]
    assert sum(count - before.get(rows, 0) for rows, count in after.items() if rows > 1) > 0, after
    assert served.client.models.retrieve(served.name).model_extra["lora"]["loaded"] == ["a", "b", "c"]


def test_an_edit_takes_adapters_too(family):
    from diffusers import AutoPipelineForImage2Image

    from .serve_helpers import pixels as as_pixels
    from .test_serve_edit_families import noise_image, png

    served, plain, extra = family
    image = noise_image(32, 32, 4)
    result = served.client.images.edit(model=served.name, prompt="a red circle", image=("a.png", png(image),
                                       "image/png"), extra_body={"seed": 7, "num_inference_steps": 3,
                                                                 "strength": 0.7, "lora": {"b": 0.9}, **extra})
    img2img = AutoPipelineForImage2Image.from_pipe(plain)
    img2img.set_progress_bar_config(disable=True)
    want = plain_image(img2img, {"b": 0.9}, "a red circle", 7, extra, image=image, strength=0.7)
    assert np.abs(as_pixels(decode_b64(result.data[0].b64_json)) - as_pixels(want)).max() <= 1


@pytest.mark.parametrize("lora,message", [({"nope": 1.0}, "unknown adapter 'nope'"),
                                          ({"a": -1}, "must be a finite number >= 0")])
def test_a_bad_adapter_is_a_400(family, lora, message):
    served, _, _ = family
    before = served.finished()
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.images.generate(model=served.name, prompt="a cat", extra_body={"lora": lora})
    assert caught.value.body["param"] == "lora" and message in caught.value.body["message"], caught.value.body
    assert served.finished() == before


def test_max_loras_unloads_the_least_recently_used_dir_adapter(family):
    served, plain, extra = family
    result = served.client.images.generate(model=served.name, prompt="a cat", size="32x32",
                                           extra_body={"seed": 1, "num_inference_steps": 3, "lora": {"d": 0.6},
                                                       **extra})
    assert served.client.models.retrieve(served.name).model_extra["lora"]["loaded"] == ["a", "b", "d"]  # c out
    assert "c" not in served.model.sb.pipe.transformer.peft_config
    want = plain_image(plain, {"a": 0.6}, "a cat", 1, extra)  # d holds a's weights
    assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1


def test_a_stream_takes_adapters_too(family):
    served, plain, extra = family
    events = list(served.client.images.generate(model=served.name, prompt="a red circle", size="32x32", stream=True,
                                                partial_images=1, extra_body={"seed": 2, "num_inference_steps": 3,
                                                                              "lora": {"a": 0.5}, **extra}))
    completed = [event for event in events if event.type == "image_generation.completed"]
    assert [event.type for event in events].count("image_generation.partial_image") == 1
    want = plain_image(plain, {"a": 0.5}, "a red circle", 2, extra)
    assert np.abs(pixels(decode_b64(completed[0].b64_json)) - pixels(want)).max() <= 1


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_a_video_takes_adapters_too(tmp_path):
    pytest.importorskip("av", reason="the videos API needs PyAV")
    from diffusers_stepbatch.toy.video import tiny_wan_pipeline

    from .serve_helpers import wait_for
    from .test_serve_videos import assert_same_video, content, diff, encoded

    build = functools.partial(tiny_wan_pipeline, layers=1)
    paths = save_adapters(build, tmp_path)
    plain = build()
    plain.load_lora_weights(paths["a"], adapter_name="a")
    with Served(build(), "tiny-wan", lora_modules={"a": str(paths["a"])}, video_fps=4) as served:
        video = served.client.videos.create(model="tiny-wan", prompt="rain", size="32x32", extra_body={
            "num_frames": 5, "num_inference_steps": 2, "seed": 1, "lora": {"a": 0.7}})
        assert wait_for(lambda: served.client.videos.retrieve(video.id).status == "completed", timeout=60)
        got = content(served.client, video.id)
    plain.set_adapters(["a"], [0.7])
    frames = plain(prompt="rain", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="np",
                   generator=torch.Generator().manual_seed(1)).frames[0]
    from diffusers_stepbatch.serve.video_encoding import to_uint8

    want = to_uint8(frames)
    assert_same_video(got, want)
    plain.disable_lora()
    base = to_uint8(plain(prompt="rain", height=32, width=32, num_frames=5, num_inference_steps=2, output_type="np",
                          generator=torch.Generator().manual_seed(1)).frames[0])
    assert diff(got, encoded(base)).mean() > 1  # the adapter changed the video
