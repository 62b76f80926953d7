"""PiD sampling: batched decoding equals decoding each request alone, and the sampler follows the reference."""

from __future__ import annotations

import pytest
import torch

from diffusers_stepbatch.decoders.pid import PID_DISTILLED_TIMESTEPS, PiDSamplerConfig, decode, sampler_step

from .pid_helpers import TINY_CONFIGS, inputs, tiny_decoder

SIGMAS = (0.0, 0.35, 0.9)
# (config, latent h x w): outputs from 32 x 32 to 96 x 128 pixels, square and not, folded and upsampled latents.
CASES = [
    ("v1", (1, 1)),
    ("v1", (2, 3)),
    ("v1", (3, 2)),
    ("v1pt5", (2, 2)),
    ("v1pt5", (3, 4)),
    ("v1pt5_packed_latent", (1, 2)),
    ("sdxl_4ch_interval1_original_rope", (2, 3)),
    ("folded_latent", (8, 8)),
    ("folded_latent", (4, 6)),
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("sample_type", ["sde", "ode"])
@pytest.mark.parametrize("name, latent_hw", CASES, ids=[f"{n}-{h}x{w}" for n, (h, w) in CASES])
def test_decode_batch_equals_each_alone(name, latent_hw, sample_type):
    decoder = tiny_decoder(name)
    latent, text = inputs(TINY_CONFIGS[name], len(SIGMAS), latent_hw, seed=1)
    config = PiDSamplerConfig(sample_type=sample_type)
    seeds = (11, 22, 33)

    batched = decode(decoder, latent, list(SIGMAS), text, generator=_generators(seeds), config=config)
    for i, seed in enumerate(seeds):
        alone = decode(
            decoder, latent[i : i + 1], SIGMAS[i], text[i : i + 1], generator=_generators([seed]), config=config
        )
        assert (batched[i : i + 1] - alone).abs().max().item() <= 1e-4
    # NOTE: the rows really differ, so the comparison above is not trivially true.
    assert (batched[0] - batched[1]).abs().mean() > 1e-2


def test_decode_output_size_and_range():
    decoder = tiny_decoder("v1")
    latent, text = inputs(TINY_CONFIGS["v1"], 2, (2, 3))
    image = decode(decoder, latent, 0.0, text, generator=torch.Generator().manual_seed(0))
    assert image.shape == (2, 3, 64, 96) and image.dtype == torch.float32
    assert image.min() >= -1 and image.max() <= 1
    assert decode(decoder, latent, 0.0, text, height=32, width=48).shape == (2, 3, 32, 48)


def test_forward_rows_at_different_timesteps_equal_single_rows():
    decoder = tiny_decoder("v1pt5")
    latent, text = inputs(TINY_CONFIGS["v1pt5"], 3, (2, 2))
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    t = torch.tensor(PID_DISTILLED_TIMESTEPS[:3]) * 1000
    sigma = torch.tensor(SIGMAS)
    with torch.no_grad():
        batched = decoder(x, t, text, lq_latent=latent, degrade_sigma=sigma)
        for i in range(3):
            rows = slice(i, i + 1)
            alone = decoder(x[rows], t[rows], text[rows], lq_latent=latent[rows], degrade_sigma=sigma[rows])
            assert (batched[i : i + 1] - alone).abs().max().item() <= 1e-4


def test_sampler_step_rows_at_different_steps():
    gen = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(3, 3, 8, 8, generator=gen) for _ in range(3))
    t = torch.tensor([0.999, 0.634, 0.342])
    t_next = torch.tensor([0.866, 0.342, 0.0])
    out = sampler_step(x, v, t, t_next, eps)
    for i in range(3):
        x0 = x[i] - t[i] * v[i]
        expected = x0 if t_next[i] == 0 else (1 - t_next[i]) * x0 + t_next[i] * eps[i]
        assert torch.allclose(out[i], expected, atol=1e-6)
    ode = sampler_step(x, v, t, t_next, sample_type="ode")
    assert torch.allclose(ode[0], x[0] + (t_next[0] - t[0]) * v[0], atol=1e-6)
    assert torch.allclose(ode[2], x[2] - t[2] * v[2], atol=1e-6)


