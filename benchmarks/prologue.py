"""A request's prologue in its caller's thread: how long `submit` takes, and its module scans side by side.

    python benchmarks/prologue.py            # tiny Flux pipeline, 200 submits
    python benchmarks/prologue.py --smoke    # a few seconds, for CI

With N concurrent callers the prologues run one after another under the GIL while the engine waits for their
rows, so their cost adds up per burst. Measured in a worker thread at one intra-op thread:
- `submit` on an idle engine (each request finishes before the next is submitted; only the caller's share);
- diffusers' `pipe._execution_device` vs `module_scan.execution_device(pipe)` (remembered while nothing moved);
- `named_modules()` + `getattr` vs `module_scan.walk` + `own_attribute` over every component (the hook scans).
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
from throughput import WORKLOADS, command_line, in_worker_thread, request_kwargs, write_report  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.module_scan import execution_device, own_attribute, walk  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_pipeline  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def bench(repeats: int) -> dict:
    workload = WORKLOADS["overhead-bound"]
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=workload.size, vae_blocks=4)
    models = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    sb = StepBatched(pipe)

    def submit_ms() -> dict:
        # NOTE: the caller's CPU time too: once queued, the woken engine thread may hold the GIL before `submit`
        # returns, which the wall time counts and the thread's CPU time does not.
        wall, cpu = [], []
        for i in range(repeats):
            kwargs = request_kwargs(i % 4, workload, 2)  # NOTE: 4 prompts: prompt-cache hits after the first round
            started, started_cpu = time.perf_counter(), time.thread_time()
            handle = sb.submit(**kwargs)
            wall.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
            handle.result()
        return {"wall": 1000 * statistics.median(wall), "caller_cpu": 1000 * statistics.median(cpu)}

    def torch_scan():
        return [getattr(m, "_diffusers_hook", None) for model in models for _, m in model.named_modules()]

    def own_scan():
        return [own_attribute(m, "_diffusers_hook") for model in models for _, m in walk(model)]

    def measure() -> dict:
        torch.set_num_threads(1)
        with torch.no_grad():
            submit_ms()  # warm-up
            return {
                "submit_ms": submit_ms(),
                "execution_device_ms": {"diffusers": median_ms(lambda: pipe._execution_device, repeats),
                                        "module_scan": median_ms(lambda: execution_device(pipe), repeats)},
                "hook_scan_ms": {"named_modules": median_ms(torch_scan, repeats),
                                 "module_scan": median_ms(own_scan, repeats)},
                "modules": sum(1 for model in models for _ in model.modules()),
            }

    result = in_worker_thread(measure)
    sb.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="20 repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prologue.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats = 20
    result = bench(args.repeats)
    device, scan = result["execution_device_ms"], result["hook_scan_ms"]
    print(f"tiny Flux pipeline, {result['modules']} modules; medians of {args.repeats}")
    submit = result["submit_ms"]
    print(f"submit on an idle engine (the caller's prologue): {submit['wall']:.3f} ms wall, "
          f"{submit['caller_cpu']:.3f} ms of the caller's CPU time")
    print(f"execution device: diffusers {device['diffusers']:.3f} ms, module_scan {device['module_scan']:.3f} ms "
          f"({device['diffusers'] / device['module_scan']:.1f}x)")
    print(f"hook scan: named_modules {scan['named_modules']:.3f} ms, module_scan {scan['module_scan']:.3f} ms "
          f"({scan['named_modules'] / scan['module_scan']:.1f}x)")
    report = {"command": command_line("benchmarks/prologue.py", argv), "repeats": args.repeats, **result}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
