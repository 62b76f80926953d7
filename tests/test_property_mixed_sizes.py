"""Property: whatever the mix of sizes and the arrival schedule, each request equals its own solo run."""

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_stepbatch import SchedulerConfig, StepBatched

from .references import TOLERANCE, call_with_delays, flux_pipe, max_diff, seeded

SIZES = [(16, 16), (32, 48), (64, 64), (16, 64), (48, 32)]

request_params = st.fixed_dictionaries(
    {
        "size": st.sampled_from(SIZES),
        "seed": st.integers(0, 2),
        "num_inference_steps": st.integers(1, 4),
        "true_cfg_scale": st.sampled_from([1.0, 2.0]),
        "max_sequence_length": st.sampled_from([8, 16]),
        "delay_ms": st.integers(0, 20),
    }
)


def as_kwargs(size, seed, steps, cfg, text_length):
    return dict(prompt="a red circle at the top", negative_prompt="blur" if cfg > 1 else None, true_cfg_scale=cfg,
                height=size[0], width=size[1], num_inference_steps=steps, guidance_scale=3.5, seed=seed,
                output_type="pt", max_sequence_length=text_length)


@functools.lru_cache(maxsize=None)
def solo_reference(name, *key):
    return flux_pipe(name)(**seeded(as_kwargs(*key))).images


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["dev-tiny", "dev-wide"]),
    cost_aware=st.booleans(),
    requests=st.lists(request_params, min_size=2, max_size=5),
)
def test_random_size_mixes_equal_solo(name, cost_aware, requests):
    keys = [(r["size"], r["seed"], r["num_inference_steps"], r["true_cfg_scale"], r["max_sequence_length"])
            for r in requests]
    expected = [solo_reference(name, *key) for key in keys]
    with StepBatched(flux_pipe(name), scheduler=SchedulerConfig(max_batch_size=8, cost_aware=cost_aware)) as sb:
        results = call_with_delays(sb, [as_kwargs(*key) for key in keys], [r["delay_ms"] for r in requests])
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
