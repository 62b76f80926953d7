"""Video requests of mixed shapes on a tiny Wan: throughput, and short requests behind long ones.

    python benchmarks/video.py            # 6 mixed-shape requests, 3 interleaved rounds; then the latency trace
    python benchmarks/video.py --smoke    # a few seconds, for CI

Throughput: 6 concurrent text-to-video requests over 3 (frames, height, width) shapes, run
- sequentially (one plain `WanPipeline` call after another),
- StepBatched with `mixed_resolution=False` (requests share forwards only with their own shape),
- StepBatched packed (every shape in one forward where the model layer packs Wan's tokens).

Latency trace: long requests (many steps, the largest shape) arrive back to back while short ones (few steps,
the smallest shape) arrive in between; the short requests' p50 / p95 latency from arrival to video, for
- sequential (one server, first come first served),
- whole-request batching (the waiting requests of one shape and step count run as one plain pipeline call;
  new arrivals wait for the call in flight to end, as servers that batch whole requests do),
- StepBatched (fcfs: a new request joins the running batch at the next step) and StepBatched(policy="sjf").
Every side runs its model calls off the main thread; rounds are interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import command_line, in_worker_thread, percentile, run_clients, write_report  # noqa: E402

from diffusers_stepbatch import SchedulerConfig, StepBatched  # noqa: E402
from diffusers_stepbatch.toy.video import tiny_wan_pipeline  # noqa: E402

SHAPES = [(9, 32, 32), (5, 32, 48), (13, 48, 32)]  # (frames, height, width)


def _request(i: int, shape: tuple[int, int, int], steps: int) -> dict:
    frames, height, width = shape
    return dict(prompt=f"a red ball rolling {i}", negative_prompt="blurry", num_frames=frames, height=height,
                width=width, num_inference_steps=steps, guidance_scale=5.0, output_type="pt",
                max_sequence_length=16, generator=torch.Generator().manual_seed(i))


def _frames(output) -> torch.Tensor:
    return output.frames.cpu()


def _frames_of(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else _frames(result)


def run_sequential(pipe, requests: list[dict]) -> float:
    start = time.perf_counter()
    for kwargs in requests:
        _frames(pipe(**kwargs))
    return len(requests) / (time.perf_counter() - start)


def run_concurrent(sb: StepBatched, requests: list[dict]) -> tuple[float, dict]:
    sb.engine.wait_idle()
    sb.reset_stats()

    def client(i: int, start: float) -> None:
        _frames(sb(**requests[i]))

    start = run_clients(len(requests), client)
    wall = time.perf_counter() - start
    sb.engine.wait_idle()
    stats = sb.stats()
    return len(requests) / wall, {"mean_denoise_rows": stats["mean_denoise_rows"], "mixed": stats["mixed"]}


def bench_throughput(pipe, n: int, steps: int, rounds: int) -> dict:
    def requests() -> list[dict]:
        return [_request(i, SHAPES[i % len(SHAPES)], steps) for i in range(n)]

    # NOTE: two rows per request: WanPipeline calls its transformer once per CFG branch
    engines = {"per_shape": StepBatched(pipe, max_batch_size=2 * n, mixed_resolution=False),
               "packed": StepBatched(pipe, max_batch_size=2 * n, mixed_resolution=True)}
    in_worker_thread(lambda: [pipe(**kwargs) for kwargs in requests()[:len(SHAPES)]])  # warm-up
    for sb in engines.values():
        for _ in range(2):
            run_concurrent(sb, requests())
    runs: dict[str, list[float]] = {"sequential": [], **{label: [] for label in engines}}
    details = {}
    for _ in range(rounds):
        runs["sequential"].append(in_worker_thread(run_sequential, pipe, requests()))
        for label, sb in engines.items():
            rate, details[label] = run_concurrent(sb, requests())
            runs[label].append(rate)
    for sb in engines.values():
        sb.close()
    medians = {label: statistics.median(values) for label, values in runs.items()}
    return {"videos_per_s": medians, "rounds": runs, "last_round": details,
            "per_shape_vs_sequential": medians["per_shape"] / medians["sequential"],
            "packed_vs_sequential": medians["packed"] / medians["sequential"],
            "packed_vs_per_shape": medians["packed"] / medians["per_shape"]}


def _trace(longs: int, shorts: int, long_steps: int, short_steps: int, long_seconds: float) -> list[tuple]:
    """(arrival s, kind, kwargs): longs back to back (one every `long_seconds`), shorts spread in between."""
    arrivals = [(i * long_seconds, "long", _request(i, SHAPES[2], long_steps)) for i in range(longs)]
    span = longs * long_seconds
    arrivals += [((j + 0.5) * span / shorts, "short", _request(100 + j, SHAPES[0], short_steps))
                 for j in range(shorts)]
    return sorted(arrivals, key=lambda entry: entry[0])


def _replay(trace: list[tuple], serve) -> dict:
    """Run `serve(**kwargs)` per arrival in its own client thread; latency per kind."""
    latencies: dict[str, list[float]] = {"long": [], "short": []}
    lock = threading.Lock()

    def client(i: int, start: float) -> None:
        arrival, kind, kwargs = trace[i]
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        _frames_of(serve(**dict(kwargs, generator=torch.Generator().manual_seed(i))))
        with lock:
            latencies[kind].append(time.perf_counter() - start - arrival)

    run_clients(len(trace), client)
    return {kind: {"p50_s": percentile(values, 0.5), "p95_s": percentile(values, 0.95), "count": len(values)}
            for kind, values in latencies.items()}


class _OneAtATime:
    """A server that runs one plain call at a time, in arrival order."""

    def __init__(self, pipe):
        self.pipe, self.lock = pipe, threading.Lock()

    def __call__(self, **kwargs):
        with self.lock:
            return _frames(self.pipe(**kwargs))


class _WholeRequestBatcher:
    """Waiting requests of equal shape and step count run as one plain call (prompt and generator lists);
    requests that arrive meanwhile wait for the call in flight."""

    _GROUP = ("num_frames", "height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")

    def __init__(self, pipe):
        self.pipe, self.cond = pipe, threading.Condition()
        self.waiting: list[tuple[dict, dict]] = []
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def __call__(self, **kwargs):
        slot: dict = {}
        with self.cond:
            self.waiting.append((kwargs, slot))
            self.cond.notify_all()
            while "frames" not in slot:
                self.cond.wait()
        return slot["frames"]

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                first = self.waiting[0][0]
                group = [entry for entry in self.waiting
                         if all(entry[0][name] == first[name] for name in self._GROUP)]
                self.waiting = [entry for entry in self.waiting if entry not in group]
            batch = dict(first, prompt=[kwargs["prompt"] for kwargs, _ in group],
                         negative_prompt=[kwargs["negative_prompt"] for kwargs, _ in group],
                         generator=[kwargs["generator"] for kwargs, _ in group])
            frames = _frames(self.pipe(**batch))
            with self.cond:
                for row, (_, slot) in enumerate(group):
                    slot["frames"] = frames[row:row + 1]
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()


def bench_trace(pipe, longs: int, shorts: int, long_steps: int, short_steps: int, rounds: int) -> dict:
    one_long = in_worker_thread(lambda: _timed(pipe, _request(0, SHAPES[2], long_steps)))
    trace = _trace(longs, shorts, long_steps, short_steps, long_seconds=one_long)
    batcher = _WholeRequestBatcher(pipe)
    sides = {"sequential": _OneAtATime(pipe), "whole_request_batching": batcher,
             "stepbatched_fcfs": StepBatched(pipe, max_batch_size=8),
             "stepbatched_sjf": StepBatched(pipe, max_batch_size=8, scheduler=SchedulerConfig(policy="sjf"))}
    runs: dict[str, list[dict]] = {label: [] for label in sides}
    for _ in range(rounds):
        for label, serve in sides.items():
            runs[label].append(_replay(trace, serve))
    batcher.close()
    for label in ("stepbatched_fcfs", "stepbatched_sjf"):
        sides[label].close()
    summary = {label: {kind: {q: statistics.median(r[kind][q] for r in results) for q in ("p50_s", "p95_s")}
                       for kind in ("short", "long")} for label, results in runs.items()}
    sequential_p95 = summary["sequential"]["short"]["p95_s"]
    for label in sides:
        summary[label]["short_p95_lower_than_sequential"] = sequential_p95 / summary[label]["short"]["p95_s"]
    return {"one_long_request_s": one_long, "arrivals": len(trace), "summary": summary, "rounds": runs}


def _timed(pipe, kwargs: dict) -> float:
    _frames(pipe(**kwargs))  # warm-up
    start = time.perf_counter()
    _frames(pipe(**kwargs))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--longs", type=int, default=4)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--long-steps", type=int, default=30)
    parser.add_argument("--short-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is fastest for tiny models)")
    parser.add_argument("--smoke", action="store_true", help="tiny and fast, for CI")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/video.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.steps, args.rounds = 3, 2, 1
        args.longs, args.shorts, args.long_steps, args.short_steps = 1, 2, 4, 2
    torch.set_num_threads(args.threads)
    pipe = tiny_wan_pipeline(heads=2, head_dim=12, layers=2)
    report = {"command": command_line("benchmarks/video.py", argv), "threads": args.threads,
              "shapes_frames_height_width": SHAPES}
    result = bench_throughput(pipe, args.requests, args.steps, args.rounds)
    report["throughput"] = result
    rates = result["videos_per_s"]
    print(f"{args.requests} requests over {len(SHAPES)} shapes, {args.steps} steps: videos/s")
    print(f"  sequential {rates['sequential']:.2f}  per-shape {rates['per_shape']:.2f} "
          f"({result['per_shape_vs_sequential']:.2f}x)  packed {rates['packed']:.2f} "
          f"({result['packed_vs_sequential']:.2f}x; {result['packed_vs_per_shape']:.2f}x per-shape)")
    trace = bench_trace(pipe, args.longs, args.shorts, args.long_steps, args.short_steps, args.rounds)
    report["trace"] = trace
    print(f"trace: {args.longs} long ({args.long_steps} steps) + {args.shorts} short ({args.short_steps} steps) "
          f"requests; short-request latency p50 / p95 s (p95 x lower than sequential)")
    for label, row in trace["summary"].items():
        print(f"  {label:24s} {row['short']['p50_s']:6.2f} / {row['short']['p95_s']:6.2f} "
              f"({row['short_p95_lower_than_sequential']:.2f}x)   long p50 {row['long']['p50_s']:.2f}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
