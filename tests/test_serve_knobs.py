"""Launch knobs on the CPU (tiny FLUX.1, the official openai client): quantization, offloading (model,
sequential, group), torch.compile of the denoiser, the attention backend and VAE tiling each give the image the
plain pipeline gives with the same switch; a backend that needs CUDA is a clear error; `--warmup` runs requests
before the server is ready; `--config FILE` (TOML) sets every flag, and the command line wins."""

from __future__ import annotations

import argparse
import threading

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model, serve_pipeline
from diffusers_stepbatch.serve.cli import add_serve_arguments, config_from_args
from diffusers_stepbatch.serve.config_file import parse_with_config_file
from diffusers_stepbatch.testing import tiny_flux_pipeline

from .serve_helpers import Served, ServerThread, decode_b64, pixels, wait_for

CALL = {"num_inference_steps": 3, "max_sequence_length": 16, "guidance_scale": 3.0}


def served_image(pipe, **config) -> np.ndarray:
    with Served(pipe, "tiny-flux", **config) as served:
        result = served.client.images.generate(model="tiny-flux", prompt="a red circle", size="32x32",
                                               extra_body={"seed": 4, **CALL})
        return pixels(decode_b64(result.data[0].b64_json))


def plain_image(pipe) -> np.ndarray:
    image = pipe("a red circle", height=32, width=32, generator=torch.Generator().manual_seed(4), **CALL).images[0]
    return pixels(image)


def test_quantize_is_the_python_apis():
    from diffusers_stepbatch.quantize import quantize_transformer

    plain = quantize_transformer(tiny_flux_pipeline(), weights="qint8")
    pipe = tiny_flux_pipeline()
    got = served_image(pipe, quantize="qint8")
    assert type(pipe.transformer.transformer_blocks[0].ff.net[2]).__name__ == "QLinear"
    assert np.abs(got - plain_image(plain)).max() <= 1


@pytest.mark.parametrize("offload", ["model", "group"])
def test_offload_gives_the_plain_image(offload):
    pipe = tiny_flux_pipeline()
    got = served_image(pipe, offload=offload)
    hooked = any(hasattr(module, "_hf_hook") or hasattr(module, "_diffusers_hook")
                 for module in pipe.transformer.modules())
    assert hooked  # the offload hooks are on the denoiser
    assert np.abs(got - plain_image(tiny_flux_pipeline())).max() <= 1


def test_compile_runs_the_compiled_denoiser():
    pipe = tiny_flux_pipeline()
    # NOTE: "eager" traces with dynamo (guards, recompiles) without inductor's minutes of codegen on this CPU
    got = served_image(pipe, compile=True, compile_backend="eager")
    assert getattr(pipe.transformer, "_compiled_call_impl", None) is not None
    assert np.abs(got - plain_image(tiny_flux_pipeline())).max() <= 1


def test_attention_backend_and_vae_tiling():
    pipe = tiny_flux_pipeline()
    got = served_image(pipe, attention_backend="_native_math", vae_tiling=True)
    assert pipe.vae.use_tiling
    plain = tiny_flux_pipeline()
    plain.vae.enable_tiling()
    assert np.abs(got - plain_image(plain)).max() <= 1


@pytest.mark.parametrize("knob,message", [({"attention_backend": "flash"}, "needs a CUDA device"),
                                          ({"attention_backend": "nope"}, "is not one of"),
                                          ({"offload": "sequential"}, "has none: use --device cuda")])
def test_a_knob_that_cant_run_here_is_a_clear_error(knob, message):
    with pytest.raises(ValueError, match=message):
        serve_pipeline(tiny_flux_pipeline(), ServeConfig(**knob))


def test_warmup_runs_before_ready(monkeypatch):
    from diffusers_stepbatch.serve import app as app_module
    from diffusers_stepbatch.serve.launch_knobs import warm_up

    release, warmed = threading.Event(), []

    def held_warm_up(model, requests):  # NOTE: held, so that the test sees the "warming" phase for sure
        release.wait(60)
        warm_up(model, requests)
        warmed.append(requests)

    monkeypatch.setattr(app_module, "warm_up", held_warm_up)
    config = ServeConfig(warmup=3, call_defaults={"num_inference_steps": 4})
    model = load_model(config)
    try:
        with ServerThread(create_app(config, model=model)) as url:
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "warming"
            assert httpx.get(f"{url}/live").status_code == 200
            busy = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red circle"})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_warming"
            release.set()
            assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=60)
            assert warmed == [3]
            assert sum(model.sb.stats()["requests_finished"].values()) == 0  # counters zeroed after the warm-up
    finally:
        model.close()


def test_config_file_sets_every_flag_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('model = "toy"\nmax-batch-size = 4\nmax_queue = 0\nvae-tiling = true\noffload = "group"\n'
                    '[call-default]\nnum_inference_steps = 6\nnegative_prompt = "blurry"\n'
                    '[lora-modules]\npixel = "./loras/pixel"\n')
    parser = add_serve_arguments(argparse.ArgumentParser())
    config = config_from_args(parse_with_config_file(
        parser, ["--config", str(path), "--max-batch-size", "2", "--call-default", "num_inference_steps=8"]))
    assert (config.max_batch_size, config.max_queue, config.vae_tiling, config.offload) == (2, None, True, "group")
    assert config.call_defaults == {"num_inference_steps": 8, "negative_prompt": "blurry"}
    assert config.lora_modules == {"pixel": "./loras/pixel"}
    path.write_text("max-batch-sise = 4\n")
    with pytest.raises(SystemExit):
        parse_with_config_file(add_serve_arguments(argparse.ArgumentParser()), ["--config", str(path)])
    path.write_text('offload = "disk"\n')
    with pytest.raises(SystemExit):
        parse_with_config_file(add_serve_arguments(argparse.ArgumentParser()), ["--config", str(path)])


def test_config_file_errors_name_the_key(tmp_path, capsys):
    path = tmp_path / "serve.toml"
    path.write_text("max-batch-sise = 4\n")
    with pytest.raises(SystemExit):
        parse_with_config_file(add_serve_arguments(argparse.ArgumentParser()), ["--config", str(path)])
    assert "unknown key 'max-batch-sise'; did you mean max-batch-size" in capsys.readouterr().err
