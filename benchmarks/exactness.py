"""What exactness costs, and what the promise without it means for 8-bit images, side by side in one run.

    python benchmarks/exactness.py            # 8 concurrent requests, both tiny FLUX.1 workloads
    python benchmarks/exactness.py --smoke    # seconds, for CI

1. Throughput of N concurrent requests (closed loop): the plain pipeline called sequentially, StepBatched as it
   ships (merged rows on their solo kernels: bit-identical for same-shape merges on a CPU) and
   `StepBatched(exact=True)` (every request's calls its own), in interleaved rounds, medians.
2. Packed sizes and padded texts (promised within 1e-4, not bit for bit): of requests that shared packed calls,
   how many 8-bit images differ from the request alone, and by how many levels at most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads (benchmarks/throughput.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.throughput import (  # noqa: E402
    WORKLOADS,
    command_line,
    in_worker_thread,
    request_kwargs,
    run_sequential,
    run_stepbatched,
    write_report,
)
from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_pipeline, tiny_qwenimage_pipeline  # noqa: E402

SIDES = ("sequential", "stepbatched", "exact")


def time_sides(workload_name: str, n: int, steps: int, rounds: int) -> dict:
    workload = WORKLOADS[workload_name]
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=workload.size, vae_blocks=4)  # as benchmarks/throughput.py
    make = lambda i: request_kwargs(i, workload, steps)  # noqa: E731
    arrivals = [0.0] * n
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with StepBatched(pipe) as batched, StepBatched(pipe, exact=True) as exact:
        for sb in (batched, exact):  # NOTE: warm-up: the row-kernel probes and the cost model's first calls
            in_worker_thread(run_stepbatched, sb, make, n, arrivals)
        for _ in range(rounds):
            runs["sequential"].append(in_worker_thread(run_sequential, pipe, make, n, arrivals))
            runs["stepbatched"].append(in_worker_thread(run_stepbatched, batched, make, n, arrivals))
            runs["exact"].append(in_worker_thread(run_stepbatched, exact, make, n, arrivals))
    throughput = {side: statistics.median(r["throughput_images_per_s"] for r in runs[side]) for side in SIDES}
    return {
        "workload": workload_name, "requests": n, "steps": steps, "rounds": rounds,
        "images_per_s": throughput,
        "stepbatched_over_sequential": throughput["stepbatched"] / throughput["sequential"],
        "exact_over_sequential": throughput["exact"] / throughput["sequential"],
        "exact_over_stepbatched": throughput["exact"] / throughput["stepbatched"],
    }


def _eight_bit(image: np.ndarray) -> np.ndarray:
    return (image * 255).round().astype(np.int16)  # as diffusers' numpy_to_pil rounds


def packed_levels(requests: int, steps: int) -> dict:
    """Requests of two sizes (FLUX.1, packed) and of texts of other lengths (Qwen-Image, padded), each merged and
    alone: how many of their 8-bit images moved, and by how much."""
    cases = {
        "flux packed sizes": (tiny_flux_pipeline(), lambda i: dict(height=32 + 16 * (i % 2), width=32)),
        "qwen-image padded texts": (tiny_qwenimage_pipeline(), lambda i: dict(height=32, width=32)),
    }
    report = {}
    for name, (pipe, size) in cases.items():
        calls = [dict(prompt="a red circle" + " on a hill" * (i % 3), num_inference_steps=steps, output_type="np",
                      generator_seed=i, **size(i)) for i in range(requests)]

        def run(sb, call):
            call = dict(call)
            call["generator"] = torch.Generator().manual_seed(call.pop("generator_seed"))
            return sb.submit(**call)

        with StepBatched(pipe) as sb:
            merged = [f.result().images for f in [run(sb, call) for call in calls]]
            rows = max(sb.stats()["rows_histogram"]["denoise"])
        with StepBatched(pipe, exact=True) as sb:
            alone = [run(sb, call).result().images for call in calls]
        floats = [float(np.abs(a - b).max()) for a, b in zip(merged, alone)]
        levels = [int(np.abs(_eight_bit(a) - _eight_bit(b)).max()) for a, b in zip(merged, alone)]
        pixels = sum(int((_eight_bit(a) != _eight_bit(b)).sum()) for a, b in zip(merged, alone))
        report[name] = {"requests": requests, "most_rows_in_a_call": rows, "max_float_difference": max(floats),
                        "images_with_a_moved_level": sum(level > 0 for level in levels),
                        "most_levels_moved": max(levels), "moved_values": pixels,
                        "values": int(sum(a.size for a in merged))}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--packed-requests", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="2 requests x 2 steps, one round, the small workload")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "exactness.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.steps, args.rounds, args.packed_requests = 2, 2, 1, 4
    torch.set_num_threads(1)
    started = time.perf_counter()
    workloads = ["overhead-bound"] if args.smoke else args.workloads
    timing = [time_sides(name, args.requests, args.steps, args.rounds) for name in workloads]
    for result in timing:
        rates = result["images_per_s"]
        print(f"{result['workload']:>15}: sequential {rates['sequential']:.2f} img/s, StepBatched "
              f"{rates['stepbatched']:.2f} ({result['stepbatched_over_sequential']:.2f}x), exact=True "
              f"{rates['exact']:.2f} ({result['exact_over_sequential']:.2f}x; {result['exact_over_stepbatched']:.2f}"
              f" of StepBatched)")
    levels = packed_levels(args.packed_requests, args.steps)
    for name, found in levels.items():
        print(f"{name}: {found['images_with_a_moved_level']} of {found['requests']} images moved by at most "
              f"{found['most_levels_moved']} level(s) ({found['moved_values']} of {found['values']} values); "
              f"max float difference {found['max_float_difference']:.1e}")
    report = {"command": command_line("benchmarks/exactness.py", argv), "threads": 1,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "timing": timing, "packed_levels": levels,
              "seconds": time.perf_counter() - started}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
