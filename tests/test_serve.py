"""The OpenAI-compatible server (`diffusers_stepbatch.serve`) driven by the official `openai` client over loopback.

The toy model serves at its native 64x64; images are checked against the unwrapped diffusers pipeline (same
seed) and with the toy judge (does the image show the caption's colour at the caption's position).
"""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")

from prometheus_client.parser import text_string_to_metric_families

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.toy import load_pipeline
from diffusers_stepbatch.toy.judge import score_images
from diffusers_stepbatch.toy.scenes import heldout_captions

from .serve_helpers import TOY_CALL, ServerThread, decode_b64, pixels, wait_for

MODEL = "toy-shapes"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain_pipe():
    return load_pipeline()


def reference(pipe, prompt: str, seed: int, n: int = 1, width: int = 64, height: int = 64, **extra):
    """The unwrapped diffusers pipeline's images for what the server was asked."""
    return pipe(prompt, height=height, width=width, num_images_per_prompt=n,
                generator=torch.Generator().manual_seed(seed), **{**TOY_CALL, **extra}).images


def metric_value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def aborted_requests(served) -> list[dict]:
    return [r for r in served.sb.stats()["requests"] if r["status"] == "FINISHED_ABORTED"]


# --------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("size", ["64x64", "96x48"])
def test_generate_n2_matches_the_plain_pipeline(client, plain_pipe, size):
    width, height = map(int, size.split("x"))
    prompt = "a blue square at the bottom right on a white background"
    result = client.images.generate(model=MODEL, prompt=prompt, size=size, n=2, response_format="b64_json",
                                    extra_body={"seed": 7})
    images = [decode_b64(item.b64_json) for item in result.data]
    assert [image.size for image in images] == [(width, height)] * 2
    assert result.size == size and result.usage.output_tokens == 2 * (width // 16) * (height // 16)
    assert result.usage.input_tokens > 0
    expected = reference(plain_pipe, prompt, seed=7, n=2, width=width, height=height)
    for got, want in zip(images, expected):
        # PNG is lossless: only fp32 differences <= 1e-4 before uint8 rounding may flip a level
        assert np.abs(pixels(got) - pixels(want)).max() <= 1
    assert np.abs(pixels(images[0]) - pixels(images[1])).mean() > 1  # two different samples, not one twice


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_images_follow_the_prompt_in_every_output_format(client, output_format):
    captions = heldout_captions()[::20]  # 4 held-out captions: every colour/position pair differs
    with concurrent.futures.ThreadPoolExecutor(len(captions)) as pool:
        results = list(pool.map(lambda c: client.images.generate(
            model=MODEL, prompt=c, n=2, output_format=output_format, output_compression=90,
            extra_body={"seed": 1}), captions))
    images, texts = [], []
    for caption, result in zip(captions, results):
        assert result.output_format == output_format
        for item in result.data:
            image = decode_b64(item.b64_json)
            assert image.format == output_format.upper() and image.size == (64, 64)
            images.append(image.convert("RGB"))
            texts.append(caption)
    scores = score_images(images, texts)
    assert scores.color >= 0.75 and scores.position >= 0.75, scores


def test_every_judged_size_draws_the_caption(client, served):
    """The toy model's trained sizes (square and non-square, 48-128 px), eight held-out captions each, all in
    flight at once (requests of different sizes share forwards), judged by the toy judge."""
    from diffusers_stepbatch.toy.build import JUDGED_SIZES

    captions = heldout_captions()[::10]
    jobs = [(f"{w}x{h}", caption, seed) for w, h in JUDGED_SIZES for seed, caption in enumerate(captions)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: client.images.generate(model=MODEL, prompt=job[1], size=job[0],
                                                                    extra_body={"seed": job[2]}), jobs))
    by_size: dict[str, tuple[list, list]] = {}
    for (size, caption, _), result in zip(jobs, results):
        image = decode_b64(result.data[0].b64_json).convert("RGB")
        assert result.size == size and f"{image.width}x{image.height}" == size
        by_size.setdefault(size, ([], []))[0].append(image)
        by_size[size][1].append(caption)
    everything = score_images(sum((v[0] for v in by_size.values()), []), sum((v[1] for v in by_size.values()), []))
    assert everything.color >= 0.9 and everything.position >= 0.9, everything
    for size, (images, texts) in by_size.items():
        scores = score_images(images, texts)
        assert scores.color >= 0.75 and scores.position >= 0.75, (size, scores)


