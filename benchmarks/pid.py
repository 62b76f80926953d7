"""PiD early exit vs full-resolution generation: images at 4x the toy model's native size (256 x 256).

    python benchmarks/pid.py                  # toy pipeline + toy PiD adapter; 1 and 8 concurrent requests
    python benchmarks/pid.py --smoke          # untrained toy architecture, random PiD, 3 steps: seconds
    python benchmarks/pid.py --smoke --steps 20 --concurrency 1 8 --repeats 3   # timing of the architecture

Two ways to the same 256 x 256 output, both served by StepBatched:
(a) "full":  the main model at 256 x 256 for all N steps, then VAE decode;
(b) "pid":   the main model at its native 64 x 64 for K = N - 2 steps (early exit), then the PiD adapter
             decodes x_t straight to 256 x 256 (4 steps).
Each (side, concurrency) runs in its own fresh process, one after the other. Latency: wall time from submitting
the round's requests to the last result (median of `--repeats` rounds, after one warm-up round). Peak memory:
the process's peak resident set (Linux `VmHWM`) minus its resident set after the imports, before any model is
loaded; so it counts weights, activations and allocator slack of that side alone. Results are printed as ratios
and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIDES = ("full", "pid")
TARGET_SPEEDUP = 5.0
TARGET_MEMORY_SAVING = 0.30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(side: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One side at one concurrency, in this (fresh) process."""
    import torch

    from diffusers_stepbatch import PiDDecoding, StepBatched
    from diffusers_stepbatch.toy.build import NATIVE_SIZE
    from diffusers_stepbatch.toy.scenes import heldout_captions

    # NOTE: import every library module both sides use before the baseline, so it holds code, not workload.
    import diffusers_stepbatch.decoders.pid  # noqa: F401
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # noqa: F401

    torch.set_num_threads(args.threads)
    base_kib = _status_kib("VmRSS")
    if args.smoke:
        from diffusers_stepbatch.decoders.pid import PiDDecoder
        from diffusers_stepbatch.toy.build import build_pipeline
        from diffusers_stepbatch.toy.train_pid import PID_TOY_CONFIG

        pipe = build_pipeline(seed=0)
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(0)
        decoder = PiDDecoding(PiDDecoder(**PID_TOY_CONFIG).eval(), "pipeline") if side == "pid" else None
    else:
        from diffusers_stepbatch.toy import load_pipeline

        pipe = load_pipeline()
        decoder = "toy-pid" if side == "pid" else None
    size = args.scale * NATIVE_SIZE
    tokens: list[int] = []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, a, kw: tokens.append(int(kw["hidden_states"].shape[1])), with_kwargs=True
    )
    sb = StepBatched(pipe, decoder=decoder, pid_exit_step=args.exit_step if side == "pid" else None)
    captions = heldout_captions()

    def round_(seed: int) -> float:
        started = time.perf_counter()
        handles = [
            sb.submit(captions[(seed + i) % len(captions)], height=size, width=size,
                      num_inference_steps=args.steps, guidance_scale=3.5, max_sequence_length=16, output_type="pt",
                      generator=torch.Generator().manual_seed(seed + i))
            for i in range(concurrency)
        ]  # fmt: skip
        outputs = [h.result().images for h in handles]
        elapsed = time.perf_counter() - started
        assert all(o.shape[-2:] == (size, size) for o in outputs)
        return elapsed

    round_(1000)  # warm-up
    tokens.clear()
    times = [round_(r * concurrency) for r in range(args.repeats)]
    sb.close()
    peak_kib = _status_kib("VmHWM")
    return {
        "side": side,
        "concurrency": concurrency,
        "output": [size, size],
        "main_model": {"size": [size // (args.scale if side == "pid" else 1)] * 2,
                       "forwards_per_round": len(tokens) // args.repeats, "tokens_per_row": sorted(set(tokens))},
        "latency_s": statistics.median(times),
        "latency_all_s": times,
        "peak_rss_mib": peak_kib / 1024,
        "rss_after_imports_mib": base_kib / 1024,
        "peak_memory_mib": (peak_kib - base_kib) / 1024,
        "engine_calls": sb.stats()["rows_histogram"],
    }


def run_side(side: str, concurrency: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", side, "--worker-concurrency", str(concurrency),
               "--steps", str(args.steps), "--repeats", str(args.repeats), "--threads", str(args.threads),
               "--scale", str(args.scale)] + (["--smoke"] if args.smoke else [])  # fmt: skip
    if args.exit_step is not None:
        command += ["--exit-step", str(args.exit_step)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} x{concurrency} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="untrained toy architecture, random PiD, 3 steps")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="requests per round (default 1 8)")
    parser.add_argument("--steps", type=int, default=None, help="main-model steps N (default: the toy's 20)")
    parser.add_argument("--exit-step", type=float, default=None, help="PiD exit K or fraction (default N - 2)")
    parser.add_argument("--repeats", type=int, default=None, help="measured rounds per side (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each side's process")
    parser.add_argument("--scale", type=int, default=4, help="output size / native size (PiD's sr_scale)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-concurrency", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.exit_step is not None and args.exit_step.is_integer():
        args.exit_step = int(args.exit_step)
    if args.steps is None:
        args.steps = 3 if args.smoke else 20
    if args.concurrency is None:
        args.concurrency = [2] if args.smoke else [1, 8]
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.worker:
        print(json.dumps(worker(args.worker, args.worker_concurrency, args)))
        return

    rows = []
    for concurrency in args.concurrency:
        full, pid = (run_side(side, concurrency, args) for side in SIDES)
        speedup = full["latency_s"] / pid["latency_s"]
        saving = 1 - pid["peak_memory_mib"] / full["peak_memory_mib"]
        rows.append({"concurrency": concurrency, "full": full, "pid": pid, "speedup": speedup,
                     "memory_saving": saving, "meets_speedup_target": speedup >= TARGET_SPEEDUP,
                     "meets_memory_target": saving >= TARGET_MEMORY_SAVING})  # fmt: skip
        print(f"{concurrency} request(s) of {full['output'][0]}x{full['output'][1]}, N={args.steps} steps "
              f"(main-model forwards per round, batched: full {full['main_model']['forwards_per_round']} at "
              f"{full['main_model']['size'][0]}px, pid {pid['main_model']['forwards_per_round']} at {pid['main_model']['size'][0]}px):")  # fmt: skip
        print(f"  latency      full {full['latency_s']:7.2f} s   pid {pid['latency_s']:7.2f} s   "
              f"-> {speedup:.2f}x faster (target >= {TARGET_SPEEDUP}x)")
        print(f"  peak memory  full {full['peak_memory_mib']:7.1f} MiB pid {pid['peak_memory_mib']:7.1f} MiB "
              f"-> {100 * saving:.1f}% less (target >= {100 * TARGET_MEMORY_SAVING:.0f}%)")
    out = args.out or Path(__file__).parent / "results" / ("pid.smoke.json" if args.smoke else "pid.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    report = {
        "command": "python benchmarks/pid.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "memory_measure": "peak RSS (VmHWM) minus RSS after imports, per side in a fresh process",
        "steps": args.steps, "exit_step": args.exit_step, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "results": rows,
    }  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
