"""Mixed resolutions: sequential plain calls vs per-size batching vs packed calls, side by side in one run.

    python benchmarks/mixed_resolution.py            # both CPU workloads, 8 concurrent requests over 4 sizes
    python benchmarks/mixed_resolution.py --smoke    # a few seconds, for CI
    python benchmarks/mixed_resolution.py --workloads flux1-width --threads 1   # CUDA: 512 + 768x512 + 1024, bf16

Each round submits N requests at once (closed loop) whose sizes cycle through the workload's 3-4 sizes and
aspect ratios. Sides, each on its own `StepBatched` that is kept warm across rounds (as a server's would be):
- sequential: the unwrapped pipeline, one request after another;
- per-size: `StepBatched(pipe, mixed_resolution=False)`: one batched forward per size;
- packed: `StepBatched(pipe)`: the engine packs sizes into one forward where it measured that to pay;
- packed-always: `SchedulerConfig(cost_aware=False)`: every group of sizes packs (the mechanism alone).
After `--warmup-rounds` unmeasured rounds, every round runs every side (in an order that rotates) at each
of `--threads` intra-op thread counts (model calls off the main thread); each side is reported at its best
count, and ratios are medians of each round's own ratio (so a change in the machine's load between rounds
moves both sides of it). Ratios are what to read, not seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from throughput import WORKLOADS, command_line, in_worker_thread, percentile, run_clients, write_report  # noqa: E402

from diffusers_stepbatch import SchedulerConfig, StepBatched  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_pipeline  # noqa: E402

# (height, width) per workload: square, smaller, and two aspect ratios of about the main size's tokens.
# NOTE: with 8 rows the tiny transformer at throughput.py's 256 px (256 tokens) is already compute-dominated
# (a profile of the packed call: attention, matmuls and GELU ~60%, packing's gathers and copies ~10%), so
# the overhead-bound mix uses thumbnail sizes, where a forward's fixed cost dominates. Image tokens are
# (side / (2 x vae_scale_factor))^2 with vae_scale_factor = 2 ** (--vae-blocks - 1). The default 4 blocks is
# throughput.py's pipeline (vae_scale_factor 8): 4-16 image tokens per row for the overhead-bound mix (the grids
# of packed_forward.py) and 256-1024 for the compute-bound one. --vae-blocks 2 gives the overhead-bound mix
# 64-256 tokens per row (~1,750 per packed call), between the two regimes.
SIZE_MIXES = {
    "overhead-bound": [(64, 64), (32, 32), (48, 80), (80, 48)],
    "compute-bound": [(512, 512), (256, 256), (384, 640), (640, 384)],
    # CUDA only: the GPU suite's FLUX.1-width transformer (benchmarks/gpu_suite.py) in bfloat16
    "flux1-width": [(512, 512), (768, 512), (1024, 1024)],
}
CUDA_WORKLOADS = {"flux1-width"}


def build_pipeline(workload_name: str, vae_blocks: int):
    """The workload's tiny Flux pipeline; the FLUX.1-width one on the GPU in bfloat16."""
    if workload_name in CUDA_WORKLOADS:
        from gpu_suite import FLUX1_WIDTH

        return tiny_flux_pipeline(size=FLUX1_WIDTH, vae_blocks=vae_blocks).to("cuda", torch.bfloat16)
    return tiny_flux_pipeline(size=WORKLOADS[workload_name].size, vae_blocks=vae_blocks)


def request_kwargs(i: int, sizes, steps: int) -> dict:
    height, width = sizes[i % len(sizes)]
    return dict(prompt=f"a red circle {i}", height=height, width=width, num_inference_steps=steps,
                guidance_scale=3.5, generator=torch.Generator().manual_seed(i), output_type="pt",
                max_sequence_length=32)


def closed_loop(call, n: int, sizes, steps: int) -> dict:
    """N requests at once from N client threads; returns wall time and per-request latencies."""
    latencies = [0.0] * n

    def client(i: int, start: float) -> None:
        call(**request_kwargs(i, sizes, steps)).images.cpu()
        latencies[i] = time.perf_counter() - start

    start = run_clients(n, client)  # released together, as a server's workers
    return {"wall_s": time.perf_counter() - start, "latencies": latencies}


def sequential(pipe, n: int, sizes, steps: int) -> dict:
    def run():
        latencies, start = [], time.perf_counter()
        for i in range(n):
            pipe(**request_kwargs(i, sizes, steps)).images.cpu()
            latencies.append(time.perf_counter() - start)
        return {"wall_s": time.perf_counter() - start, "latencies": latencies}

    return in_worker_thread(run)


def call_stats(sb: StepBatched, before: dict) -> dict:
    """This round's denoise calls: how many, rows per call, packed calls and tokens per packed call."""
    stats = sb.stats()
    denoise = [rows for _, rows in stats["denoise_rows_over_time"]][len(before["denoise_rows_over_time"]):]
    packed = stats["mixed"]["calls"] - before["mixed"]["calls"]
    tokens = stats["mixed"]["tokens_per_call"] * stats["mixed"]["calls"] - (
        before["mixed"]["tokens_per_call"] * before["mixed"]["calls"])
    return {"denoise_calls": len(denoise), "rows_per_call": statistics.fmean(denoise) if denoise else 0.0,
            "packed_calls": packed, "tokens_per_packed_call": tokens / packed if packed else 0.0}