def test_extras_are_pipeline_arguments(client, plain_pipe):
    prompt = "a green cross at the top right on a black background"
    extras = {"seed": 3, "num_inference_steps": 6, "guidance_scale": 2.0, "negative_prompt": "a white circle",
              "true_cfg_scale": 1.5}
    result = client.images.generate(model=MODEL, prompt=prompt, extra_body=extras)
    want = reference(plain_pipe, prompt, seed=3, num_inference_steps=6, guidance_scale=2.0,
                     negative_prompt="a white circle", true_cfg_scale=1.5)[0]
    assert np.abs(pixels(decode_b64(result.data[0].b64_json)) - pixels(want)).max() <= 1
    other = client.images.generate(model=MODEL, prompt=prompt, extra_body={**extras, "guidance_scale": 5.0})
    assert np.abs(pixels(decode_b64(other.data[0].b64_json)) - pixels(want)).max() > 8  # the extra did something


def test_stream_sends_partial_images_then_the_completed_one(client, plain_pipe):
    prompt = "a yellow triangle in the center on a black background"
    events = list(client.images.generate(model=MODEL, prompt=prompt, stream=True, partial_images=2,
                                         extra_body={"seed": 11}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "64x64" and e.output_format == "png" for e in events)
    partials = [pixels(decode_b64(e.b64_json)) for e in events[:2]]
    final = decode_b64(events[-1].b64_json)
    assert np.abs(pixels(final) - pixels(reference(plain_pipe, prompt, seed=11)[0])).max() <= 1
    assert events[-1].usage.output_tokens == 16
    # previews are the predicted clean image: the later one is nearer the result
    distances = [np.abs(p - pixels(final)).mean() for p in partials]
    assert distances[1] < distances[0], distances


@pytest.mark.parametrize(("partial_images", "n"), [(0, 1), (3, 1), (2, 2)])
def test_stream_partial_image_counts(client, partial_images, n):
    events = list(client.images.generate(model=MODEL, prompt="a red circle at the top left on a white background",
                                         stream=True, partial_images=partial_images, n=n))
    types = [e.type for e in events]
    assert types == ["image_generation.partial_image"] * (partial_images * n) + ["image_generation.completed"] * n
    # each image of the request has its own partial images (our `image_index`), in step order
    for index in range(n):
        mine = [e for e in events[:-n] if e.image_index == index]
        assert [e.partial_image_index for e in mine] == list(range(partial_images))
    assert sorted(e.image_index for e in events[-n:]) == list(range(n))


def test_concurrent_http_requests_share_batches(client, served):
    before = dict(served.sb.stats()["rows_histogram"].get("denoise", {}))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda s: client.images.generate(
            model=MODEL, prompt="a purple circle at the bottom left on a white background",
            extra_body={"seed": s, "num_inference_steps": 30}), range(6)))
    assert len(results) == 6 and all(len(r.data) == 1 for r in results)
    after = served.sb.stats()["rows_histogram"]["denoise"]
    shared = sum(count - before.get(rows, 0) for rows, count in after.items() if rows > 1)
    assert shared > 0, after


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("body", "param"), [
    ({"size": "big"}, "size"),
    ({"n": 11}, "n"),
    ({"response_format": "url"}, "response_format"),
    ({"output_format": "gif"}, "output_format"),
    ({"output_compression": 101}, "output_compression"),
    ({"partial_images": 4, "stream": True}, "partial_images"),
    ({"partial_images": 2}, "partial_images"),
    ({"seed": -1}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({"num_inference_steps": 0}, "num_inference_steps"),  # the pipeline's own check, as in the Python API
])
def test_bad_input_is_a_400_naming_the_field(client, served, body, param):
    before = served.sb.stats()["requests_finished"]
    request = {"model": MODEL, "prompt": "a red circle at the top left on a white background", **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/images/generations", body=request, cast_to=object)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and str(body[param])[:3] in error["message"]
    assert served.sb.stats()["requests_finished"] == before  # nothing was queued


@pytest.mark.parametrize("size", ["32x32", "144x144", "128x48", "64x72"])
def test_the_toy_model_refuses_sizes_it_was_not_trained_for(client, served, size):
    before = served.sb.stats()["requests_finished"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model=MODEL, prompt="a red circle", size=size)
    error = caught.value.body
    assert error["param"] == "size" and error["code"] == "unsupported_size", error
    assert f"size='{size}'" in error["message"] and "multiples of 16 from 48 to 128 pixels" in error["message"]
    assert "1:2 to 2:1" in error["message"]
    assert served.sb.stats()["requests_finished"] == before


@pytest.fixture(scope="module")
def any_size_client(served):
    """The same engine served without a size range (as a model other than the toy is)."""
    from diffusers_stepbatch.serve import ServingModel

    model = ServingModel(sb=served.sb, name=MODEL, call_defaults=served.call_defaults)
    with ServerThread(create_app(ServeConfig(), model=model, close_model=False)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("size", ["8x8", "64x15"])
def test_a_size_below_the_models_smallest_side_is_a_400(any_size_client, served, size):
    # NOTE: the plain pipeline fails inside a model there (a RuntimeError); the request must not reach the engine
    before = served.sb.stats()["requests_finished"]
    with pytest.raises(openai.BadRequestError) as caught:
        any_size_client.images.generate(model=MODEL, prompt="a red circle", size=size,
                                        extra_body={"num_inference_steps": 2})
    error = caught.value.body
    width, height = map(int, size.split("x"))
    side, value = ("height", height) if height < 16 else ("width", width)
    assert caught.value.status_code == 400 and error["param"] == "size", error
    assert f"{side}={value} is below ToyFluxPipeline's smallest image side, 16 pixels" in error["message"]
    assert served.sb.stats()["requests_finished"] == before


def test_pipeline_validation_message_is_the_python_apis(client, served):
    with pytest.raises(ValueError) as python_error:
        served.sb.submit("a red circle", num_inference_steps=0, max_sequence_length=16)
    with pytest.raises(openai.BadRequestError) as http_error:
        client.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 0})
    assert http_error.value.body["message"] == str(python_error.value)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.images.generate(model="dall-e-3", prompt="a red circle")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert "toy-shapes" in caught.value.body["message"]