@pytest.mark.parametrize("sample_type", ["sde", "ode"])
def test_decode_follows_the_distilled_schedule(sample_type):
    """x_t = (1 - t) x0 + t noise; the network sees t * 1000 and predicts v = noise - x0."""
    decoder = tiny_decoder("v1")
    latent, text = inputs(TINY_CONFIGS["v1"], 2, (2, 2))
    sigma = torch.tensor([0.0, 0.5])
    noise = torch.randn(4, 2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    image = decode(decoder, latent, sigma, text, noise=noise, config=PiDSamplerConfig(sample_type=sample_type))

    ts = PID_DISTILLED_TIMESTEPS
    x = noise[0]
    with torch.no_grad():
        for i, (t, t_next) in enumerate(zip(ts[:-1], ts[1:])):
            v = decoder(x, torch.full((2,), t * 1000), text, lq_latent=latent, degrade_sigma=sigma)
            x0 = x - t * v
            if t_next == 0:
                x = x0
            elif sample_type == "sde":
                x = (1 - t_next) * x0 + t_next * noise[i + 1]
            else:
                x = x + (t_next - t) * v
    assert (image - x.clamp(-1, 1)).abs().max().item() <= 1e-4


def test_one_generator_draws_for_the_whole_batch():
    decoder = tiny_decoder("v1")
    latent, text = inputs(TINY_CONFIGS["v1"], 2, (1, 1))
    a = decode(decoder, latent, 0.0, text, generator=torch.Generator().manual_seed(7))
    b = decode(decoder, latent, 0.0, text, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("unseeded", [[1], [0, 2]])
def test_rows_without_a_generator_batch_with_seeded_rows(unseeded):
    """A request that passed no generator shares a decode with seeded ones: they keep their own noise."""
    decoder = tiny_decoder("v1")
    latent, text = inputs(TINY_CONFIGS["v1"], 3, (1, 2), seed=2)
    seeds = [None if i in unseeded else 40 + i for i in range(3)]
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    batched = decode(decoder, latent, list(SIGMAS), text, generator=generators)
    for i, seed in enumerate(seeds):
        if seed is not None:
            alone = decode(decoder, latent[i : i + 1], SIGMAS[i], text[i : i + 1], generator=_generators([seed]))
            assert (batched[i : i + 1] - alone).abs().max().item() <= 1e-4
    assert torch.isfinite(batched).all()
    # NOTE: unseeded rows draw from the global RNG, so two decodes of them differ.
    again = decode(decoder, latent, list(SIGMAS), text, generator=[None] * 3)
    assert (batched[unseeded[0]] - again[unseeded[0]]).abs().mean() > 1e-3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timesteps": (0.9, 0.5)}, "end at 0.0"),
        ({"timesteps": (0.5, 0.9, 0.0)}, "decrease strictly"),
        ({"sample_type": "euler"}, "sample_type='euler'"),
    ],
)
def test_sampler_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PiDSamplerConfig(**kwargs)


def test_mismatched_rows_name_the_counts():
    decoder = tiny_decoder("v1")
    latent, text = inputs(TINY_CONFIGS["v1"], 2, (1, 1))
    with pytest.raises(ValueError, match="1 rows for 2 latents"):
        decode(decoder, latent, 0.0, text[:1])
    with pytest.raises(ValueError, match="sigma has 3 values for a batch of 2"):
        decode(decoder, latent, [0.0, 0.1, 0.2], text)
    with pytest.raises(ValueError, match="3 generators for a batch of 2"):
        decode(decoder, latent, 0.0, text, generator=_generators([1, 2, 3]))
