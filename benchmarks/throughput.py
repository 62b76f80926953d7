"""Throughput and latency: sequential plain pipeline calls vs StepBatched, side by side in one run.

    python benchmarks/throughput.py                 # both sizes, 8 concurrent requests
    python benchmarks/throughput.py --smoke         # a few seconds, for CI
    python benchmarks/throughput.py --family sd3    # sd3, qwenimage, sdxl, sd, pixart-generic: tiny, closed loop

For each transformer size it measures, in the same process and run:
- sequential: the N requests served one after another by the unwrapped pipeline;
- StepBatched: the N requests submitted at once (closed loop) and as Poisson arrivals;
- the ceiling: N images / (raw batched encode + steps x raw batched transformer forward + raw batched decode),
  each stage at its best batch size (N, N/2, ..., 1 rows per call; `measure_ceiling`), each stage timed as a
  median call times its count; and the same raw calls run as one whole round and timed end to end.
Absolute times are not comparable across runs on a noisy machine; the ratios printed are.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NOTE: before torch loads: OpenMP threads that sleep instead of spinning; on a shared CPU spinning made
# the same calls several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    size: FluxSize
    image_side: int  # pixels; vae_scale_factor 8, 2x2 packing: tokens = (side / 16) ** 2


WORKLOADS = {
    "overhead-bound": Workload("overhead-bound", FluxSize(), 256),  # hidden 32, 2 blocks, 256 tokens
    "compute-bound": Workload(
        "compute-bound",
        FluxSize(num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=4,
                 joint_attention_dim=64, pooled_projection_dim=64),
        512,  # hidden 256, 6 blocks, 1024 tokens
    ),
}


def in_worker_thread(fn, *args):
    """Run fn(*args) in a fresh thread and return its result.

    NOTE: StepBatched runs models in its engine thread. On a loaded machine, OpenMP in the main thread can be
    several times slower than in other threads (measured here: 1.4 s vs 0.17 s for the same call), so every
    side of a comparison runs its model calls from a non-main thread, as a server's workers would.
    """
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)))
    thread.start()
    thread.join()
    return result["value"]


def command_line(script: str, argv: list[str] | None) -> str:
    """How this run was started, for the JSON (`script` relative to the repository root)."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def write_report(out: Path, report: dict) -> None:
    """The run's JSON, next to what it printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(round(q * (len(ordered) - 1))), len(ordered) - 1)]


def summarize(latencies: list[float], wall: float) -> dict:
    return {
        "throughput_images_per_s": len(latencies) / wall,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "wall_s": wall,
    }


def request_kwargs(i: int, workload: Workload, steps: int) -> dict:
    return dict(prompt=f"a red circle {i}", height=workload.image_side,
                width=workload.image_side, num_inference_steps=steps, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(i), output_type="pt", max_sequence_length=32)


def run_sequential(pipe, make_kwargs, n: int, arrivals: list[float]) -> dict:
    """One server, requests in arrival order: latency = finish - arrival. `make_kwargs(i)` is request i."""
    start = time.perf_counter()
    latencies = []
    for i, arrival in enumerate(arrivals[:n]):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pipe(**make_kwargs(i)).images.cpu()  # .cpu(): wait for the device
        latencies.append(time.perf_counter() - start - arrival)
    return summarize(latencies, time.perf_counter() - start)


def run_clients(n: int, client) -> float:
    """Run `client(i, start)` in n threads released together at `start` (returned) and wait for all of them.

    NOTE: the threads exist before the clock starts, as a server's workers do: started one by one after the
    clock, each `Thread.start()` waits for a GIL handoff while the engine already runs the first request, a
    cost the sequential side (one thread calling in a loop) never pays.
    """
    ready, go, start = threading.Barrier(n + 1), threading.Event(), [0.0]

    def body(i: int) -> None:
        ready.wait()
        go.wait()
        client(i, start[0])

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    ready.wait()
    start[0] = time.perf_counter()
    go.set()
    for thread in threads:
        thread.join()
    return start[0]


def run_stepbatched(sb: StepBatched, make_kwargs, n: int, arrivals: list[float]) -> dict:
    """One round of n requests on a long-lived (warmed-up) engine; its stats cover this round only."""
    sb.engine.wait_idle()
    sb.reset_stats()
    latencies = [0.0] * n

    def client(i: int, start: float) -> None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sb(**make_kwargs(i)).images.cpu()
        latencies[i] = time.perf_counter() - start - arrivals[i]

    start = run_clients(n, client)
    wall = time.perf_counter() - start
    sb.engine.wait_idle()  # NOTE: the last engine step records its times after it resolved the last Future
    stats = sb.stats()
    result = summarize(latencies, wall)
    result["mean_batch_rows"] = stats["mean_denoise_rows"]
    result["engine_overhead_ms_per_step"] = stats["overhead_ms_per_step"]
    result["outside_model_ms_per_step"] = stats["outside_model_ms_per_step"]
    result["ms_per_step"] = 1000 * wall / max(stats["engine_steps"], 1)
    result["model_seconds_by_kind"] = model_seconds_by_kind(sb.engine.metrics.calls)
    result["rows_per_call_by_kind"] = rows_per_call_by_kind(sb.engine.metrics.calls)
    return result


def rows_per_call_by_kind(calls) -> dict[str, list[int]]:
    """The rows of each of the round's engine calls per work kind, in order: how the cost model split groups."""
    rows: dict[str, list[int]] = {}
    for call in calls:
        rows.setdefault(call.kind, []).append(call.rows)
    return rows


