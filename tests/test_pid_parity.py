"""PiDDecoder against the reference network's golden vectors (tests/data/pid-golden, see its README)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffusers_stepbatch.decoders.pid import PiDDecoder

from .pid_helpers import GOLDEN_DIR, GOLDEN_NAMES


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _golden(name: str):
    spec = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    decoder = PiDDecoder(**spec["constructor"]).eval()
    weights = load_file(GOLDEN_DIR / f"{name}.weights.safetensors")
    decoder.load_state_dict(weights, strict=True)
    return decoder, weights, load_file(GOLDEN_DIR / f"{name}.io.safetensors")


def _run(decoder, io, **changes):
    args = {k: io[k] for k in ("x", "t", "y", "lq_latent", "degrade_sigma")}
    args.update(changes)
    with torch.no_grad():
        return decoder(
            args["x"], args["t"], args["y"], lq_latent=args["lq_latent"], degrade_sigma=args["degrade_sigma"]
        )


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_parameter_names_and_shapes_match_reference(name):
    decoder, weights, _ = _golden(name)
    ours = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in weights.items()}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_forward_reproduces_reference_output(name):
    decoder, _, io = _golden(name)
    out = _run(decoder, io)
    assert out.shape == io["output"].shape
    assert (out - io["output"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", GOLDEN_NAMES)
@pytest.mark.parametrize(
    "change, min_rel_change",
    [
        ("lq_latent", 0.5),
        ("degrade_sigma", 0.1),
        ("no_lq_latent", 0.5),
        ("x", 0.05),
        ("y", 0.005),
        ("t", 0.005),
    ],
)
def test_every_input_path_is_live(name, change, min_rel_change):
    decoder, _, io = _golden(name)
    base = _run(decoder, io)
    changes = {
        "lq_latent": {"lq_latent": torch.flip(io["lq_latent"], dims=[-1]) * -1.0},
        "degrade_sigma": {"degrade_sigma": io["degrade_sigma"] + 0.5},
        "no_lq_latent": {"lq_latent": None},
        "x": {"x": io["x"] * 0.5},
        "y": {"y": torch.roll(io["y"], 1, dims=1)},
        "t": {"t": io["t"] * 0.5},
    }[change]
    rel = ((_run(decoder, io, **changes) - base).abs().mean() / base.abs().mean()).item()
    assert rel > min_rel_change


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_sigma_is_per_row(name):
    decoder, _, io = _golden(name)
    base = _run(decoder, io)
    sigma = io["degrade_sigma"].clone()
    sigma[1] += 0.5
    out = _run(decoder, io, degrade_sigma=sigma)
    assert torch.equal(out[0], base[0])
    assert (out[1] - base[1]).abs().max() > 1e-2


def test_missing_degrade_sigma_is_an_error():
    decoder, _, io = _golden("pid_v1_tiny")
    with pytest.raises(ValueError, match="degrade_sigma"):
        _run(decoder, io, degrade_sigma=None)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lq_in_channels": 3}, "lq_in_channels=3"),
        ({"lq_gate_type": "scalar"}, "lq_gate_type='scalar'"),
        ({"lq_conv_padding_mode": "circular"}, "lq_conv_padding_mode='circular'"),
        ({"rope_mode": "yarn"}, "rope_mode='yarn'"),
        ({"hidden_size": 36}, "hidden_size=36"),
        ({"enable_ed": True}, "enable_ed=True"),
    ],
)
def test_unsupported_config_names_the_value(bad, match):
    spec = json.loads((GOLDEN_DIR / "pid_v1_tiny.json").read_text())["constructor"]
    with pytest.raises(ValueError, match=match):
        decoder = PiDDecoder(**{**spec, **bad})
        decoder(torch.zeros(1, 3, 32, 32), torch.zeros(1), torch.zeros(1, 2, spec["txt_embed_dim"]))
