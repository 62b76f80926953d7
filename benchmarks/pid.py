"""PiD early exit vs full-resolution generation: images at 4x the main model's native size.

    python benchmarks/pid.py                  # toy pipeline + toy PiD adapter; 1 and 8 concurrent requests
    python benchmarks/pid.py --smoke          # untrained toy architecture, random PiD, 3 steps: seconds
    python benchmarks/pid.py --smoke --steps 20 --concurrency 1 8 --repeats 3   # timing of the architecture
    python benchmarks/pid.py --scaled         # FLUX.1-dev vs flux PiD at their real ratios (pid_scaled.py), 512 px
    python benchmarks/pid.py --scaled --vae flops    # only the VAE sized by its FLOP share (default: both sizings)

The toy pair (256 x 256 output) is a quality demo: its 2.4M-parameter main model costs about as much as the
decode. `--scaled` is the speed demo: random weights, the parameter ratio (8.74x) and token ratios of FLUX.1-dev
and the released flux PiD at a 2048 px output, every token count at 1/16 (see `pid_scaled.py`); N = 28, K = 24.
A small VAE cannot keep both its share of side (a)'s time and its activations relative to PiD's, so `--scaled`
runs both sides twice, with the VAE sized each way from the real configs (`pid_scaled.VAE_SIZINGS`): the
speed-up that stands for the real pair is the "flops" one, the memory saving the "activations" one.

Two ways to the same output, both served by StepBatched:
(a) "full":  the main model at the output size for all N steps, then VAE decode;
(b) "pid":   the main model at 1/4 of it for K steps (early exit; default N - 2, `--scaled` 24 of 28), then
             PiD decodes x_t straight to the output size (4 steps).
Each (side, concurrency) runs in its own fresh process, one after the other, the sides alternating (`--passes`
repeats the whole alternation; each side's best pass is kept). Latency: wall time from submitting the round's
requests to the last result (median of `--repeats` rounds, after one warm-up round; `--scaled` warms up with one
request). Peak memory:
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

    import pid_scaled  # (this folder is on sys.path: the script's own)

    torch.set_num_threads(args.threads)
    base_kib, base_file_kib = _status_kib("VmRSS"), _status_kib("RssFile")
    steps_kwargs = dict(guidance_scale=3.5, max_sequence_length=16)
    if args.scaled:
        pipe, pid_decoder = pid_scaled.build_scaled_pair(seed=0, vae_width_divisor=args.vae_width_divisor or None)
        decoder = PiDDecoding(pid_decoder, "pipeline") if side == "pid" else None
        steps_kwargs["max_sequence_length"] = pid_scaled.MAX_SEQUENCE_LENGTH
    elif args.smoke:
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
    size = pid_scaled.OUTPUT_SIZE if args.scaled else args.scale * NATIVE_SIZE
    tokens: list[int] = []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, a, kw: tokens.append(int(kw["hidden_states"].shape[1])), with_kwargs=True
    )
    sb = StepBatched(pipe, decoder=decoder, pid_exit_step=args.exit_step if side == "pid" else None)
    captions = heldout_captions()

    weights_mib = sum(p.numel() * p.element_size() for c in pipe.components.values() if isinstance(c, torch.nn.Module)
                      for p in c.parameters()) / 2**20
    if side == "pid":
        weights_mib += sum(p.numel() * p.element_size() for p in sb.pid.decoding.decoder.parameters()) / 2**20

    def round_(seed: int, count: int = concurrency) -> float:
        started = time.perf_counter()
        handles = [
            sb.submit(captions[(seed + i) % len(captions)], height=size, width=size,
                      num_inference_steps=args.steps, output_type="pt", generator=torch.Generator().manual_seed(seed + i),
                      **steps_kwargs)
            for i in range(count)
        ]  # fmt: skip
        outputs = [h.result().images for h in handles]
        elapsed = time.perf_counter() - started
        assert all(o.shape[-2:] == (size, size) for o in outputs)
        return elapsed

    round_(1000, 1 if args.scaled else concurrency)  # warm-up
    tokens.clear()
    first_call = len(sb.engine.metrics.calls)
    times = [round_(r * concurrency) for r in range(args.repeats)]
    by_kind: dict[str, float] = {}
    for record in list(sb.engine.metrics.calls)[first_call:]:
        by_kind[record.kind] = by_kind.get(record.kind, 0.0) + record.seconds / args.repeats
    sb.close()
    peak_kib, file_kib = _status_kib("VmHWM"), _status_kib("RssFile")
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
        # NOTE: file-backed pages (library code the first calls page in) only grow, so this bounds the peak of the
        # process's own (anonymous) memory from below: weights, activations, allocator slack.
        "peak_memory_without_file_pages_mib": (peak_kib - base_kib - (file_kib - base_file_kib)) / 1024,
        "weights_mib": weights_mib,
        "threads": args.threads,
        "engine_calls": sb.stats()["rows_histogram"],
        "engine_seconds_per_round": by_kind,
    }


def run_side(side: str, concurrency: int, args: argparse.Namespace) -> dict:
    threads = {"full": args.threads_full, "pid": args.threads_pid}[side] or args.threads
    command = [sys.executable, __file__, "--worker", side, "--worker-concurrency", str(concurrency),
               "--steps", str(args.steps), "--repeats", str(args.repeats), "--threads", str(threads),
               "--scale", str(args.scale), "--vae-width-divisor", str(args.vae_width_divisor or 0)]
    command += (["--smoke"] if args.smoke else []) + (["--scaled"] if args.scaled else [])
    if args.exit_step is not None:
        command += ["--exit-step", str(args.exit_step)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} x{concurrency} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compare(args: argparse.Namespace, concurrency: int, sizing: str | None) -> dict:
    """Both sides at one concurrency (`--passes` alternations; each side's best pass), printed and returned."""
    passes = [[run_side(side, concurrency, args) for side in SIDES] for _ in range(args.passes)]
    full, pid = (min((p[i] for p in passes), key=lambda r: r["latency_s"]) for i in range(len(SIDES)))
    if args.passes > 1:  # NOTE: the best pass per side (the host is shared); every pass is in the JSON
        full["passes_latency_s"] = [p[0]["latency_s"] for p in passes]
        pid["passes_latency_s"] = [p[1]["latency_s"] for p in passes]
    speedup = full["latency_s"] / pid["latency_s"]
    saving = 1 - pid["peak_memory_mib"] / full["peak_memory_mib"]
    saving_anon = 1 - pid["peak_memory_without_file_pages_mib"] / full["peak_memory_without_file_pages_mib"]
    label = f" (VAE sized by {sizing}, widths / {args.vae_width_divisor})" if sizing else ""
    print(f"{concurrency} request(s) of {full['output'][0]}x{full['output'][1]}, N={args.steps} steps{label} "
          f"(main-model forwards per round, batched: full {full['main_model']['forwards_per_round']} at "
          f"{full['main_model']['size'][0]}px, pid {pid['main_model']['forwards_per_round']} at {pid['main_model']['size'][0]}px):")  # fmt: skip
    print(f"  latency      full {full['latency_s']:7.2f} s   pid {pid['latency_s']:7.2f} s   "
          f"-> {speedup:.2f}x faster (target >= {TARGET_SPEEDUP}x)")
    print(f"  peak memory  full {full['peak_memory_mib']:7.1f} MiB pid {pid['peak_memory_mib']:7.1f} MiB "
          f"-> {100 * saving:.1f}% less (target >= {100 * TARGET_MEMORY_SAVING:.0f}%)")
    print(f"  without file pages  full {full['peak_memory_without_file_pages_mib']:7.1f} MiB pid "
          f"{pid['peak_memory_without_file_pages_mib']:7.1f} MiB -> {100 * saving_anon:.1f}% less")
    return {"concurrency": concurrency, "vae_sizing": sizing, "vae_width_divisor": args.vae_width_divisor or None,
            "full": full, "pid": pid, "speedup": speedup, "memory_saving": saving,
            "memory_saving_without_file_pages": saving_anon, "meets_speedup_target": speedup >= TARGET_SPEEDUP,
            "meets_memory_target": saving >= TARGET_MEMORY_SAVING}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="untrained toy architecture, random PiD, 3 steps")
    parser.add_argument("--scaled", action="store_true", help="FLUX.1-dev / flux PiD ratios, random weights, 512 px")
    parser.add_argument("--passes", type=int, default=1, help="alternations of the two sides' processes")
    parser.add_argument("--vae", choices=("both", "activations", "flops"), default="both",
                        help="--scaled: how the VAE is sized (pid_scaled.VAE_SIZINGS)")
    parser.add_argument("--threads-full", type=int, default=None, help="threads of side (a) (default --threads)")
    parser.add_argument("--threads-pid", type=int, default=None, help="threads of side (b) (default --threads)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="requests per round (default 1 8)")
    parser.add_argument("--steps", type=int, default=None, help="main-model steps N (default: the toy's 20)")
    parser.add_argument("--exit-step", type=float, default=None, help="PiD exit K or fraction (default N - 2)")
    parser.add_argument("--repeats", type=int, default=None, help="measured rounds per side (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each side's process")
    parser.add_argument("--scale", type=int, default=4, help="output size / native size (PiD's sr_scale)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-concurrency", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vae-width-divisor", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.exit_step is not None and args.exit_step.is_integer():
        args.exit_step = int(args.exit_step)
    if args.scaled and args.smoke:
        parser.error("--scaled and --smoke are different pairs; pass one")
    if args.scaled and args.exit_step is None:
        args.exit_step = 24  # the reference README's exit for FLUX.1-dev (24 of 28)
    if args.steps is None:
        args.steps = 3 if args.smoke else 28 if args.scaled else 20
    if args.concurrency is None:
        args.concurrency = [2] if args.smoke else [1, 8]
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 2 if args.scaled else 3
    if args.worker:
        print(json.dumps(worker(args.worker, args.worker_concurrency, args)))
        return

    pair = None
    if args.scaled:
        import pid_scaled

        exit_k = args.exit_step if isinstance(args.exit_step, int) else round(args.exit_step * args.steps)
        counts, tokens = pid_scaled.parameter_counts(), pid_scaled.token_counts()
        pair = {"parameters": counts, "parameter_ratio_real": counts["real_main"] / counts["real_pid"],
                "parameter_ratio_scaled": counts["scaled_main"] / counts["scaled_pid"], "tokens_per_row": tokens,
                "token_ratio_pid_to_main_low": tokens["pid"] / tokens["main_low"],
                "seed_document": {"output": 2048, "peak_memory_gb": [16.84, 11.53], "latency_change": -0.918},
                "flops_real": pid_scaled.flop_counts(True, 1, args.steps, exit_k),
                "flops_scaled": {sizing: {"vae_width_divisor": pid_scaled.vae_divisor(sizing),
                                          **pid_scaled.flop_counts(False, pid_scaled.vae_divisor(sizing), args.steps,
                                                                   exit_k)}
                                 for sizing in pid_scaled.VAE_SIZINGS}}  # fmt: skip
        print(f"main {counts['scaled_main'] / 1e6:.2f}M / PiD {counts['scaled_pid'] / 1e6:.3f}M parameters = "
              f"{pair['parameter_ratio_scaled']:.2f}x (FLUX.1-dev / flux PiD: {counts['real_main'] / 1e9:.2f}B / "
              f"{counts['real_pid'] / 1e9:.3f}B = {pair['parameter_ratio_real']:.2f}x); tokens per row {tokens}")
    sizings = ([None] if not args.scaled else
               list(pid_scaled.VAE_SIZINGS) if args.vae == "both" else [args.vae])  # fmt: skip
    rows = []
    for sizing in sizings:
        if sizing is not None:
            args.vae_width_divisor = pid_scaled.vae_divisor(sizing)
            flops = pid_scaled.flop_counts(False, args.vae_width_divisor, args.steps, exit_k)
            print(f"VAE sized by {sizing}: FLUX's widths / {args.vae_width_divisor}; its decode is "
                  f"{100 * flops['vae_share_of_full_side']:.2f}% of side (a)'s FLOPs (real pair: "
                  f"{100 * pair['flops_real']['vae_share_of_full_side']:.2f}%)")
        for concurrency in args.concurrency:
            rows.append(_compare(args, concurrency, sizing))
    name = "pid.smoke.json" if args.smoke else "pid_scaled.json" if args.scaled else "pid.json"
    out = args.out or Path(__file__).parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    report = {
        "command": "python benchmarks/pid.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "memory_measure": "peak RSS (VmHWM) minus RSS after imports, per side in a fresh process; also without the "
                          "growth of file-backed pages (RssFile)",
        "steps": args.steps, "exit_step": args.exit_step, "repeats": args.repeats,
        "vae_sizings": {sizing: pid_scaled.vae_divisor(sizing) for sizing in sizings} if args.scaled else None,
        "threads": {side: {"full": args.threads_full, "pid": args.threads_pid}[side] or args.threads for side in SIDES},
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "pair": pair, "passes": args.passes, "results": rows,
    }  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
