"""Model presets: found by Hub id or by a local folder's pipeline class and configs; `--call-default` over them;
`/v1/models` shows the defaults in force; a request's own values win (checked against the plain pipeline)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need `pip install -e .[serve,test]`")
pytest.importorskip("fastapi", reason="the server tests need `pip install -e .[serve,test]`")

from diffusers_stepbatch.serve import ServeConfig, create_app, load_model
from diffusers_stepbatch.serve.cli import add_serve_arguments, config_from_args
from diffusers_stepbatch.serve.presets import PRESETS, find_preset, preset_named
from diffusers_stepbatch.testing import tiny_flux_pipeline
from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline, tiny_z_image_pipeline

from .serve_helpers import ServerThread, decode_b64, pixels


def test_every_preset_has_a_unique_hub_id_and_call_defaults_of_its_pipeline():
    import diffusers

    assert len({p.hub_id.lower() for p in PRESETS}) == len(PRESETS)
    for preset in PRESETS:
        import inspect

        parameters = inspect.signature(getattr(diffusers, preset.pipeline).__call__).parameters
        assert set(preset.call_defaults) <= set(parameters), preset.hub_id


def test_a_hub_id_finds_its_preset_whatever_the_case():
    assert find_preset("black-forest-labs/flux.1-SCHNELL", None).call_defaults["num_inference_steps"] == 4
    assert find_preset("Tongyi-MAI/Z-Image-Turbo", None).call_defaults["guidance_scale"] == 0.0
    with pytest.raises(ValueError, match="not a known model"):
        preset_named("someone/unknown")


def test_a_local_folder_is_told_apart_by_its_configs(tmp_path):
    dev, schnell = tiny_flux_pipeline(guidance_embeds=True), tiny_flux_pipeline()
    dev.save_pretrained(tmp_path / "a")
    schnell.save_pretrained(tmp_path / "b")
    assert find_preset(str(tmp_path / "a"), dev).hub_id == "black-forest-labs/FLUX.1-dev"
    assert find_preset(str(tmp_path / "b"), schnell).hub_id == "black-forest-labs/FLUX.1-schnell"
    klein = tiny_flux2_klein_pipeline()
    for distilled, hub_id in ((True, "black-forest-labs/FLUX.2-klein-4B"),
                              (False, "black-forest-labs/FLUX.2-klein-base-4B")):
        klein.register_to_config(is_distilled=distilled)
        klein.save_pretrained(tmp_path / f"klein-{distilled}")
        assert find_preset(str(tmp_path / f"klein-{distilled}"), klein).hub_id == hub_id
    z_image = tiny_z_image_pipeline()
    z_image.save_pretrained(tmp_path / "Z-Image")  # named after the base model: its preset, not the class default
    assert find_preset(str(tmp_path / "Z-Image"), z_image).hub_id == "Tongyi-MAI/Z-Image"
    assert find_preset(str(tmp_path / "other"), z_image).hub_id == "Tongyi-MAI/Z-Image-Turbo"


def test_call_default_flags():
    parser = add_serve_arguments(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args(
        ["--call-default", "num_inference_steps=3", "--call-default", "negative_prompt=blurry, dark",
         "--call-default", "cfg_normalization=true", "--preset", "none", "--max-steps", "40"]))
    assert config.call_defaults == {"num_inference_steps": 3, "negative_prompt": "blurry, dark",
                                    "cfg_normalization": True}
    assert (config.preset, config.max_steps) == ("none", 40)
    with pytest.raises(SystemExit):
        parser.parse_args(["--call-default", "no-equals-sign"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("presets") / "Z-Image-Turbo"
    tiny_z_image_pipeline().save_pretrained(folder)
    config = ServeConfig(model=str(folder), served_model_name="turbo", call_defaults={"num_inference_steps": 2})
    model = load_model(config)
    try:
        with ServerThread(create_app(config, model=model)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60), folder
    finally:
        model.close()


def test_models_shows_the_defaults_in_force(served):
    client, _ = served
    card = client.models.retrieve("turbo").model_extra
    assert card["preset"] == "Tongyi-MAI/Z-Image-Turbo"
    # the card's 1024x1024 is beyond this tiny model (128 px at most): its closest size; the flag over the preset
    assert card["call_defaults"] == {"height": 128, "width": 128, "num_inference_steps": 2, "guidance_scale": 0.0}
    assert card["default_size"] == "128x128"


def test_the_preset_applies_and_a_requests_own_values_win(served):
    from diffusers import ZImagePipeline

    client, folder = served
    plain = ZImagePipeline.from_pretrained(folder)

    def want(**call):
        return plain("a cat", generator=torch.Generator().manual_seed(3), **call).images[0]

    got = decode_b64(client.images.generate(model="turbo", prompt="a cat", extra_body={"seed": 3}).data[0].b64_json)
    assert np.abs(pixels(got) - pixels(want(height=128, width=128, num_inference_steps=2, guidance_scale=0.0))).max() <= 1
    own = client.images.generate(model="turbo", prompt="a cat", size="64x32",
                                 extra_body={"seed": 3, "guidance_scale": 2.0, "num_inference_steps": 3})
    reference = want(height=32, width=64, num_inference_steps=3, guidance_scale=2.0)
    assert np.abs(pixels(decode_b64(own.data[0].b64_json)) - pixels(reference)).max() <= 1
