"""Errors as a client sees them (the official `openai` client): a 500 gives a request id and no exception
text; a pipeline's own ValueError raised after queueing is a 400; an unknown body field is a 400 naming it
with close matches; a model served from a local folder advertises its sizes and step cap and refuses
requests outside them before queueing."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model, serve_pipeline
from diffusers_stepbatch.serve.sizes import SizeRange
from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline

from .serve_helpers import ServerThread, decode_b64, pixels


class Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("z-image") / "tiny"  # NOTE: a name that is no preset's: the class default
    tiny_z_image_pipeline().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(folder):
    config = ServeConfig(model=str(folder), served_model_name="tiny-z")
    model = load_model(config)
    fail = {"on": False}

    def maybe_fail(module, args):
        if fail["on"]:
            raise Fault("secret detail at /srv/weights/transformer.safetensors")

    model.sb.pipe.transformer.register_forward_pre_hook(maybe_fail)
    try:
        with ServerThread(create_app(config, model=model)) as url:
            yield url, model, fail
    finally:
        model.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def finished(model) -> int:
    return sum(model.sb.stats()["requests_finished"].values())


def test_a_500_names_the_request_id_and_hides_the_exception(served, client):
    url, model, fail = served
    fail["on"] = True
    try:
        response = httpx.post(f"{url}/v1/images/generations", timeout=60, headers={"x-request-id": "trace-42"},
                              json={"prompt": "a cat", "num_inference_steps": 2, "size": "32x32"})
    finally:
        fail["on"] = False
    error = response.json()["error"]
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-42"
    assert error["request_id"] == "trace-42" and "trace-42" in error["message"]
    assert "secret" not in response.text and "Fault" not in response.text and "safetensors" not in response.text
    # the next request is not hurt, and gets an id of its own
    ok = httpx.post(f"{url}/v1/images/generations", timeout=60,
                    json={"prompt": "a cat", "num_inference_steps": 2, "size": "32x32"})
    assert ok.status_code == 200 and len(ok.headers["x-request-id"]) == 32


def test_an_unhandled_route_error_is_a_500_with_the_request_id():
    from fastapi import FastAPI

    app = create_app(ServeConfig(), model=None, loader=lambda config: (_ for _ in ()).throw(RuntimeError("x")))

    async def broken():
        raise KeyError("internal key name")

    assert isinstance(app, FastAPI)
    app.add_api_route("/broken", broken)
    with ServerThread(app) as url:
        response = httpx.get(f"{url}/broken", timeout=10)
    assert response.status_code == 500 and "internal key name" not in response.text
    assert response.json()["error"]["request_id"] == response.headers["x-request-id"]


def test_a_pipeline_value_error_after_queueing_is_a_400(folder):
    """Served without a size range, a side Z-Image can't take reaches its `__call__`, which raises there."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(folder)
    config = ServeConfig(served_model_name="any-size")
    model = serve_pipeline(pipe, config, sizes=SizeRange(1, 4096, 1, 100.0))
    try:
        with ServerThread(create_app(config, model=model)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            with pytest.raises(openai.BadRequestError) as caught:
                client.images.generate(model="any-size", prompt="a cat", size="63x64",
                                       extra_body={"num_inference_steps": 2})
    finally:
        model.close()
    error = caught.value.body
    assert error["message"] == "Width must be divisible by 4 (got 63). Please adjust the width to a multiple of 4."
    assert error["param"] == "size" and error["code"] == "invalid_value"


@pytest.mark.parametrize("field,suggestion", [("num_inference_step", "num_inference_steps"),
                                              ("guidance", "guidance_scale"), ("loras", "lora"),
                                              ("seeds", "seed")])
def test_an_unknown_field_is_a_400_naming_it(served, client, field, suggestion):
    before = finished(served[1])
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="tiny-z", prompt="a cat", extra_body={field: 2})
    error = caught.value.body
    assert error["param"] == field and error["code"] == "unknown_parameter", error
    assert f"{field}: unknown parameter" in error["message"]
    if suggestion:
        assert f"did you mean '{suggestion}'" in error["message"] or f"'{suggestion}'" in error["message"]
    assert finished(served[1]) == before


def test_a_pipeline_argument_in_the_body_reaches_the_pipeline(served, client, folder):
    from diffusers import ZImagePipeline

    plain = ZImagePipeline.from_pretrained(folder)
    result = client.images.generate(model="tiny-z", prompt="a cat", size="32x32",
                                    extra_body={"num_inference_steps": 2, "seed": 5, "max_sequence_length": 8})
    want = plain("a cat", height=32, width=32, num_inference_steps=2, guidance_scale=0.0, max_sequence_length=8,
                 generator=torch.Generator().manual_seed(5)).images[0]
    assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1
    with pytest.raises(openai.BadRequestError) as caught:  # set by the server: refused, with what to send
        client.images.generate(model="tiny-z", prompt="a cat", extra_body={"output_type": "latent"})
    assert caught.value.body["param"] == "output_type" and "the server sets it" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="tiny-z", prompt="a cat", extra_body={"max_sequence_length": "long"})
    assert caught.value.body["param"] == "max_sequence_length" and "must be a int" in caught.value.body["message"]


def test_a_local_folder_advertises_sizes_and_a_step_cap(served, client):
    card = client.models.retrieve("tiny-z").model_extra
    sizes = card["sizes"]
    # multiples of the VAE factor (2) x the patch (2); the RoPE table's 32 rows x 4 pixels = 128 at most
    assert (sizes["multiple"], sizes["max_side"]) == (4, 128), sizes
    assert card["max_steps"] == 100 and card["preset"] == "Tongyi-MAI/Z-Image-Turbo"


@pytest.mark.parametrize("extra,param", [({"size": "63x64"}, "size"), ({"size": "1x1"}, "size"),
                                         ({"size": "4096x4096"}, "size"),
                                         ({"num_inference_steps": 100000}, "num_inference_steps")])
def test_outside_the_advertised_range_is_a_400_before_queueing(served, client, extra, param):
    before = finished(served[1])
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/images/generations", body={"model": "tiny-z", "prompt": "a cat", **extra}, cast_to=object)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert finished(served[1]) == before


def test_lora_on_a_server_without_adapters_is_a_400(served, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="tiny-z", prompt="a cat", extra_body={"lora": {"pixel": 1.0}})
    assert caught.value.body["code"] == "lora_not_found" and "--lora-modules" in caught.value.body["message"]
