"""`python benchmarks/serve.py --mix tenants`: one tenant's burst against another's lone requests, fair share
between tenants against plain FCFS, in the same run.

Two server processes with the same keys (two tenants of weight 1) and the toy model, one with `--fair-share`,
one with `--no-fair-share`; the sides run one after the other, alternating round by round. In a round the
"burst" tenant sends `--burst` generations at once, and while they run the "lone" tenant sends one request at
a time (closed loop). Reported per side: the lone tenant's latencies (p50, p95) and the burst's throughput
(its requests over the time until its last answer). Every answer is checked (0 lost, 0 5xx).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

KEYS = """
[[keys]]
key = "sk-burst"
tenant = "burst"

[[keys]]
key = "sk-lone"
tenant = "lone"
"""


async def _round(url: str, burst: int, steps: int, lone_gap_s: float) -> dict:
    import httpx

    outcome = {"ok": 0, "lost": 0, "status_5xx": 0, "status_other": 0}
    body = {"model": "toy-shapes", "prompt": "a red circle at the top left on a white background",
            "size": "64x64", "num_inference_steps": steps}

    async def post(client: httpx.AsyncClient, key: str, seed: int) -> float | None:
        started = time.perf_counter()
        try:
            response = await client.post("/v1/images/generations", json={**body, "seed": seed},
                                         headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError:
            outcome["lost"] += 1
            return None
        kind = "ok" if response.status_code == 200 else "status_5xx" if response.status_code >= 500 else \
            "status_other"
        outcome[kind] += 1
        return time.perf_counter() - started

    limits = httpx.Limits(max_connections=burst + 4, max_keepalive_connections=burst + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        started = time.perf_counter()
        bursting = asyncio.gather(*(post(client, "sk-burst", seed) for seed in range(burst)))
        done = asyncio.ensure_future(bursting)
        lone: list[float] = []
        await asyncio.sleep(lone_gap_s)  # NOTE: the burst is queued first, as a burst that came before
        seed = 10_000
        while not done.done():
            latency = await post(client, "sk-lone", seed)
            seed += 1
            if latency is not None:
                lone.append(latency)
        await done
        burst_s = time.perf_counter() - started
    return {"lone": lone, "burst_s": burst_s, "outcome": outcome}


def _run_round(url: str, burst: int, steps: int, lone_gap_s: float) -> dict:
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", asyncio.run(
        _round(url, burst, steps, lone_gap_s))))  # NOTE: clients off the main thread, as in serve.py
    thread.start()
    thread.join()
    return result["value"]


def main(args) -> dict:
    from serve import free_port, percentile, start

    burst, steps, rounds = (args.burst, 20, args.rounds) if not args.smoke else (8, 3, 1)
    keys = Path(tempfile.mkdtemp(prefix="stepbatch-tenants-")) / "keys.toml"
    keys.write_text(KEYS)
    sides = {"fair_share": "--fair-share", "fcfs": "--no-fair-share"}
    processes, urls = {}, {}
    try:
        for side, flag in sides.items():
            port = free_port()
            processes[side] = start([sys.executable, "-m", "diffusers_stepbatch.serve", "--port", str(port),
                                     "--max-batch-size", str(args.max_batch_size), "--max-queue", "0",
                                     "--api-keys", str(keys), flag, "--no-access-log", "--log-level", "warning"],
                                    port)
            urls[side] = f"http://127.0.0.1:{port}"
        for side in sides:  # warm-up
            _run_round(urls[side], 4, 2, 0.0)
        totals = {side: {"lone": [], "burst_s": 0.0, "burst_requests": 0, "ok": 0, "lost": 0, "status_5xx": 0,
                         "status_other": 0} for side in sides}
        for index in range(rounds):
            order = list(sides) if index % 2 == 0 else list(reversed(sides))
            for side in order:
                got = _run_round(urls[side], burst, steps, 0.2)
                total = totals[side]
                total["lone"] += got["lone"]
                total["burst_s"] += got["burst_s"]
                total["burst_requests"] += burst
                for key, value in got["outcome"].items():
                    total[key] += value
                print(f"round {index + 1}/{rounds} {side:>10}: lone p95 {percentile(got['lone'], 0.95):6.2f} s "
                      f"({len(got['lone'])} requests), burst {burst / got['burst_s']:5.2f} req/s", flush=True)
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(timeout=60)
    results = {}
    for side, total in totals.items():
        lone = total.pop("lone")
        results[side] = {**total, "lone_requests": len(lone), "lone_latency_p50_s": percentile(lone, 0.5),
                         "lone_latency_p95_s": percentile(lone, 0.95),
                         "burst_throughput_requests_per_s": total["burst_requests"] / total["burst_s"]}
    fair, fcfs = results["fair_share"], results["fcfs"]
    ratios = {"lone_p95_fcfs_over_fair_share": fcfs["lone_latency_p95_s"] / fair["lone_latency_p95_s"],
              "burst_throughput_fair_share_over_fcfs": (fair["burst_throughput_requests_per_s"]
                                                        / fcfs["burst_throughput_requests_per_s"])}
    report = {"benchmark": "serve", "mix": "tenants", "smoke": args.smoke, "burst": burst, "steps": steps,
              "rounds": rounds, "max_batch_size": args.max_batch_size, "size": "64x64", "torch_threads": 1,
              "cpu_count": os.cpu_count(), "results": results, "ratios": ratios}
    print(f"\n{'side':>10} | lone p50 s | lone p95 s | lone reqs | burst req/s | ok | lost | 5xx")
    for side, r in results.items():
        print(f"{side:>10} | {r['lone_latency_p50_s']:10.2f} | {r['lone_latency_p95_s']:10.2f} | "
              f"{r['lone_requests']:9d} | {r['burst_throughput_requests_per_s']:11.2f} | {r['ok']} | {r['lost']} | "
              f"{r['status_5xx']}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    if fair["lost"] or fcfs["lost"] or fair["status_5xx"] or fcfs["status_5xx"] or fair["status_other"] \
            or fcfs["status_other"]:
        raise SystemExit("some requests failed: see the table")
    out = args.out or Path(__file__).parent / "results" / "serve_tenants.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report