def model_seconds_by_kind(calls) -> dict[str, float]:
    """Wall seconds of the round's engine calls per work kind (on CUDA: their launches; see engine/timing.py)."""
    totals: dict[str, float] = {}
    for call in calls:
        totals[call.kind] = totals.get(call.kind, 0.0) + call.seconds
    return totals


def where_the_round_goes(batched: dict, ceiling: dict, steps: int) -> dict:
    """One round's StepBatched seconds per stage next to the ceiling's, and the rest of its wall time.

    NOTE: "outside model calls" is the round's wall time less its encode, denoise and decode calls: callers'
    prologues before the first call, each request's own work between calls (latents, timesteps, scheduler
    updates, postprocessing) and the engine's; the ceiling has none of it. Meaningful on a CPU, where a call's
    wall time is its cost.
    """
    spent = batched["model_seconds_by_kind"]
    stages = {"encode": ceiling["encode"]["seconds"], "denoise": steps * ceiling["forward"]["seconds"],
              "decode": ceiling["decode"]["seconds"]}
    report = {stage: {"stepbatched_s": spent.get(stage, 0.0), "ceiling_s": seconds} for stage, seconds in stages.items()}
    report["outside model calls"] = {"stepbatched_s": batched["wall_s"] - sum(spent.get(s, 0.0) for s in stages),
                                     "ceiling_s": 0.0}
    return report


