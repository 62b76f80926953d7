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
