"""Throughput and latency against concurrency, sequential vs StepBatched, as a PNG (and JSON).

    python benchmarks/plot.py                      # concurrency 1, 2, 4, 8 on the overhead-bound model
    python benchmarks/plot.py --smoke

As concurrency grows, sequential serving keeps its throughput and its latency grows linearly; step-level
batching raises throughput while the batch fits.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads; see throughput.py

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from throughput import WORKLOADS, in_worker_thread, request_kwargs, run_sequential, run_stepbatched  # noqa: E402

from diffusers_stepbatch.testing import tiny_flux_pipeline  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="overhead-bound", choices=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "concurrency.png")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.steps = [1, 2], 2
    workload = WORKLOADS[args.workload]
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=workload.size, vae_blocks=4)
    torch.manual_seed(0)
    rows = []
    for n in args.concurrency:
        arrivals = [0.0] * n
        make_kwargs = functools.partial(request_kwargs, workload=workload, steps=args.steps)
        sequential = in_worker_thread(run_sequential, pipe, make_kwargs, n, arrivals)
        batched = run_stepbatched(pipe, make_kwargs, n, arrivals)
        rows.append({"concurrency": n, "sequential": sequential, "stepbatched": batched})
        print(f"n={n}: throughput {sequential['throughput_images_per_s']:.2f} -> "
              f"{batched['throughput_images_per_s']:.2f} images/s "
              f"({batched['throughput_images_per_s'] / sequential['throughput_images_per_s']:.2f}x), "
              f"mean latency {sequential['latency_mean_s']:.3f} -> {batched['latency_mean_s']:.3f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrency = [r["concurrency"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("sequential", "o--"), ("stepbatched", "s-")):
        left.plot(concurrency, [r[mode]["throughput_images_per_s"] for r in rows], style, label=mode)
        right.plot(concurrency, [r[mode]["latency_mean_s"] for r in rows], style, label=mode)
    left.set(xlabel="concurrent requests", ylabel="images / s", title="Throughput")
    right.set(xlabel="concurrent requests", ylabel="seconds", title="Mean latency")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{workload.name} Flux transformer, {args.steps} steps (measured in one run)")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)
    report = {"workload": workload.name, "steps": args.steps, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return report


if __name__ == "__main__":
    main()