def batch_sizes(n: int) -> list[int]:
    """n, n/2, n/4, ... down to 1 (or the last size that still divides n)."""
    sizes = [n]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def measure_ceiling(pipe, workload: Workload, n: int, steps: int, repeats: int) -> dict:
    """Raw batched model time for n images: encode + steps x transformer forward + decode, each stage at its
    best batch size (n images as n/b calls of b rows, b = n, n/2, ..., 1).

    NOTE: a batch of n rows is not always the fastest way to run n rows (on a CPU, 2 x 8 rows beat 16 rows at
    the overhead-bound shape), and the engine's cost model may split; the ceiling takes the best split too, so
    that it bounds what any batching of these calls can reach.
    """
    device = pipe._execution_device
    prompts = [request_kwargs(i, workload, steps)["prompt"] for i in range(n)]
    embeds, pooled, text_ids = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=32)
    latents, image_ids = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, workload.image_side,
                                              workload.image_side, embeds.dtype, device, None)
    vae_latents = pipe._unpack_latents(latents, workload.image_side, workload.image_side, pipe.vae_scale_factor)
    guidance = torch.full([n], 3.5, device=device) if pipe.transformer.config.guidance_embeds else None
    timestep = torch.full([n], 0.5, device=device, dtype=latents.dtype)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def encode(b: int):
        return pipe.encode_prompt(prompts[:b], prompt_2=None, max_sequence_length=32)

    def forward(b: int):
        return pipe.transformer(hidden_states=latents[:b], timestep=timestep[:b],
                                guidance=None if guidance is None else guidance[:b],
                                pooled_projections=pooled[:b], encoder_hidden_states=embeds[:b], txt_ids=text_ids,
                                img_ids=image_ids, return_dict=False)

    def decode(b: int):
        return pipe.vae.decode(vae_latents[:b], return_dict=False)

    stages = {}
    with torch.no_grad():
        for name, stage in (("encode", encode), ("forward", forward), ("decode", decode)):
            per_size = {b: (n // b) * timed(functools.partial(stage, b)) for b in batch_sizes(n)}
            best = min(per_size, key=per_size.get)
            stages[name] = {"seconds": per_size[best], "best_rows": best, "batch_n_seconds": per_size[n]}
        # NOTE: the stages above are a median call times its count. A round runs every call back to back, slow
        # ones included: the raw round, at the best rows per stage, is what an engine with no host work at all
        # would run, a check on the stage sums (on this CPU it ran at 0.92-1.31x their throughput).
        def raw_round():
            for name, stage, repeat in (("encode", encode, 1), ("forward", forward, steps), ("decode", decode, 1)):
                best = stages[name]["best_rows"]
                for _ in range(repeat * (n // best)):
                    stage(best)

        raw_round_seconds = timed(raw_round)
    total = stages["encode"]["seconds"] + steps * stages["forward"]["seconds"] + stages["decode"]["seconds"]
    batch_n = (stages["encode"]["batch_n_seconds"] + steps * stages["forward"]["batch_n_seconds"]
               + stages["decode"]["batch_n_seconds"])
    return {"throughput_images_per_s": n / total, "batch_n_throughput_images_per_s": n / batch_n,
            "raw_round_throughput_images_per_s": n / raw_round_seconds, **stages}


def bench_workload(workload: Workload, n: int, steps: int, repeats: int, seed: int, pipe=None,
                   rounds: int = 3, warmup_rounds: int = 3, compile_transformer: bool = False) -> dict:
    pipe = pipe or tiny_flux_pipeline(guidance_embeds=True, size=workload.size, vae_blocks=4)
    if compile_transformer and pipe.transformer._compiled_call_impl is None:  # (a shared pipe: compiled once)
        # NOTE: diffusers' own way, in place, for every side (sequential, StepBatched and the ceiling); dynamic
        # shapes, so the engine's changing row counts share one compiled graph after the first batch
        pipe.transformer.compile(dynamic=True)
    for _ in range(2):  # warm-up: first-call allocations and lazy initialisation
        in_worker_thread(lambda: pipe(**request_kwargs(0, workload, 2)))
    closed = [0.0] * n
    sb = StepBatched(pipe, max_batch_size=n)

    def round_kwargs(r: int):
        # NOTE: new prompts every round: a prompt seen in an earlier round would be a prompt-cache hit, which
        # skips the encode that the sequential side and the ceiling both pay.
        return lambda i: request_kwargs(i + (r + 1) * 1000, workload, steps)

    # NOTE: a server's engine is long-lived: unmeasured rounds let its cost model measure the batch sizes first
    # (as the sequential side's warm-up calls do for the plain pipeline).
    for r in range(warmup_rounds):
        run_stepbatched(sb, round_kwargs(-1 - r), n, closed)
    # Rounds interleave the three sides, so that a change in the machine's load between them moves all three.
    per_round = []
    for r in range(rounds):
        sequential = in_worker_thread(run_sequential, pipe, round_kwargs(r), n, closed)
        batched = run_stepbatched(sb, round_kwargs(r), n, closed)
        ceiling = in_worker_thread(measure_ceiling, pipe, workload, n, steps, repeats)
        per_round.append({"sequential": sequential, "stepbatched": batched, "ceiling": ceiling})
    sequential, batched, ceiling = (_median_round(per_round, side) for side in ("sequential", "stepbatched", "ceiling"))
    # Poisson arrivals at 1.2x the sequential service rate: the plain pipeline falls behind.
    rng = random.Random(seed)
    rate = 1.2 * sequential["throughput_images_per_s"]
    arrivals, clock = [], 0.0
    for _ in range(n):
        arrivals.append(clock)
        clock += rng.expovariate(rate)
    poisson_sequential = in_worker_thread(run_sequential, pipe, round_kwargs(rounds), n, arrivals)
    poisson_batched = run_stepbatched(sb, round_kwargs(rounds), n, arrivals)
    sb.close()

    def ratio(a: str, b: str) -> float:  # the median over rounds of each round's own ratio
        return statistics.median(x[a]["throughput_images_per_s"] / x[b]["throughput_images_per_s"] for x in per_round)

    rounds_spent = [where_the_round_goes(x["stepbatched"], x["ceiling"], steps) for x in per_round]
    spent = {part: {side: statistics.median(r[part][side] for r in rounds_spent) for side in rounds_spent[0][part]}
             for part in rounds_spent[0]}

    return {
        "workload": workload.name,
        "compiled_transformer": compile_transformer,
        "transformer_params": sum(p.numel() for p in pipe.transformer.parameters()),
        "image_tokens": (workload.image_side // 16) ** 2,
        "concurrency": n,
        "steps": steps,
        "rounds": rounds,
        "closed_loop": {"sequential": sequential, "stepbatched": batched},
        "poisson": {"rate_per_s": rate, "sequential": poisson_sequential, "stepbatched": poisson_batched},
        "ceiling": ceiling,
        "per_round": [{side: x[side]["throughput_images_per_s"] for side in x} for x in per_round],
        "where_the_round_goes": spent,  # medians over rounds, seconds
        "ratios": {
            "closed_throughput_vs_sequential": ratio("stepbatched", "sequential"),
            "closed_throughput_vs_ceiling": ratio("stepbatched", "ceiling"),
            "closed_throughput_vs_raw_round": statistics.median(
                x["stepbatched"]["throughput_images_per_s"] / x["ceiling"]["raw_round_throughput_images_per_s"]
                for x in per_round),
            "poisson_p50_latency_sequential_over_batched": poisson_sequential["latency_p50_s"]
            / poisson_batched["latency_p50_s"],
        },
    }


def _median_round(per_round: list[dict], side: str) -> dict:
    """The round whose throughput on `side` is the median one (its other numbers come with it)."""
    ordered = sorted((x[side] for x in per_round), key=lambda r: r["throughput_images_per_s"])
    return ordered[(len(ordered) - 1) // 2]


# Other families: tiny offline pipelines, closed loop only (the ceiling measurement is Flux-specific).
FAMILY_PIPELINES = {
    "sd3": ("tiny_sd3_pipeline", {}, dict(height=32, width=32, guidance_scale=5.0)),
    "qwenimage": ("tiny_qwenimage_pipeline", {}, dict(height=32, width=32, true_cfg_scale=4.0, negative_prompt="blur")),
    "sdxl": ("tiny_sdxl_pipeline", {}, dict(height=32, width=32, guidance_scale=5.0)),
    "sd": ("tiny_sd_pipeline", {}, dict(height=32, width=32, guidance_scale=7.5)),
    "pixart-generic": ("tiny_pixart_or_sana_pipeline", {},
                       dict(height=32, width=32, use_resolution_binning=False, clean_caption=False)),
}


def bench_family(family: str, n: int, steps: int) -> dict:
    import diffusers_stepbatch.testing as testing

    builder, build_kwargs, call = FAMILY_PIPELINES[family]
    pipe = getattr(testing, builder)(**build_kwargs)

    def make_kwargs(i: int) -> dict:
        return dict(prompt=f"a red circle {i}", num_inference_steps=steps, output_type="pt",
                    generator=torch.Generator().manual_seed(i), **call)

    def measured_kwargs(i: int) -> dict:  # NOTE: prompts the warm-up round did not use (no prompt-cache hits)
        return make_kwargs(i + 1000)

    in_worker_thread(lambda: pipe(**make_kwargs(0)))  # warm-up
    closed = [0.0] * n
    sb = StepBatched(pipe, max_batch_size=n)
    # NOTE: a server's engine is long-lived: one unmeasured round lets its cost model measure the batch sizes
    # first (as the sequential side's warm-up calls do for the plain pipeline).
    run_stepbatched(sb, make_kwargs, n, closed)
    sequential = in_worker_thread(run_sequential, pipe, measured_kwargs, n, closed)
    batched = run_stepbatched(sb, measured_kwargs, n, closed)
    sb.close()
    return {"family": family, "pipeline": type(pipe).__name__, "concurrency": n, "steps": steps,
            "closed_loop": {"sequential": sequential, "stepbatched": batched},
            "ratios": {"closed_throughput_vs_sequential":
                       batched["throughput_images_per_s"] / sequential["throughput_images_per_s"]}}


def print_family(result: dict) -> None:
    closed = result["closed_loop"]
    print(f"== {result['pipeline']} ({result['family']}): {result['concurrency']} requests x {result['steps']} steps: "
          f"sequential {closed['sequential']['throughput_images_per_s']:.2f} images/s, StepBatched "
          f"{closed['stepbatched']['throughput_images_per_s']:.2f} images/s "
          f"(mean rows {closed['stepbatched']['mean_batch_rows']:.2f}): "
          f"{result['ratios']['closed_throughput_vs_sequential']:.2f}x")


def print_result(result: dict) -> None:
    closed, poisson, ratios = result["closed_loop"], result["poisson"], result["ratios"]
    print(f"\n== {result['workload']}: {result['transformer_params'] / 1e6:.2f}M-param Flux transformer, "
          f"{result['image_tokens']} image tokens, {result['concurrency']} requests x {result['steps']} steps")
    header = (f"{'':28}{'images/s':>10}{'mean s':>9}{'p50 s':>9}{'p95 s':>9}{'rows':>7}{'ovh ms':>8}"
              f"{'outside model ms':>18}{'step ms':>9}")
    print(header)
    rows = [("sequential (closed)", closed["sequential"]), ("StepBatched (closed)", closed["stepbatched"]),
            ("sequential (Poisson)", poisson["sequential"]), ("StepBatched (Poisson)", poisson["stepbatched"])]
    for label, r in rows:
        extra = (f"{r.get('mean_batch_rows', 1.0):7.2f}{r.get('engine_overhead_ms_per_step', 0.0):8.3f}"
                 f"{r.get('outside_model_ms_per_step', 0.0):18.3f}{r.get('ms_per_step', 0.0):9.2f}")
        print(f"{label:28}{r['throughput_images_per_s']:10.2f}{r['latency_mean_s']:9.3f}{r['latency_p50_s']:9.3f}"
              f"{r['latency_p95_s']:9.3f}{extra}")
    ceiling = result["ceiling"]
    best = ", ".join(f"{stage} {ceiling[stage]['best_rows']}" for stage in ("encode", "forward", "decode"))
    print(f"{'ceiling (raw batched)':28}{ceiling['throughput_images_per_s']:10.2f}   best rows per call: {best}; "
          f"all stages at {result['concurrency']} rows: {ceiling['batch_n_throughput_images_per_s']:.2f} images/s; "
          f"a raw round timed whole: {ceiling['raw_round_throughput_images_per_s']:.2f} images/s")
    spent = ", ".join(f"{part} {1000 * times['stepbatched_s']:.0f} ({1000 * times['ceiling_s']:.0f})"
                      for part, times in result["where_the_round_goes"].items())
    print(f"where a StepBatched round goes, ms (the ceiling's): {spent}")
    print(f"medians of {result['rounds']} interleaved rounds; ratios are medians of each round's own ratio")
    print(f"ratios: StepBatched/sequential {ratios['closed_throughput_vs_sequential']:.2f}x, "
          f"StepBatched/ceiling {ratios['closed_throughput_vs_ceiling']:.2f} "
          f"(/raw round {ratios['closed_throughput_vs_raw_round']:.2f}), "
          f"Poisson p50 latency sequential/StepBatched {ratios['poisson_p50_latency_sequential_over_batched']:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8],
                        help="one or more numbers of concurrent requests, e.g. 8 16 32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each raw ceiling measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three sides; medians")
    parser.add_argument("--warmup-rounds", type=int, default=3, help="unmeasured StepBatched rounds first")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--family", default="flux", choices=["flux", *FAMILY_PIPELINES],
                        help="flux: both Flux workloads with the ceiling; others: tiny closed-loop comparison")
    parser.add_argument("--smoke", action="store_true", help="tiny and fast: 2 requests x 2 steps, tiny model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="pipe.transformer.compile(dynamic=True) first, for every side (Flux workloads)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads for every side (1 ran the plain tiny pipelines fastest here)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "throughput.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.concurrency, args.steps, args.repeats, args.workloads, args.rounds = [2], 2, 1, ["overhead-bound"], 1
        args.warmup_rounds = 1
    torch.manual_seed(args.seed)
    results = []
    for n in args.concurrency:
        if args.family == "flux":
            for name in args.workloads:
                results.append(bench_workload(WORKLOADS[name], n, args.steps, args.repeats, args.seed,
                                              rounds=args.rounds, warmup_rounds=args.warmup_rounds,
                                              compile_transformer=args.compile))
                print_result(results[-1])
        else:
            results.append(bench_family(args.family, n, args.steps))
            print_family(results[-1])
    report = {"command": command_line("benchmarks/throughput.py", argv), "torch_threads": torch.get_num_threads(),
              "results": results}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
