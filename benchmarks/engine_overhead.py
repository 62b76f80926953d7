"""The engine's time outside model calls, with and without the fused scheduler update, side by side in one run.

    python benchmarks/engine_overhead.py                        # 8, 16, 32 concurrent requests, 3 rounds
    python benchmarks/engine_overhead.py --smoke                # seconds, for CI

Both sides serve the same closed-loop rounds on one tiny overhead-bound Flux (true CFG on every other request),
each on its own long-lived, warmed-up engine, rounds interleaved: "fused" is the default (one batched CFG combine
+ Euler step per engine step, programs/fused_update.py), "per request" runs each request's own
`scheduler.step`. Reported: `stats()["outside_model_ms_per_step"]`, its share of the engine step, and images/s.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads (see throughput.py)

import torch
from throughput import WORKLOADS, command_line, in_worker_thread, request_kwargs, run_stepbatched, write_report

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.programs.fused_update import FusedEuler
from diffusers_stepbatch.testing import tiny_flux_pipeline

SIDES = ("fused", "per request")


def per_request_steps():
    """Every program plans as if no scheduler allowed the fused update."""
    return mock.patch.object(FusedEuler, "for_scheduler", classmethod(lambda cls, *args, **kwargs: None))


def make_kwargs(i: int, steps: int) -> dict:
    kwargs = request_kwargs(i, WORKLOADS["overhead-bound"], steps)
    if i % 2:
        kwargs.update(negative_prompt="blurry", true_cfg_scale=2.0)
    return kwargs


def bench(n: int, steps: int, rounds: int) -> dict:
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=WORKLOADS["overhead-bound"].size, vae_blocks=4)
    in_worker_thread(lambda: pipe(**make_kwargs(1, 2)))  # warm-up
    kwargs = functools.partial(make_kwargs, steps=steps)
    engines = {side: StepBatched(pipe, max_batch_size=2 * n) for side in SIDES}
    samples: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_index in range(rounds + 1):  # round 0 warms both engines' cost models up
        for side in SIDES:
            with per_request_steps() if side == "per request" else nullcontext():
                result = run_stepbatched(engines[side], kwargs, n, [0.0] * n)
            if round_index:
                samples[side].append(result)
    for engine in engines.values():
        engine.close()
    summary = {}
    for side, results in samples.items():
        outside = statistics.median(r["outside_model_ms_per_step"] for r in results)
        step = statistics.median(r["ms_per_step"] for r in results)
        summary[side] = {"outside_model_ms_per_step": outside, "ms_per_step": step, "outside_share": outside / step,
                         "images_per_s": statistics.median(r["throughput_images_per_s"] for r in results)}
    summary["outside_model_ratio_per_request_over_fused"] = (summary["per request"]["outside_model_ms_per_step"]
                                                             / summary["fused"]["outside_model_ms_per_step"])
    return {"concurrency": n, "steps": steps, "rounds": rounds, "sides": summary}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine_overhead.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.steps, args.rounds = [4], 2, 1
    torch.set_num_threads(args.threads)
    results = []
    print(f"{'requests':>8}  {'side':12}{'outside model ms/step':>23}{'step ms':>9}{'share':>7}{'images/s':>10}")
    for n in args.concurrency:
        results.append(bench(n, args.steps, args.rounds))
        for side in SIDES:
            r = results[-1]["sides"][side]
            print(f"{n:>8}  {side:12}{r['outside_model_ms_per_step']:23.2f}{r['ms_per_step']:9.1f}"
                  f"{r['outside_share']:7.1%}{r['images_per_s']:10.2f}")
        print(f"{'':>8}  outside-model time, per request / fused: "
              f"{results[-1]['sides']['outside_model_ratio_per_request_over_fused']:.2f}x")
    report = {"command": command_line("benchmarks/engine_overhead.py", argv),
              "torch_threads": torch.get_num_threads(), "results": results}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