def test_wrong_api_key_is_a_401(served):
    with ServerThread(create_app(ServeConfig(api_key="sesame"), model=served)) as url:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="open", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 2})
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in right.models.list()] == [MODEL]
        assert len(right.images.generate(model=MODEL, prompt="a red circle",
                                         extra_body={"num_inference_steps": 2}).data) == 1
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_full_queue_is_a_429_with_retry_after(plain_pipe):
    from diffusers_stepbatch import SchedulerConfig, StepBatched
    from diffusers_stepbatch.serve import ServingModel

    sb = StepBatched(plain_pipe, scheduler=SchedulerConfig(max_batch_size=1, max_queue=1))
    model = ServingModel(sb=sb, name=MODEL, call_defaults={"max_sequence_length": 16})
    try:
        with ServerThread(create_app(ServeConfig(retry_after_s=2), model=model)) as url:
            body = {"prompt": "a red circle", "num_inference_steps": 40}
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                responses = list(pool.map(
                    lambda _: httpx.post(f"{url}/v1/images/generations", json=body, timeout=60), range(6)))
    finally:
        sb.close()
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "queue_full" for r in rejected)
    assert "max_queue=1" in rejected[0].json()["error"]["message"]


def test_missed_deadline_is_a_504(client):
    client.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 4})  # measured
    with pytest.raises(openai.APIStatusError) as caught:
        client.images.generate(model=MODEL, prompt="a red circle",
                               extra_body={"num_inference_steps": 200, "deadline_s": 0.05})
    assert caught.value.status_code == 504 and caught.value.body["code"] == "deadline_unmeetable"
    assert caught.value.body["param"] == "deadline_s"


