"""The promise per path (docs/conformance.md): on the CPU a request merged with others of its shape gets its solo
run's output bit for bit, whatever the CPU's vector width; packed sizes and padded texts stay within 1e-4; with
`exact=True` every path is bit for bit.

On an AVX2 machine the toy model's seed-0 image inside a burst of 16 differed from seed 0 alone by one 8-bit level:
the dedicated programs' merged forwards ran other GEMM kernels than a request's solo calls (`models/row_kernels.py`
now serves them too), a convolution's kernel changed between the probe's 3 rows and a call's 16, and a merged VAE
decode rounds apart (CPU decodes now run per request).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.models.row_kernels import solo_kernels

from .references import family_pipe, family_size, flux_pipe, in_lockstep

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
PACKED_BOUND = 1e-4  # the promise for packed sizes and padded texts

# (prompt, seed, steps) of four requests: other texts, seeds and step counts share every forward they can
REQUESTS = {
    "steps": [("a cat", 0, 3), ("a dog on a hill", 1, 4), ("a cat", 2, 2), ("red", 3, 3)],
    "seeds": [("a red square", 5, 2), ("a red square", 6, 2), ("blue", 7, 2), ("a cat", 8, 5)],
}


def _pipe(family: str):
    return flux_pipe() if family == "flux" else family_pipe(family)


def _size(family: str) -> tuple[int, int]:
    return (32, 32) if family == "flux" else family_size(family)


def _calls(family: str, composition: str, sizes: list[tuple[int, int]] | None = None) -> list[dict]:
    height, width = _size(family)
    calls = [dict(prompt=prompt, seed=seed, num_inference_steps=steps, height=height, width=width, output_type="np")
             for prompt, seed, steps in REQUESTS[composition]]
    for call, size in zip(calls, sizes or ()):
        call.update(height=size[0], width=size[1])
    return calls


def _merged_and_alone(pipe, calls: list[dict], **options) -> tuple[list, list, int, int]:
    """Each call's output submitted with the others (in lockstep) and alone; and the most rows a denoising call held,
    in the merged run and in any of the runs alone."""
    with StepBatched(pipe, **options) as sb:
        merged = in_lockstep(sb, calls)
        rows = max(sb.stats()["rows_histogram"]["denoise"])
    alone, rows_alone = [], 0
    for call in calls:
        with StepBatched(pipe, **options) as sb:
            alone.append(in_lockstep(sb, [call])[0])
            rows_alone = max(rows_alone, max(sb.stats()["rows_histogram"]["denoise"]))
    return merged, alone, rows, rows_alone


@pytest.mark.parametrize("composition", sorted(REQUESTS))
@pytest.mark.parametrize("family", ["flux", "sd3-tiny", "sd3-patch2", "sdxl-euler", "sdxl-dpm", "sd-euler", "sd-dpm"])
def test_dedicated_programs_give_merged_rows_their_solo_bits(family, composition):
    merged, alone, rows, _ = _merged_and_alone(_pipe(family), _calls(family, composition))
    assert rows > 2, rows  # several requests really shared forwards
    for call, got, want in zip(REQUESTS[composition], merged, alone):
        assert np.array_equal(got, want), (call, float(np.abs(got - want).max()))


@pytest.mark.parametrize("family, sizes", [
    ("flux", [(32, 32), (32, 32), (48, 32), (32, 48)]),
    ("sd3-tiny", [(32, 32), (48, 32), (32, 32), (48, 48)]),
    ("qwen-tiny", None),  # texts of other lengths: padded and masked in one forward
    ("qwen-wide", [(48, 32), (32, 32), (48, 32), (32, 48)]),
])
def test_packed_sizes_and_padded_texts_stay_within_the_bound_and_exact_is_bit_for_bit(family, sizes):
    pipe = _pipe(family)
    calls = _calls(family, "steps", sizes)
    merged, alone, rows, _ = _merged_and_alone(pipe, calls)
    assert rows > 2, rows
    assert max(float(np.abs(got - want).max()) for got, want in zip(merged, alone)) <= PACKED_BOUND
    exact, alone, rows, rows_alone = _merged_and_alone(pipe, calls, exact=True)
    assert rows == rows_alone, rows  # every request's forwards ran as its own
    for call, got, want in zip(calls, exact, alone):
        assert np.array_equal(got, want), call


def test_a_transposed_input_gives_each_request_its_solo_rows():
    """A VAE attention's projections take a transposed view: one request's rows reach the GEMM as they lie, a merged
    tensor is first copied into rows, and the two kernels rounded apart."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    for rows in ([1, 1], [1, 1, 1, 1], [2, 1, 3]):
        x = torch.randn(sum(rows), 4, 16).transpose(1, 2)  # [rows, tokens, features], features strided
        solo = torch.cat([layer(block) for block in x.split(rows)])
        with torch.no_grad(), solo_kernels(layer, rows):
            assert torch.equal(layer(x), solo.detach()), rows


