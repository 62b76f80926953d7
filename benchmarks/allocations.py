"""Latent buffer manager: tensor allocations and host overhead of the denoising loop, with and without.

    python benchmarks/allocations.py            # two workloads, 28 steps
    python benchmarks/allocations.py --smoke    # a few seconds

An allocation is an op output with new storage (views and `out=` writes are not), counted by
`diffusers_stepbatch.buffers.AllocationCounter` in the engine steps of the denoising loop, outside the
transformer's forward (the model's own temporaries are the same either way; they are reported separately).
The engine is driven in this thread on requests planned up front, so both sides see identical batches.
Overhead per step is an engine step's wall time minus its transformer forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.buffers import AllocationCounter  # noqa: E402
from diffusers_stepbatch.engine.scheduler import SchedulerConfig  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_pipeline  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "allocations.json"


def workloads(steps: int) -> dict[str, list[dict]]:
    base = dict(height=32, width=32, max_sequence_length=16, output_type="latent", num_inference_steps=steps)
    guided = dict(base, prompt="a blue square", negative_prompt="noise", true_cfg_scale=2.0, guidance_scale=5.0)
    return {
        "1 request, true CFG": [guided],
        "4 mixed requests": [
            guided,
            dict(base, prompt="a red circle"),
            dict(base, prompt="a cat", num_images_per_prompt=2),
            dict(base, prompt="a dog", num_inference_steps=max(steps - 4, 1), guidance_scale=7.0),
        ],
    }


def drive(pipe, calls: list[dict], buffers: bool, counter: AllocationCounter | None):
    """Run `calls` to completion on a fresh engine driven here; per loop step: (allocations, seconds, model s)."""
    sb = StepBatched(pipe, latent_buffers=buffers, scheduler=SchedulerConfig(max_batch_size=32, cost_aware=False))
    requests = []
    for i, kwargs in enumerate(calls):
        kwargs = dict(kwargs, generator=torch.Generator().manual_seed(i))
        requests.append(sb._make_request((), kwargs, 0, None))
    for request in requests:
        sb.engine.scheduler.add(request)
    model = {"s": 0.0}

    def start(*_):
        model["t0"] = time.perf_counter()

    def stop(*_):
        model["s"] += time.perf_counter() - model["t0"]

    hooks = [pipe.transformer.register_forward_pre_hook(start), pipe.transformer.register_forward_hook(stop)]
    steps = []
    try:
        with torch.no_grad():
            while sb.engine.scheduler.has_work():
                pending = [r.pending for r in sb.engine.scheduler.running]
                in_loop = bool(pending) and all(p is not None and p.kind == "denoise" for p in pending)
                count, model["s"] = counter.count if counter else 0, 0.0
                started = time.perf_counter()
                sb.engine.step()
                if in_loop:
                    steps.append(((counter.count - count) if counter else 0, time.perf_counter() - started, model["s"]))
    finally:
        for hook in hooks:
            hook.remove()
    return [request.handle.result().images for request in requests], steps


def measure(pipe, calls: list[dict], repeats: int) -> dict:
    side = {}
    outputs = {}
    for buffers in (True, False):
        with AllocationCounter().exclude(pipe.transformer) as loop_counter:
            outputs[buffers], steps = drive(pipe, calls, buffers, loop_counter)
        with AllocationCounter() as all_counter:
            _, with_model = drive(pipe, calls, buffers, all_counter)
        overheads = []
        for _ in range(repeats):  # timing runs: no counter (a dispatch mode slows every op)
            overheads.append(statistics.median(s - m for _, s, m in drive(pipe, calls, buffers, None)[1]))
        counts = [n for n, _, _ in steps]
        side[buffers] = {
            "loop_steps": len(counts),
            "allocations": sum(counts),
            "allocations_first_two_steps": sum(counts[:2]),
            "allocations_per_step_after": (sum(counts[2:]) / max(len(counts) - 2, 1)),
            "allocations_including_model": sum(n for n, _, _ in with_model),
            "overhead_ms_per_step": 1000 * statistics.median(overheads),
        }
    identical = all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))
    with_, without = side[True], side[False]
    return {
        "with_buffers": with_,
        "without_buffers": without,
        "allocation_reduction": 1 - with_["allocations"] / without["allocations"],
        "overhead_ratio": with_["overhead_ms_per_step"] / without["overhead_ms_per_step"],
        "bit_identical": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=7, help="timing runs per side (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see benchmarks/teacache.py)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (.smoke.json with --smoke)")
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_suffix(".smoke.json") if args.smoke else RESULTS)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.steps, args.repeats = 6, 1
    pipe = tiny_flux_pipeline(guidance_embeds=True)
    results = {}
    for name, calls in workloads(args.steps).items():
        results[name] = r = measure(pipe, calls, args.repeats)
        w, wo = r["with_buffers"], r["without_buffers"]
        print(f"{name}, {args.steps} steps ({w['loop_steps']} loop steps):")
        print(f"  allocations in the loop     {w['allocations']:>6} with  vs {wo['allocations']:>6} without  "
              f"(-{r['allocation_reduction']:.1%}); with: {w['allocations_first_two_steps']} in the first two "
              f"steps, {w['allocations_per_step_after']:.1f} per step after (without: "
              f"{wo['allocations_per_step_after']:.1f})")
        print(f"  including the transformer   {w['allocations_including_model']:>6} with  vs "
              f"{wo['allocations_including_model']:>6} without")
        print(f"  host overhead per step      {w['overhead_ms_per_step']:>6.3f} ms with vs "
              f"{wo['overhead_ms_per_step']:>6.3f} ms without (x{r['overhead_ratio']:.2f})")
        print(f"  outputs bit-identical: {r['bit_identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "torch_threads": args.threads, "smoke": args.smoke,
                                    "workloads": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
