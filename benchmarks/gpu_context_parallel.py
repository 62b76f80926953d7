"""One model over several GPUs: context-parallel StepBatched against one GPU, in one run.

    python benchmarks/gpu_context_parallel.py --ranks 2          # CUDA: starts torchrun with 2 ranks (one per GPU)
    python benchmarks/gpu_context_parallel.py --dry-run          # CPU: 2 gloo ranks, the tiny test configs

Per family (the published configs of `gpu_families.py`, random bf16 weights), on rank 0:
- one GPU, before any rank switches context parallelism on: one request alone (latency), and N concurrent
  requests through StepBatched (throughput);
- N GPUs (Ulysses over every rank; `--ring` for Ring): the same request alone, and the same N requests;
so the JSON holds the single-request speed-up and the throughput ratio side by side, with the device, the
library versions and the date. Not measured here: Ring with Ulysses together, several machines, and how the
all-to-all overlaps compute (read a profile for that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_families import FAMILIES, _environment, _wait, _with_seed, add_build_arguments  # noqa: E402
from serve import free_port  # noqa: E402
from throughput import command_line, in_worker_thread, run_clients  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402

# NOTE: the families whose transformer has a context-parallel plan (Z-Image-Turbo's runs on rank 0 alone)
CP_FAMILIES = ["flux2-klein-4b", "qwen-image-edit", "wan2.1-1.3b"]


def _timed(device: str, run) -> float:
    start = time.perf_counter()
    run()
    _wait(device)
    return time.perf_counter() - start


def _alone_and_together(sb: StepBatched, calls, device: str, rounds: int) -> dict[str, float]:
    """Median seconds of the first request alone, and requests per second of all of them together."""
    alone, rates = [], []
    for _ in range(rounds):
        alone.append(in_worker_thread(lambda: _timed(device, lambda: sb(**calls()[0]))))

        def together() -> float:
            batch = calls()
            start = run_clients(len(batch), lambda i, start: sb(**batch[i]))
            _wait(device)
            return len(batch) / (time.perf_counter() - start)

        rates.append(in_worker_thread(together))
    return {"alone_s": statistics.median(alone), "together_per_s": statistics.median(rates)}


def bench_family(name: str, real: bool, rounds: int, args) -> dict | None:
    from diffusers import ContextParallelConfig

    family = FAMILIES[name]
    device = "cuda" if real else "cpu"
    torch.manual_seed(0)  # NOTE: every rank builds the same random weights (StepBatched checks they agree)
    pipe = family.build(real, args)
    pipe.set_progress_bar_config(disable=True)
    n = family.requests if real else family.dry_requests
    requests = [family.request(pipe, i, real) for i in range(n)]

    def calls() -> list[dict]:
        return [_with_seed(kwargs, i, device) for i, kwargs in enumerate(requests)]

    rank = torch.distributed.get_rank()
    one_gpu = None
    if rank == 0:
        with StepBatched(pipe, max_batch_size=2 * n) as sb:
            in_worker_thread(lambda: sb(**calls()[0]))  # warm-up
            one_gpu = _alone_and_together(sb, calls, device, rounds)
    world = torch.distributed.get_world_size()
    degrees = {"ring_degree": world} if args.ring else {"ulysses_degree": world}
    sb = StepBatched(pipe, max_batch_size=2 * n, parallel=ContextParallelConfig(**degrees))
    if rank > 0:
        sb.follow()
        return None
    in_worker_thread(lambda: sb(**calls()[0]))
    split = _alone_and_together(sb, calls, device, rounds)
    stats = sb.stats()
    sb.close()
    return {"requests": n, "ranks": world, **degrees, "one_gpu": one_gpu, "context_parallel": split,
            "single_request_speedup": one_gpu["alone_s"] / split["alone_s"],
            "throughput_ratio": split["together_per_s"] / one_gpu["together_per_s"],
            "parallel": stats["parallel"], "splits": stats["splits"]}


def _relaunch_under_torchrun(ranks: int, argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as logs:  # NOTE: else torchrun leaves a torchelastic_* folder in /tmp
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-port", str(free_port()), "--log-dir", logs, __file__, *argv]
        code = subprocess.call(command, env=dict(os.environ, OMP_NUM_THREADS="1"))
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=CP_FAMILIES, default=CP_FAMILIES)
    parser.add_argument("--ranks", type=int, default=None, help="GPUs (default: every visible one; 2 dry)")
    parser.add_argument("--ring", action="store_true", help="Ring attention instead of Ulysses (needs flash / "
                        "cuDNN attention: --attention-backend)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side (medians)")
    add_build_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 gloo ranks, the tiny test configs, one round")
    parser.add_argument("--out", type=Path, help="the JSON (default: benchmarks/results/gpu_context_parallel.json; "
                        "a dry run's goes to the temp folder)")
    args = parser.parse_args(argv)
    real = not args.dry_run
    if real and not torch.cuda.is_available():
        parser.error("needs CUDA devices (or --dry-run)")
    if "RANK" not in os.environ:
        _relaunch_under_torchrun(args.ranks or (torch.cuda.device_count() if real else 2), argv)
    from diffusers_stepbatch.parallel.ranks import start_ranks

    start_ranks()
    rank = torch.distributed.get_rank()
    out = args.out or (Path(__file__).parent / "results" / "gpu_context_parallel.json" if real
                       else Path(tempfile.gettempdir()) / "gpu_context_parallel_dry_run.json")
    report: dict[str, Any] = {"environment": _environment(real), "families": {},
                              "command": command_line("benchmarks/gpu_context_parallel.py", argv)}
    for name in args.families:
        result = bench_family(name, real, args.rounds if real else 1, args)
        if rank > 0:
            continue
        report["families"][name] = result
        print(f"{name}: {result['ranks']} ranks; one request {result['one_gpu']['alone_s']:.3f} s on one device, "
              f"{result['context_parallel']['alone_s']:.3f} s split ({result['single_request_speedup']:.2f}x); "
              f"{result['requests']} requests per s: one device {result['one_gpu']['together_per_s']:.3f}, split "
              f"{result['context_parallel']['together_per_s']:.3f} ({result['throughput_ratio']:.2f}x)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))  # NOTE: after each family, for a timeout
    if rank == 0:
        print(f"wrote {out}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
