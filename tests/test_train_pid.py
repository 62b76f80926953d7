"""The toy PiD training script: deterministic from its seed, and its output is a strictly loadable adapter folder.

Runs a few steps at a narrowed toy width (the 256 px output and the toy VAE's latents are real), parametrized
over batch size and rollout so both ways of building x_t are exercised.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from diffusers_stepbatch import PiDDecoder
from diffusers_stepbatch.toy import NATIVE_SIZE, WEIGHTS_DIR, train_pid

from .pid_helpers import single_thread

NARROW = {"hidden_size": 32, "patch_depth": 2, "lq_hidden_dim": 16, "lq_num_res_blocks": 1}


@pytest.fixture(autouse=True)
def _narrow_config(monkeypatch):
    for key, value in NARROW.items():
        monkeypatch.setitem(train_pid.PID_TOY_CONFIG, key, value)
    with single_thread():
        yield


@pytest.fixture(scope="module")
def vae():
    return train_pid.load_vae(str(WEIGHTS_DIR))


def _weights(model: PiDDecoder) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("batch, rollout", [(1, 0.0), (2, 1.0)])
def test_same_seed_same_weights_other_seed_other_weights(vae, batch, rollout):
    def run(seed):
        cfg = train_pid.PiDTrainConfig(seed=seed, steps=3, batch=batch, rollout=rollout, rollout_from=0.0)
        return _weights(train_pid.train(cfg, vae, time.time()))

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    # the EMA moved away from the seed's initialisation
    torch.manual_seed(0)
    init = PiDDecoder(**train_pid.PID_TOY_CONFIG).state_dict()
    assert any(not torch.equal(first[k], init[k]) for k in first)


@pytest.mark.parametrize("batch", [1, 3])
def test_aux_rgb_loss_trains_the_adapter_head(vae, monkeypatch, batch):
    monkeypatch.setitem(train_pid.PID_TOY_CONFIG, "lq_aux_rgb_head", True)
    torch.manual_seed(0)
    init = _weights(PiDDecoder(**train_pid.PID_TOY_CONFIG))

    def run(weight):
        cfg = train_pid.PiDTrainConfig(steps=3, batch=batch, aux_rgb_weight=weight)
        model = train_pid.train(cfg, vae, time.time())
        assert not model.lq_proj.latent_proj._forward_hooks  # the training-only hook is gone
        return _weights(model)

    head = [k for k in init if "lq_aux_rgb_head" in k]
    off, on = run(0.0), run(1.0)
    assert head and all(torch.equal(off[k], init[k]) for k in head)  # no gradient reaches an unused head
    assert all(not torch.equal(on[k], init[k]) for k in head)
    assert any(not torch.equal(on[k], off[k]) for k in init if k not in head)  # the loss also shapes the trunk


def test_aux_rgb_lays_the_head_tokens_out_as_the_native_image():
    """Token (row, col) predicts the p x p native pixels under its patch: an identity head returns the image."""
    config = dict(train_pid.PID_TOY_CONFIG, lq_aux_rgb_head=True)
    model = PiDDecoder(**config)
    model.lq_proj.lq_aux_rgb_head = torch.nn.Identity()
    p = model.patch_size // model.sr_scale
    image = torch.randn(2, 3, NATIVE_SIZE, NATIVE_SIZE + 2 * p)
    features = torch.nn.functional.pixel_unshuffle(image, p)  # channel (c, i, j) of token (row, col)
    assert torch.equal(train_pid.aux_rgb(model, features), image)


def test_aux_rgb_weight_needs_the_head(vae, monkeypatch):
    monkeypatch.setitem(train_pid.PID_TOY_CONFIG, "lq_aux_rgb_head", False)
    with pytest.raises(ValueError, match="lq_aux_rgb_head"):
        train_pid.train(train_pid.PiDTrainConfig(steps=1, batch=1, aux_rgb_weight=1.0), vae, time.time())
    with pytest.raises(ValueError, match="aux_rgb_weight"):
        train_pid.PiDTrainConfig(aux_rgb_weight=-1.0)


def test_main_saves_a_strictly_loadable_adapter_with_its_scores(tmp_path):
    out = tmp_path / "adapter"
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # NOTE: main() switches deterministic algorithms on for the whole process
        train_pid.main(
            ["--vae", str(WEIGHTS_DIR), "--out", str(out), "--steps", "2", "--batch", "1", "--eval-count", "2"]
        )
    finally:
        torch.use_deterministic_algorithms(deterministic)
    loaded = PiDDecoder.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in train_pid.PID_TOY_CONFIG} == train_pid.PID_TOY_CONFIG
    report = json.loads((out / "training.json").read_text())
    assert report["config"]["steps"] == 2
    for scores in report["heldout"].values():
        assert scores["count"] == 2 and 0 < scores["pid_psnr"] < scores["bicubic_psnr"]  # two steps learn little
    assert loaded.latent_scale * NATIVE_SIZE // 8 == train_pid.OUTPUT_SIZE  # 8 x 8 latents in, 256 px out


def test_bad_training_settings_are_refused():
    with pytest.raises(ValueError, match="sigma_max"):
        train_pid.PiDTrainConfig(sigma_max=0.0)
    with pytest.raises(ValueError, match="steps"):
        train_pid.PiDTrainConfig(batch=0)