def bench(workload_name: str, n: int, steps: int, rounds: int, threads: list[int], vae_blocks: int = 4,
          warmup_rounds: int = 3) -> dict:
    sizes = SIZE_MIXES[workload_name]
    pipe = build_pipeline(workload_name, vae_blocks)
    engines = {
        "per-size": StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=n), mixed_resolution=False),
        "packed": StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=n)),
        "packed-always": StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=n, cost_aware=False)),
    }
    for count in threads:
        torch.set_num_threads(count)
        # NOTE: unmeasured rounds first, as a long-lived server's engine has had: its cost models explore here
        for _ in range(warmup_rounds):
            for sb in engines.values():
                closed_loop(sb, n, sizes, steps)
        sequential(pipe, 1, sizes, steps)
    # Every round runs every side at every thread count, so that a change in the machine's load moves them all;
    # NOTE: the order of the sides rotates from round to round: the side that ran first after another one
    # measured up to ~10% slower here.
    runs: dict[tuple[str, int], list[dict]] = {}
    sides = ["sequential", *engines]
    for r in range(rounds):
        for count in threads:
            torch.set_num_threads(count)
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                if side == "sequential":
                    runs.setdefault((side, count), []).append(sequential(pipe, n, sizes, steps))
                    continue
                sb = engines[side]
                before = sb.stats()
                run = closed_loop(sb, n, sizes, steps)
                runs.setdefault((side, count), []).append({**run, **call_stats(sb, before)})
    for sb in engines.values():
        sb.close()

    result = {"workload": workload_name, "sizes": sizes, "concurrency": n, "steps": steps, "rounds": rounds,
              "warmup_rounds": warmup_rounds, "vae_scale_factor": pipe.vae_scale_factor, "sides": {}}
    for side in ("sequential", "per-size", "packed", "packed-always"):
        per_count = {}
        for count in threads:
            side_runs = runs[(side, count)]
            latencies = [lat for r in side_runs for lat in r["latencies"]]
            per_count[count] = {"throughput_images_per_s": n / statistics.median(r["wall_s"] for r in side_runs),
                                "latency_p50_s": percentile(latencies, 0.5),
                                "latency_p95_s": percentile(latencies, 0.95)}
            for name in ("denoise_calls", "rows_per_call", "packed_calls", "tokens_per_packed_call"):
                if name in side_runs[0]:
                    per_count[count][name] = statistics.median(r[name] for r in side_runs)
        best = max(per_count, key=lambda c: per_count[c]["throughput_images_per_s"])
        result["sides"][side] = {"best_threads": best, **per_count[best],
                                 "by_threads": {str(c): v for c, v in per_count.items()}}

    def per_round(side: str, baseline: str) -> list[float]:
        """Each round's throughput ratio side / baseline, each side at its best thread count."""
        a = runs[(side, result["sides"][side]["best_threads"])]
        b = runs[(baseline, result["sides"][baseline]["best_threads"])]
        return [y["wall_s"] / x["wall_s"] for x, y in zip(a, b)]

    result["packed_vs_per_size_per_round"] = per_round("packed", "per-size")
    result["packed_vs_per_size"] = statistics.median(result["packed_vs_per_size_per_round"])
    result["packed_vs_sequential"] = statistics.median(per_round("packed", "sequential"))
    result["packed_always_vs_per_size"] = statistics.median(per_round("packed-always", "per-size"))
    return result


def print_result(result: dict) -> None:
    print(f"\n{result['workload']}: {result['concurrency']} requests x {result['steps']} steps over sizes "
          f"{', '.join(f'{h}x{w}' for h, w in result['sizes'])}")
    print(f"{'side':<13} {'threads':>7} {'images/s':>9} {'p50 s':>7} {'p95 s':>7} {'calls':>6} {'rows/call':>9} "
          f"{'packed':>6} {'tokens/packed':>13}")
    for side, row in result["sides"].items():
        print(f"{side:<13} {row['best_threads']:>7} {row['throughput_images_per_s']:>9.2f} "
              f"{row['latency_p50_s']:>7.3f} {row['latency_p95_s']:>7.3f} {row.get('denoise_calls', '-'):>6} "
              f"{row.get('rows_per_call', 0):>9.2f} {row.get('packed_calls', '-'):>6} "
              f"{row.get('tokens_per_packed_call', 0):>13.0f}")
    print("packed / per-size per round: " + ", ".join(f"{r:.2f}" for r in result["packed_vs_per_size_per_round"]))
    print(f"packed / per-size: {result['packed_vs_per_size']:.2f}x   "
          f"packed / sequential: {result['packed_vs_sequential']:.2f}x   "
          f"packed-always / per-size: {result['packed_always_vs_per_size']:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-rounds", type=int, default=3, help="unmeasured rounds per engine first")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vae-blocks", type=int, default=4, help="tiny VAE depth: vae_scale_factor 2 ** (n - 1)")
    parser.add_argument("--workloads", nargs="+", default=[w for w in SIZE_MIXES if w not in CUDA_WORKLOADS],
                        choices=list(SIZE_MIXES))
    parser.add_argument("--smoke", action="store_true", help="2 requests x 2 steps, overhead-bound only, 1 round")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mixed_resolution.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.steps, args.rounds, args.threads, args.workloads = 2, 2, 1, [1], ["overhead-bound"]
        args.warmup_rounds = 1
    on_gpu = set(args.workloads) & CUDA_WORKLOADS
    if on_gpu and not torch.cuda.is_available():
        parser.error(f"the {', '.join(sorted(on_gpu))} workload needs a CUDA device")
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    results = {"command": command_line("benchmarks/mixed_resolution.py", argv), "torch": torch.__version__,
               "device": device, "date": time.strftime("%Y-%m-%d"), "workloads": []}
    for name in args.workloads:
        result = bench(name, args.concurrency, args.steps, args.rounds, args.threads, args.vae_blocks,
                       args.warmup_rounds)
        print_result(result)
        results["workloads"].append(result)
    write_report(args.out, results)
    return results


if __name__ == "__main__":
    main()
