"""Where an engine round's time goes: a torch.profiler trace of N concurrent requests, summarised.

    python benchmarks/profile_steps.py                 # CUDA: FLUX.1-width transformer, 8 x 20 steps, 512x512
    python benchmarks/profile_steps.py --smoke         # CPU, tiny model, a few seconds (CI)

After warm-up rounds on a long-lived engine, one closed-loop round (N requests at once) runs under
`torch.profiler` with CPU and, where present, CUDA activities. The summary says, for that round: wall time,
the device's busy time (kernels) and so its idle share, host time per thread (the engine thread against the
callers'), the ops that took the most device and host time, and every host-device sync the CUDA runtime
recorded (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`; `cudaMemcpy*` calls are
counted apart), and where the device sat idle: the gaps between its kernels from the Chrome trace, by length
and by where in the round they fell (a host-bound step loop leaves gaps every step; prologues and the tail
leave long ones at the ends). The same round runs as sequential plain pipeline calls for comparison.
`--trace` keeps the StepBatched round's Chrome trace (chrome://tracing).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from throughput import command_line, in_worker_thread, rows_per_call_by_kind, run_clients, write_report  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline  # noqa: E402

# CUDA runtime calls that block the host until the device has caught up, and copies (a copy to the host waits too)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpy",)


def request_kwargs(i: int, side: int, steps: int) -> dict:
    return dict(prompt=f"a red circle {i}", height=side, width=side, num_inference_steps=steps, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(i), output_type="pt", max_sequence_length=32)


def closed_round(call, n: int, side: int, steps: int, offset: int) -> float:
    """N requests at once from N threads; wall seconds until the last image is on the host."""
    def client(i: int, start: float) -> None:
        call(**request_kwargs(offset + i, side, steps)).images.cpu()

    started = run_clients(n, client)  # released together, as a server's workers
    return time.perf_counter() - started


def sequential_round(pipe, n: int, side: int, steps: int, offset: int) -> float:
    def run() -> float:
        started = time.perf_counter()
        for i in range(n):
            pipe(**request_kwargs(offset + i, side, steps)).images.cpu()
        return time.perf_counter() - started

    return in_worker_thread(run)


MODEL_SPAN = "stepbatch::transformer"


def mark_transformer_calls(transformer: torch.nn.Module) -> list:
    """Every transformer call becomes a `MODEL_SPAN` range in the profile: it names the thread that runs the
    model (the engine thread under StepBatched) and spans each forward on the host."""
    spans = threading.local()

    def enter(module, args, kwargs):
        spans.current = torch.profiler.record_function(MODEL_SPAN)
        spans.current.__enter__()

    def leave(module, args, kwargs, output):
        spans.current.__exit__(None, None, None)

    return [transformer.register_forward_pre_hook(enter, with_kwargs=True),
            transformer.register_forward_hook(leave, with_kwargs=True)]


def summarize(prof, wall_s: float, top: int) -> dict:
    """The profile of one round in numbers: device busy time, host time per thread, top ops, syncs."""
    events = prof.events()
    model_threads = collections.Counter(e.thread for e in events if e.name == MODEL_SPAN)
    engine_thread = model_threads.most_common(1)[0][0] if model_threads else None
    # NOTE: each op's own kernels' time (its children's kernels count for them): summed, the device's busy time
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    host_by_thread: collections.Counter = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            host_by_thread[e.thread] += e.self_cpu_time_total
    syncs = collections.Counter(e.name for e in events if e.name.startswith(SYNC_CALLS))
    copies = collections.Counter(e.name for e in events if e.name.startswith(COPY_CALLS))
    averages = prof.key_averages()
    by_device = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)[:top]
    by_host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    engine_us = host_by_thread.get(engine_thread, 0)
    return {
        "wall_ms": 1000 * wall_s,
        "transformer_calls": sum(model_threads.values()),
        "transformer_host_span_ms": sum(e.cpu_time_total for e in events if e.name == MODEL_SPAN) / 1000,
        "device_busy_ms": device_us / 1000,
        "device_idle_share": max(0.0, 1 - device_us / 1e6 / wall_s) if device_us else None,
        "host_op_ms_model_thread": engine_us / 1000,  # the thread that ran the transformer
        "host_op_ms_other_threads": (sum(host_by_thread.values()) - engine_us) / 1000,
        "host_syncs": dict(syncs),
        "copy_calls": dict(copies),
        "top_device_ops_ms": {a.key: a.self_device_time_total / 1000 for a in by_device if a.self_device_time_total},
        "top_host_ops_ms": {a.key: a.self_cpu_time_total / 1000 for a in by_host},
    }


DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_device_spans(trace_path: Path) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every timed device activity (kernel, copy, set) in a Chrome trace."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("cat") in DEVICE_ACTIVITY and e.get("dur", 0) > 0]


def trace_spans(prof, exported: Path | None) -> list[tuple[float, float]]:
    """`trace_device_spans` of the profile's Chrome trace: the one `exported` already, else one written for this.

    NOTE: only where the profiler's own records have no timed device work (a CPU run): exporting is slow (a
    round of 8 x 20 steps on the H200 ran past its 90 s limit while exporting).
    """
    if exported is not None:
        return trace_device_spans(exported)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_device_spans(path)


def profile_device_spans(prof) -> list[tuple[float, float]]:
    """The same from the profiler's own records, in microseconds.

    NOTE: on the H200 (torch 2.11) the exported trace held the engine thread's kernels without timestamps (that
    thread started before the profiler), while the profiler's totals had their durations.
    """
    return [(e.start_ns() / 1000, e.end_ns() / 1000) for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]


def device_gaps(spans: list[tuple[float, float]], top: int = 8) -> dict | None:
    """Where the device sat idle: the gaps between its activities, summed by length and by the tenth of the span
    they fell in; None without timed device work."""
    if not spans:
        return None
    spans = sorted(spans)
    busy = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    first, last = busy[0][0], busy[-1][1]
    gaps = [(before[1], after[0]) for before, after in zip(busy, busy[1:])]
    by_length = collections.Counter()
    by_tenth = [0.0] * 10
    for start, end in gaps:
        length = end - start  # microseconds
        by_length["<50us" if length < 50 else "50us-1ms" if length < 1000 else "1-5ms" if length < 5000
                  else ">=5ms"] += length / 1000
        by_tenth[min(int(10 * (start - first) / (last - first)), 9)] += length / 1000
    return {
        "span_ms": (last - first) / 1000,
        "busy_ms": sum(end - start for start, end in busy) / 1000,
        "idle_ms": sum(end - start for start, end in gaps) / 1000,
        "idle_ms_by_gap_length": dict(by_length),
        "idle_ms_by_tenth_of_span": [round(ms, 2) for ms in by_tenth],
        "longest_gaps_ms": [{"at_ms": round((start - first) / 1000, 2), "ms": round((end - start) / 1000, 2)}
                            for start, end in sorted(gaps, key=lambda g: g[0] - g[1])[:top]],
    }


def all_threads_config(cuda: bool):
    """Kineto options: every thread, and (CUDA) the synchronizations the host waited for; None where this
    torch lacks them.

    NOTE: by default the profiler records only the thread that started it; the engine and callers are others.
    """
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
    except (AttributeError, TypeError):
        return None


def profiled(fn, activities, all_threads: bool = True):
    config = all_threads_config(ProfilerActivity.CUDA in activities) if all_threads else None
    with profile(activities=activities, **({} if config is None else {"experimental_config": config})) as prof:
        wall = fn()
    return prof, wall


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--side", type=int, default=512, help="image height and width in pixels")
    parser.add_argument("--warmup-rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="ops listed per table")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model: 2 requests x 2 steps at 64 px")
    parser.add_argument("--trace", type=Path, default=None, help="keep the StepBatched round's Chrome trace here")
    parser.add_argument("--caller-thread-only", action="store_true",
                        help="profile host ops of the starting thread only (kineto's default; device work is "
                             "recorded either way)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "profile_steps.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.concurrency, args.steps, args.side, args.warmup_rounds = 2, 2, 64, 1
    if cuda:
        from gpu_suite import FLUX1_WIDTH

        pipe = tiny_flux_pipeline(guidance_embeds=True, size=FLUX1_WIDTH, vae_blocks=4).to("cuda", torch.bfloat16)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    else:
        torch.set_num_threads(1)
        pipe = tiny_flux_pipeline(guidance_embeds=True, size=FluxSize(), vae_blocks=4)
        activities = [ProfilerActivity.CPU]
    n, side, steps = args.concurrency, args.side, args.steps
    sb = StepBatched(pipe, max_batch_size=n)
    for r in range(args.warmup_rounds):  # NOTE: new prompts every round (no prompt-cache hits)
        closed_round(sb, n, side, steps, offset=1000 * (r + 1))
        sequential_round(pipe, 1, side, steps, offset=0)
    sb.engine.wait_idle()
    hooks = mark_transformer_calls(pipe.transformer)
    all_threads = not args.caller_thread_only
    calls_before = len(sb.engine.metrics.calls)
    batched_prof, batched_wall = profiled(lambda: closed_round(sb, n, side, steps, offset=0), activities, all_threads)
    sb.engine.wait_idle()
    batched_calls = len(sb.engine.metrics.calls) - calls_before
    sequential_prof, sequential_wall = profiled(lambda: sequential_round(pipe, n, side, steps, offset=0), activities,
                                                all_threads)
    for hook in hooks:
        hook.remove()
    stats = sb.stats()
    # NOTE: the profiled round's calls (the last ones: the sequential side ran the plain pipeline)
    round_calls = list(sb.engine.metrics.calls)[-batched_calls:] if batched_calls else []
    sb.close()
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        batched_prof.export_chrome_trace(str(args.trace))
    gaps = {"stepbatched": device_gaps(profile_device_spans(batched_prof) or trace_spans(batched_prof, args.trace)),
            "sequential": device_gaps(profile_device_spans(sequential_prof) or trace_spans(sequential_prof, None))}
    report = {
        "command": command_line("benchmarks/profile_steps.py", argv),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "concurrency": n, "steps": steps, "side": side,
        "all_threads_profiled": all_threads and all_threads_config(cuda) is not None,
        "stepbatched": {**summarize(batched_prof, batched_wall, args.top), "device_gaps": gaps["stepbatched"],
                        "rows_per_call_by_kind": rows_per_call_by_kind(round_calls),
                        "outside_model_ms_per_step": stats["outside_model_ms_per_step"]},
        "sequential": {**summarize(sequential_prof, sequential_wall, args.top), "device_gaps": gaps["sequential"]},
    }
    report["sequential_over_stepbatched_wall"] = sequential_wall / batched_wall
    print_report(report)
    write_report(args.out, report)
    return report


def print_report(report: dict) -> None:
    print(f"{report['concurrency']} requests x {report['steps']} steps at {report['side']}px on {report['device']} "
          f"(torch {report['torch']}), one profiled round per side")
    for side in ("stepbatched", "sequential"):
        r = report[side]
        idle = "-" if r["device_idle_share"] is None else f"{100 * r['device_idle_share']:.0f}%"
        print(f"\n{side}: wall {r['wall_ms']:.1f} ms, device busy {r['device_busy_ms']:.1f} ms (idle {idle}), "
              f"{r['transformer_calls']} transformer calls spanning {r['transformer_host_span_ms']:.1f} ms on the host; "
              f"host ops: model thread {r['host_op_ms_model_thread']:.1f} ms, other threads "
              f"{r['host_op_ms_other_threads']:.1f} ms; host syncs {r['host_syncs'] or 'none'}, "
              f"copies {r['copy_calls'] or 'none'}")
        if "rows_per_call_by_kind" in r:
            print(f"  rows per call: {r['rows_per_call_by_kind']}")
        if r["device_gaps"]:
            g = r["device_gaps"]
            print(f"  device timeline: span {g['span_ms']:.1f} ms, busy {g['busy_ms']:.1f}, idle {g['idle_ms']:.1f} "
                  f"ms; idle by gap length {g['idle_ms_by_gap_length']}; idle per tenth of the span "
                  f"{g['idle_ms_by_tenth_of_span']}; longest gaps {g['longest_gaps_ms']}")
        for title, table in (("device", r["top_device_ops_ms"]), ("host", r["top_host_ops_ms"])):
            if table:
                print(f"  top {title} ops (self ms): " + ", ".join(f"{k} {v:.1f}" for k, v in list(table.items())[:8]))
    print(f"\nsequential / StepBatched wall: {report['sequential_over_stepbatched_wall']:.2f}x")


if __name__ == "__main__":
    main()