@pytest.mark.parametrize("requests", [2, 16])
def test_a_merged_convolution_is_probed_at_its_own_row_count(requests):
    """A 1x1 convolution of 64 channels took another oneDNN kernel at 16 rows than at the probe's 3."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(128, 64, 1)
    x = torch.randn(requests, 128, 16, 16)
    with torch.no_grad():
        solo = torch.cat([conv(row) for row in x.split(1)])
        with solo_kernels(conv, [1] * requests):
            assert torch.equal(conv(x), solo)


_BURST = """
import numpy as np, torch
from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.toy import load_pipeline
torch.set_num_threads(1)
prompt = "a red circle at the top left on a white background"
with StepBatched(load_pipeline(), max_batch_size=16) as sb:
    call = lambda seed: dict(prompt=prompt, num_inference_steps=8, output_type="np",
                             generator=torch.Generator().manual_seed(seed))
    alone = sb(**call(0)).images
    burst = [sb.submit(**call(seed)) for seed in range(16)]
    together = burst[0].result(300).images
    rows = max(sb.stats()["rows_histogram"]["denoise"])
print(torch.backends.cpu.get_cpu_capability(), rows, float(np.abs(alone - together).max()))
"""


@pytest.mark.parametrize("capability", ["this CPU's own", "AVX2 forced"])
def test_the_toy_seed_in_a_burst_of_sixteen_is_its_image_alone(capability):
    """The Ray Serve test's burst, on this CPU's kernels and on AVX2's (what an AVX2-only machine runs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if capability == "AVX2 forced":
        env.update(AVX2_ONLY)
    done = subprocess.run([sys.executable, "-c", _BURST], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found, rows, difference = done.stdout.split()[-3:]
    if capability == "AVX2 forced":
        assert found == "AVX2"
    assert int(rows) > 4 and float(difference) == 0.0, done.stdout


def test_the_generic_program_stays_within_the_bound_and_exact_is_bit_for_bit():
    """FluxImg2ImgPipeline runs on the generic program: its merged forwards keep each request's bits, but its merged
    VAE decodes of a 2-d VAE round 1e-7 apart (the norm's layout, as in the dedicated programs' decodes)."""
    from diffusers import FluxImg2ImgPipeline

    pipe = FluxImg2ImgPipeline(**flux_pipe().components)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    calls = [dict(call, image=image, strength=1.0) for call in _calls("flux", "steps")]
    merged, alone, rows, _ = _merged_and_alone(pipe, calls)
    assert rows > 2, rows
    assert max(float(np.abs(got - want).max()) for got, want in zip(merged, alone)) <= PACKED_BOUND
    exact, alone, _, _ = _merged_and_alone(pipe, calls, exact=True)
    for call, got, want in zip(calls, exact, alone):
        assert np.array_equal(got, want), call
