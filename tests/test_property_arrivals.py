"""Property: whatever the arrival schedule and parameters, each request equals its own solo diffusers run."""

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_stepbatch import StepBatched

from .references import TOLERANCE, call_with_delays, flux_pipe, max_diff, seeded

request_params = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 3),
        "num_inference_steps": st.integers(1, 6),
        "guidance_scale": st.sampled_from([1.0, 3.5, 7.0]),
        "true_cfg_scale": st.sampled_from([1.0, 2.0]),
        "prompt": st.sampled_from(["a cat", "a red square", "x y z"]),
        "delay_ms": st.integers(0, 15),
    }
)


@functools.lru_cache(maxsize=None)
def solo_reference(name, seed, steps, guidance, cfg, prompt):
    return flux_pipe(name)(**seeded(as_kwargs(seed, steps, guidance, cfg, prompt))).images


def as_kwargs(seed, steps, guidance, cfg, prompt):
    return dict(prompt=prompt, negative_prompt="blur" if cfg > 1 else None, true_cfg_scale=cfg, height=32, width=32,
                num_inference_steps=steps, guidance_scale=guidance, seed=seed, output_type="pt",
                max_sequence_length=16)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["dev-tiny", "schnell-tiny"]),
    max_batch_size=st.integers(1, 6),
    requests=st.lists(request_params, min_size=2, max_size=6),
)
def test_random_arrivals_equal_solo(name, max_batch_size, requests):
    keys = [(r["seed"], r["num_inference_steps"], r["guidance_scale"], r["true_cfg_scale"], r["prompt"])
            for r in requests]
    expected = [solo_reference(name, *key) for key in keys]
    with StepBatched(flux_pipe(name), max_batch_size=max_batch_size) as sb:
        results = call_with_delays(sb, [as_kwargs(*key) for key in keys], [r["delay_ms"] for r in requests])
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
    assert max(sb.stats()["rows_histogram"]["denoise"]) <= max(max_batch_size, 2)
