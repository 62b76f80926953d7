"""Where each side's peak memory comes from in `pid.py --scaled`: weights vs activations, and which stage.

    python benchmarks/pid_memory.py                  # both sides, 1 and 8 requests, both VAE sizings
    python benchmarks/pid_memory.py --vae flops      # only the VAE sized by its FLOP share (pid_scaled.VAE_SIZINGS)
    python benchmarks/pid_memory.py --concurrency 1 --steps 28 --exit-step 24

Each (side, concurrency) runs in a fresh process: the scaled pair is built, one warm-up request runs, then one
round of `--concurrency` requests is driven through the engine in this thread (so `torch.profiler` sees every
op) under `torch.profiler.profile(profile_memory=True)`. Reported per side:
- `torch_peak_mib`: the high-water mark of live tensor bytes the CPU allocator handed out during the round (the
  CPU analogue of `torch.cuda.max_memory_allocated` minus the weights, which were allocated before), the stage
  holding it (main-model forward, VAE decode, PiD decode, text encoders, or the engine between them) and the op;
- per stage, the highest live tensor bytes reached inside it;
- `rss_peak_over_warm_mib`: peak RSS (`VmHWM`, reset through /proc/self/clear_refs after the warm-up) minus the
  RSS after the warm-up: what the round added to the process, allocator caching and glibc arenas included;
- the weights of every module, and the RSS the built pair added over the imports.
The step counts do not move the peaks (every step allocates and frees the same tensors), so the default runs few.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIDES = ("full", "pid")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # NOTE: Linux: VmHWM := VmRSS


def _stage_hooks(stages: dict, mark) -> None:
    """Open a `record_function("stage:<name>")` range around each stage module's forward."""
    from torch.profiler import record_function

    for name, module in stages.items():
        open_ranges: list = []

        def enter(_module, _args, _name=name, _open=open_ranges):
            _open.append(record_function("stage:" + _name))
            _open[-1].__enter__()
            mark(_name, "enter")

        def leave(_module, _args, _output, _open=open_ranges, _name=name):
            mark(_name, "leave")
            _open.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def _live_bytes_peaks(prof) -> dict:
    """Replay the profiler's CPU allocation events: the peak of live bytes, where it happened, per-stage peaks."""
    import torch

    events = prof.profiler.kineto_results.events()
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    stages = [(e.name()[len("stage:"):], e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("stage:")]  # fmt: skip
    live = peak = 0
    peak_at = None
    per_stage: dict[str, int] = {}
    for at, nbytes in memory:
        live += nbytes
        if live > peak:
            peak, peak_at = live, at
        stage = next((name for name, start, end in stages if start <= at <= end), "engine")
        per_stage[stage] = max(per_stage.get(stage, 0), live)
    ops = sorted((e.duration_ns(), e.name()) for e in events
                 if e.name().startswith("aten::") and peak_at is not None and e.start_ns() <= peak_at <= e.start_ns() + e.duration_ns())  # fmt: skip
    return {
        "torch_peak_mib": peak / 2**20,
        "peak_stage": next((name for name, start, end in stages if start <= (peak_at or -1) <= end), "engine"),
        "peak_op": ops[0][1] if ops else None,
        "torch_peak_per_stage_mib": {name: value / 2**20 for name, value in sorted(per_stage.items())},
        "live_after_round_mib": live / 2**20,
    }


def worker(side: str, args: argparse.Namespace) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import diffusers_stepbatch.decoders.pid  # noqa: F401
    import pid_scaled
    from diffusers_stepbatch import PiDDecoding, SchedulerConfig, StepBatched
    from diffusers_stepbatch.toy.scenes import heldout_captions

    torch.set_num_threads(args.threads)
    rss_imports = _status_mib("VmRSS")
    pipe, pid_decoder = pid_scaled.build_scaled_pair(seed=0, vae_width_divisor=args.vae_width_divisor)
    rss_built = _status_mib("VmRSS")
    decoder = PiDDecoding(pid_decoder, "pipeline") if side == "pid" else None
    # NOTE: room for every request's rows in one call, as the threaded benchmark's engine batches them.
    sb = StepBatched(pipe, decoder=decoder, pid_exit_step=args.exit_step if side == "pid" else None,
                     scheduler=SchedulerConfig(max_batch_size=max(16, args.concurrency), cost_aware=False))  # fmt: skip
    stages = {"main_model": pipe.transformer, "vae_decode": pipe.vae.decoder, "pid_decode": pid_decoder,
              "text_encoders": pipe.text_encoder_2}  # fmt: skip
    rss_stage: dict[str, float] = {}
    rss_at_enter: dict[str, float] = {}
    round_hwm = [0.0]  # NOTE: each stage resets VmHWM, so the round's peak is the max of the readings before

    def mark(name: str, event: str) -> None:
        if event == "enter":
            round_hwm[0] = max(round_hwm[0], _status_mib("VmHWM"))
            _reset_peak_rss()
            rss_at_enter[name] = _status_mib("VmRSS")
        else:
            rss_stage[name] = max(rss_stage.get(name, 0.0), _status_mib("VmHWM") - rss_at_enter[name])

    _stage_hooks(stages, mark)
    captions = heldout_captions()

    def round_(seed: int, count: int) -> None:
        requests = [sb._make_request((), dict(
            prompt=captions[(seed + i) % len(captions)], height=pid_scaled.OUTPUT_SIZE, width=pid_scaled.OUTPUT_SIZE,
            num_inference_steps=args.steps, output_type="pt", generator=torch.Generator().manual_seed(seed + i),
            guidance_scale=3.5, max_sequence_length=pid_scaled.MAX_SEQUENCE_LENGTH), 0, None) for i in range(count)]  # fmt: skip
        for request in requests:
            sb.engine.scheduler.add(request)
        with torch.no_grad():
            while sb.engine.scheduler.has_work():
                sb.engine.step()
        for request in requests:
            assert request.handle.result().images.shape[-1] == pid_scaled.OUTPUT_SIZE

    round_(1000, 1)  # warm-up
    rss_peak_since_start = max(round_hwm[0], _status_mib("VmHWM"))
    rss_stage.clear()
    _reset_peak_rss()
    rss_warm = round_hwm[0] = _status_mib("VmRSS")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        round_(0, args.concurrency)
    rss_peak = max(round_hwm[0], _status_mib("VmHWM"))
    modules = {"main_model": pipe.transformer, "vae": pipe.vae, "text_encoder": pipe.text_encoder,
               "text_encoder_2": pipe.text_encoder_2, "pid": pid_decoder}  # fmt: skip
    weights = {name: sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20 for name, m in modules.items()}
    if side == "full":
        weights.pop("pid")
    return {
        "side": side,
        "concurrency": args.concurrency,
        "weights_mib": weights,
        "rss_of_built_pair_mib": rss_built - rss_imports,
        "rss_peak_over_imports_warmup_mib": rss_peak_since_start - rss_imports,
        "rss_peak_over_warm_mib": rss_peak - rss_warm,
        "rss_peak_over_stage_start_mib": dict(sorted(rss_stage.items())),
        **_live_bytes_peaks(prof),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=4, help="main-model steps N (peaks do not depend on it)")
    parser.add_argument("--exit-step", type=int, default=2, help="PiD exit K")
    parser.add_argument("--vae", choices=("both", "activations", "flops"), default="both", help="the VAE's sizing")
    parser.add_argument("--vae-width-divisor", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pid_memory.json")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.concurrency = args.concurrency[0]
        print(json.dumps(worker(args.worker, args)))
        return
    import pid_scaled

    sizings = list(pid_scaled.VAE_SIZINGS) if args.vae == "both" else [args.vae]
    rows = []
    for sizing in sizings:
        divisor = pid_scaled.vae_divisor(sizing)
        for concurrency in args.concurrency:
            for side in SIDES:
                command = [sys.executable, __file__, "--worker", side, "--concurrency", str(concurrency), "--steps",
                           str(args.steps), "--exit-step", str(args.exit_step), "--vae-width-divisor", str(divisor),
                           "--threads", str(args.threads)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{side} x{concurrency} failed:\n{done.stderr[-3000:]}")
                row = {"vae_sizing": sizing, "vae_width_divisor": divisor,
                       **json.loads(done.stdout.strip().splitlines()[-1])}  # fmt: skip
                rows.append(row)
                per_stage = ", ".join(f"{k} {v:.1f}" for k, v in row["torch_peak_per_stage_mib"].items())
                print(f"VAE / {divisor} ({sizing}) {side:4s} x{concurrency}: torch peak {row['torch_peak_mib']:6.1f} "
                      f"MiB in {row['peak_stage']} ({row['peak_op']}); per stage: {per_stage}; RSS peak over warm "
                      f"{row['rss_peak_over_warm_mib']:.1f} MiB; weights {sum(row['weights_mib'].values()):.1f} MiB")  # fmt: skip
            full, pid = rows[-2], rows[-1]
            print(f"VAE / {divisor} x{concurrency}: torch peak saving "
                  f"{100 * (1 - pid['torch_peak_mib'] / full['torch_peak_mib']):.1f}%, RSS-over-warm saving "
                  f"{100 * (1 - pid['rss_peak_over_warm_mib'] / full['rss_peak_over_warm_mib']):.1f}%")
    report = {"command": "python benchmarks/pid_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "steps": args.steps, "exit_step": args.exit_step,
              "threads": args.threads, "results": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