def test_503_while_loading_and_health_only_ready_after_load():
    release = threading.Event()

    def slow_loader(config):
        release.wait(30)
        return load_model(config)  # the app owns what its loader made: it closes it at shutdown

    app = create_app(ServeConfig(), loader=slow_loader)
    with ServerThread(app) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        early = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle"})
        assert early.status_code == 503 and early.json()["error"]["code"] == "server_loading"
        assert "retry-after" in early.headers
        release.set()
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        ok = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle", "num_inference_steps": 2})
        assert ok.status_code == 200
        app.state.server_state.begin_shutdown()
        late = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle"})
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_stopping"
        assert httpx.get(f"{url}/health").status_code == 503


def test_unknown_route_is_an_openai_error(base_url):
    response = httpx.get(f"{base_url}/v1/nothing")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------------------- disconnects
def test_client_disconnect_aborts_the_request(base_url, served):
    before = len(aborted_requests(served))
    body = {"prompt": "a red circle", "num_inference_steps": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=httpx.Timeout(60, read=0.5))
    aborted = wait_for(lambda: aborted_requests(served)[before:])
    assert aborted, "the request was not aborted after its client left"
    assert 0 < aborted[-1]["steps"] < 400


def test_closing_a_stream_aborts_the_request(base_url, served):
    before = len(aborted_requests(served))
    body = {"prompt": "a red circle", "num_inference_steps": 400, "stream": True, "partial_images": 3}
    with httpx.stream("POST", f"{base_url}/v1/images/generations", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert '"image_generation.partial_image"' in line
                break  # one partial image, then the client goes away
    aborted = wait_for(lambda: aborted_requests(served)[before:])
    assert aborted and 100 <= aborted[-1]["steps"] < 400, aborted  # the first partial comes after step 100


# ------------------------------------------------------------------------------------ models, health, metrics
def test_models_and_health(client, base_url):
    models = client.models.list()
    assert [m.id for m in models] == [MODEL] and models.data[0].owned_by == "diffusers-stepbatch"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "model": MODEL}


def test_metrics_count_http_requests_and_expose_the_engine(client, base_url):
    text = httpx.get(f"{base_url}/metrics").text
    route = "/v1/images/generations"
    ok_before = metric_value(text, "stepbatch_http_requests_total", route=route, status="200")
    engine_before = metric_value(text, "stepbatch_requests_finished_total", status="FINISHED_OK")
    for _ in range(2):
        client.images.generate(model=MODEL, prompt="a red circle", extra_body={"num_inference_steps": 3})
    with pytest.raises(openai.BadRequestError):
        client.images.generate(model=MODEL, prompt="a red circle", size="x")
    text = httpx.get(f"{base_url}/metrics").text
    assert metric_value(text, "stepbatch_http_requests_total", route=route, status="200") == ok_before + 2
    assert metric_value(text, "stepbatch_http_requests_total", route=route, status="400") >= 1
    assert metric_value(text, "stepbatch_requests_finished_total", status="FINISHED_OK") >= engine_before + 2
    assert metric_value(text, "stepbatch_http_request_duration_seconds_count", route=route) >= ok_before + 3
    assert metric_value(text, "stepbatch_batched_calls_total", kind="denoise", rows="1") > 0


def test_web_page_is_served(base_url):
    page = httpx.get(base_url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'id="submit"' in page.text and 'id="mask-canvas"' in page.text and MODEL in page.text
    script = httpx.get(base_url + "/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for route in ("/v1/images/generations", "/v1/images/edits", "/v1/engine/live", "/v1/models"):
        assert route in script.text
    assert "http://" not in page.text + script.text and "https://" not in page.text + script.text  # no CDN
