"""Serving on loopback: our server vs in-process StepBatched vs a FastAPI app with a lock around the pipeline.

    python benchmarks/serve.py                     # 500 requests from 32 concurrent clients per side
    python benchmarks/serve.py --smoke             # seconds, for CI
    python benchmarks/serve.py --requests 200 --rounds 4
    python benchmarks/serve.py --mix edits         # half inpainting edits (POST /v1/images/edits), half generations
    python benchmarks/serve.py --mix lora          # 64 requests over 8 LoRA adapters ("lora": {name: weight})
    python benchmarks/serve.py --mix tenants       # a tenant's burst vs another's lone requests: fair share vs fcfs

The toy-shapes model, a closed loop of `--concurrency` clients and a mixed workload (sizes, steps, seeds drawn
once, the same for every side). Sides, interleaved round by round so that the machine's load hits them alike:
- server: `python -m diffusers_stepbatch.serve` in its own process, clients over HTTP (httpx, asyncio);
- in-process: one StepBatched in this process, client threads calling it directly (no HTTP, no PNG);
- lock: a plain FastAPI app in its own process that runs the pipeline under a `threading.Lock` (what users
  write today), the same clients over HTTP.
With `--mix edits`, every other request is an inpainting edit (a multipart upload of a rendered scene and an
OpenAI mask over its top-left quadrant); the lock server runs those through `FluxInpaintPipeline` built from the
same components, under the same lock. With `--mix lora`, 8 random LoRA adapters of the toy transformer are saved
as diffusers LoRA files; each request names one with its weight: the server loads them with `--lora-modules`
(requests with different adapters share forwards), the in-process side passes `adapters=`, and the lock server
calls `set_adapters` for each request under its lock.
Bounded: every side runs exactly `--requests` requests, then the script stops. Every answer is checked (0
lost, 0 5xx); the server processes' memory is sampled (flat after warm-up?). Besides wall-clock throughput it
reports CPU milliseconds per request (server process + clients), which other load on a shared machine disturbs
far less. Every model call runs off the main thread with 1 intra-op thread (the fastest for this tiny model,
measured in benchmarks/throughput.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads: sleeping, not spinning, OpenMP

ROOT = Path(__file__).resolve().parents[1]
# NOTE: the in-process side and the server processes must run the same checkout (not an installed copy)
sys.path.insert(0, str(ROOT))
SIZES = ((64, 64), (48, 48), (96, 48))  # NOTE: sizes the toy model draws (the server refuses others)
STEPS = (10, 20, 30)
PROMPTS = (
    "a red circle at the top left on a white background",
    "a blue square at the bottom right on a black background",
    "a yellow triangle in the center on a gray background",
)
EDIT_STRENGTH = 1.0  # NOTE: every side redraws the masked part entirely (the server's default for inpainting)
TOY_CALL = {"guidance_scale": 3.5, "max_sequence_length": 16}  # NOTE: the toy was trained on 16 text tokens
LORA_ADAPTERS = tuple(f"style{i}" for i in range(8))


def save_lora_adapters(folder: Path) -> dict[str, str]:
    """8 random LoRA adapters of the toy transformer, saved as diffusers LoRA files: {name: folder}."""
    from peft.utils import get_peft_model_state_dict

    from diffusers_stepbatch.testing import add_random_lora_adapters
    from diffusers_stepbatch.toy import load_pipeline

    pipe = load_pipeline()
    add_random_lora_adapters(pipe.transformer, names=LORA_ADAPTERS)
    paths = {}
    for name in LORA_ADAPTERS:
        paths[name] = str(folder / name)
        type(pipe).save_lora_weights(paths[name], transformer_lora_layers=get_peft_model_state_dict(
            pipe.transformer, adapter_name=name))
    return paths


def load_lora_adapters(pipe, folder: Path) -> None:
    for name in LORA_ADAPTERS:
        pipe.load_lora_weights(str(folder / name), adapter_name=name)


# ------------------------------------------------------------------------------------------- the lock server
def lock_app(lora_dir: str | None = None):
    """The baseline: FastAPI + the plain pipeline behind a lock, answering like our server (b64 PNG); with
    `lora_dir`, its adapters loaded and `set_adapters` called for each request under the lock."""
    import base64
    import io

    import torch
    from fastapi import FastAPI, File, Form

    from diffusers_stepbatch.toy import load_pipeline
    from diffusers_stepbatch.toy.pipeline import ToyFluxInpaintPipeline

    pipe, lock, app = load_pipeline(), threading.Lock(), FastAPI()
    if lora_dir is not None:
        load_lora_adapters(pipe, Path(lora_dir))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/images/generations")
    def generate(body: dict) -> dict:  # a sync route: FastAPI runs it in its thread pool
        width, height = map(int, body.get("size", "64x64").split("x"))
        with lock:
            if lora_dir is not None:  # NOTE: the adapters are global state: swapped per request, under the lock
                lora = body.get("lora") or {}
                pipe.set_adapters(list(lora), list(lora.values()))
            images = pipe(body["prompt"], height=height, width=width, num_inference_steps=body["num_inference_steps"],
                          generator=torch.Generator().manual_seed(body["seed"]), **TOY_CALL).images
        data = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data.append({"b64_json": base64.b64encode(buffer.getvalue()).decode()})
        return {"created": int(time.time()), "data": data}

    inpaint = ToyFluxInpaintPipeline(**pipe.components)
    inpaint.set_progress_bar_config(disable=True)

    @app.post("/v1/images/edits")
    def edit(image: bytes = File(), mask: bytes = File(), prompt: str = Form(), size: str = Form("64x64"),
             num_inference_steps: int = Form(20), seed: int = Form(0), strength: float = Form(1.0)) -> dict:
        from PIL import Image

        width, height = map(int, size.split("x"))
        source = Image.open(io.BytesIO(image)).convert("RGB")
        repaint = Image.open(io.BytesIO(mask)).getchannel("A").point(lambda a: 255 - a)
        with lock:
            images = inpaint(prompt, image=source, mask_image=repaint, height=height, width=width, strength=strength,
                             num_inference_steps=num_inference_steps, generator=torch.Generator().manual_seed(seed),
                             **TOY_CALL).images
        return {"created": int(time.time()), "data": [{"b64_json": _b64_png(im)} for im in images]}

    return app


def _b64_png(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def run_lock_server(port: int, lora_dir: str | None = None) -> None:
    import torch
    import uvicorn

    torch.set_num_threads(1)
    uvicorn.run(lock_app(lora_dir), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ------------------------------------------------------------------------------------------------- clients
def make_workload(count: int, seed: int, steps: tuple[int, ...], edits: bool = False, lora: bool = False) -> list[dict]:
    rng = random.Random(seed)
    workload = [{"prompt": rng.choice(PROMPTS), "size": "{}x{}".format(*rng.choice(SIZES)),
                 "num_inference_steps": rng.choice(steps), "seed": rng.randrange(2**31), "edit": edits and i % 2 == 1}
                for i in range(count)]
    if lora:  # NOTE: every adapter as often, at weights from 0.5 to 1
        for i, body in enumerate(workload):
            body["lora"] = {LORA_ADAPTERS[i % len(LORA_ADAPTERS)]: round(rng.uniform(0.5, 1.0), 2)}
    return workload



def edit_inputs(size: str) -> tuple[bytes, bytes]:
    """PNG bytes of the image an edit uploads (a blue square) and its OpenAI mask (top-left quadrant clear)."""
    import io

    from PIL import Image

    from diffusers_stepbatch.toy.scenes import Scene, render_scene

    width, height = map(int, size.split("x"))
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, width // 2, height // 2))
    files = []
    for image in (render_scene(Scene("blue", "square", "at the bottom right", "white"), (width, height)), mask):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        files.append(buffer.getvalue())
    return files[0], files[1]


async def _http_clients(url: str, workload: list[dict], concurrency: int) -> tuple[list[float], dict]:
    import httpx

    pending = list(reversed(workload))
    latencies: list[float] = []
    outcome = {"ok": 0, "lost": 0, "status_5xx": 0, "status_other": 0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        async def worker() -> None:
            while pending:
                body = {"model": "toy-shapes", **pending.pop()}
                started = time.perf_counter()
                try:
                    if body.pop("edit"):
                        body["strength"] = EDIT_STRENGTH
                        image, mask = edit_inputs(body["size"])
                        response = await client.post("/v1/images/edits", data={k: str(v) for k, v in body.items()},
                                                     files={"image": ("image.png", image, "image/png"),
                                                            "mask": ("mask.png", mask, "image/png")})
                    else:
                        response = await client.post("/v1/images/generations", json=body)
                except httpx.HTTPError:
                    outcome["lost"] += 1
                    continue
                latencies.append(time.perf_counter() - started)
                if response.status_code == 200 and response.json()["data"][0]["b64_json"]:
                    outcome["ok"] += 1
                elif response.status_code >= 500:
                    outcome["status_5xx"] += 1
                else:
                    outcome["status_other"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, outcome


def http_round(url: str, workload: list[dict], concurrency: int) -> tuple[float, list[float], dict]:
    """Run `workload` against `url` from a worker thread's event loop; (wall seconds, latencies, outcome)."""
    result = {}

    def run() -> None:
        started = time.perf_counter()
        latencies, outcome = asyncio.run(_http_clients(url, workload, concurrency))
        result["value"] = (time.perf_counter() - started, latencies, outcome)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["value"]


def in_process_round(engines: dict, workload: list[dict], concurrency: int) -> tuple[float, list[float], dict]:
    """`engines`: "generate" -> the StepBatched, "edit" -> its inpainting sibling (same engine)."""
    import io

    import torch
    from PIL import Image

    def call(body: dict) -> float:
        width, height = map(int, body["size"].split("x"))
        started = time.perf_counter()
        extra, engine = {}, engines["generate"]
        if body["edit"]:
            image, mask = edit_inputs(body["size"])
            engine = engines["edit"]
            extra = {"image": Image.open(io.BytesIO(image)).convert("RGB"), "strength": EDIT_STRENGTH,
                     "mask_image": Image.open(io.BytesIO(mask)).getchannel("A").point(lambda a: 255 - a)}
        if "lora" in body:
            extra["adapters"] = body["lora"]
        images = engine(body["prompt"], height=height, width=width, num_inference_steps=body["num_inference_steps"],
                        generator=torch.Generator().manual_seed(body["seed"]), **TOY_CALL, **extra).images
        assert images
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:  # NOTE: clients and the engine: all off the main thread
        latencies = list(pool.map(call, workload))
    return time.perf_counter() - started, latencies, {"ok": len(latencies), "lost": 0, "status_5xx": 0,
                                                      "status_other": 0}


# ----------------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(command: list[str], port: int) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{command} exited: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"{command} did not become healthy")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(round(q * (len(ordered) - 1)), len(ordered) - 1)] if ordered else float("nan")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="requests per side (500; --mix lora: 64)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds the requests are split into")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=16, help="requests per side before measuring")
    parser.add_argument("--sides", nargs="+", default=["server", "in-process", "lock"],
                        choices=["server", "in-process", "lock"])
    parser.add_argument("--smoke", action="store_true", help="24 requests, 8 clients, 2-4 steps: for CI")
    parser.add_argument("--mix", choices=["generations", "edits", "lora", "tenants"], default="generations",
                        help="edits: every other request is an inpainting edit; lora: each names one of 8 adapters; "
                             "tenants: benchmarks/serve_tenants.py")
    parser.add_argument("--burst", type=int, default=200, help="--mix tenants: requests in the burst")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: results/serve.json (serve_edits.json)")
    parser.add_argument("--lock-server", type=int, default=None, help=argparse.SUPPRESS)  # the baseline process
    parser.add_argument("--lock-lora-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lock_server is not None:
        run_lock_server(args.lock_server, args.lock_lora_dir)
        return {}
    if args.requests is None:
        args.requests = 64 if args.mix == "lora" else 500
    if args.mix == "tenants":
        from serve_tenants import main as tenants_main

        if args.rounds == parser.get_default("rounds"):
            args.rounds = 2
        return tenants_main(args)
    steps = (2, 3, 4) if args.smoke else STEPS
    if args.smoke:
        args.requests, args.concurrency, args.rounds, args.warmup = 24, 8, 1, 4

    import torch

    from diffusers_stepbatch import SchedulerConfig, StepBatched
    from diffusers_stepbatch.toy import load_pipeline

    torch.set_num_threads(1)
    edits, lora = args.mix == "edits", args.mix == "lora"
    if args.out is None:
        args.out = Path(__file__).parent / "results" / {"edits": "serve_edits.json", "lora": "serve_lora.json"}.get(
            args.mix, "serve.json")
    workload = make_workload(args.requests, args.seed, steps, edits, lora)
    warmup = make_workload(args.warmup, args.seed + 1, steps, edits, lora)
    lora_dir = Path(tempfile.mkdtemp(prefix="stepbatch-loras-")) if lora else None
    lora_paths = save_lora_adapters(lora_dir) if lora else {}
    per_round = -(-len(workload) // args.rounds)  # ceil
    rounds = [workload[i:i + per_round] for i in range(0, len(workload), per_round)]

    processes, runners, pids = {}, {}, {}
    try:
        if "server" in args.sides:
            port = free_port()
            processes["server"] = start(
                [sys.executable, "-m", "diffusers_stepbatch.serve", "--port", str(port), "--max-batch-size",
                 str(args.max_batch_size), "--max-queue", "0", "--no-access-log", "--log-level", "warning",
                 *(["--lora-modules", *(f"{n}={p}" for n, p in lora_paths.items())] if lora else [])], port)
            runners["server"] = lambda w, url=f"http://127.0.0.1:{port}": http_round(url, w, args.concurrency)
            pids["server"] = processes["server"].pid
        if "lock" in args.sides:
            port = free_port()
            processes["lock"] = start([sys.executable, str(Path(__file__).resolve()), "--lock-server", str(port),
                                       *(["--lock-lora-dir", str(lora_dir)] if lora else [])], port)
            runners["lock"] = lambda w, url=f"http://127.0.0.1:{port}": http_round(url, w, args.concurrency)
            pids["lock"] = processes["lock"].pid
        sb = None
        if "in-process" in args.sides:
            pipe = load_pipeline()
            if lora:
                load_lora_adapters(pipe, lora_dir)
            sb = StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=args.max_batch_size))
            engines = {"generate": sb}
            if edits:
                from diffusers_stepbatch.toy.pipeline import ToyFluxInpaintPipeline

                inpaint_pipe = ToyFluxInpaintPipeline(**sb.pipe.components)
                inpaint_pipe.set_progress_bar_config(disable=True)
                engines["edit"] = sb.sibling(inpaint_pipe)
            runners["in-process"] = lambda w: in_process_round(engines, w, args.concurrency)
            pids["in-process"] = os.getpid()

        sides = [s for s in args.sides if s in runners]
        totals = {s: {"wall_s": 0.0, "cpu_s": 0.0, "latencies": [], "ok": 0, "lost": 0, "status_5xx": 0, "status_other": 0,
                      "rss_mib": []} for s in sides}
        for side in sides:
            runners[side](warmup)
            totals[side]["rss_after_warmup_mib"] = rss_mib(pids[side])
        for index, batch in enumerate(rounds):
            order = sides[index % len(sides):] + sides[:index % len(sides)]  # rotate who goes first
            for side in order:
                # NOTE: CPU seconds per request are robust to other load on a shared machine; wall time is not.
                # A side's cost is its server process plus this process (the clients, or the in-process engine).
                cpu_before = cpu_seconds(os.getpid()) + (cpu_seconds(pids[side]) if pids[side] != os.getpid() else 0)
                wall, latencies, outcome = runners[side](batch)
                cpu_after = cpu_seconds(os.getpid()) + (cpu_seconds(pids[side]) if pids[side] != os.getpid() else 0)
                total = totals[side]
                total["cpu_s"] += cpu_after - cpu_before
                total["wall_s"] += wall
                total["latencies"] += latencies
                for key, value in outcome.items():
                    total[key] += value
                total["rss_mib"].append(rss_mib(pids[side]))
                print(f"round {index + 1}/{len(rounds)} {side:>10}: {len(batch) / wall:6.2f} req/s, "
                      f"{1000 * (cpu_after - cpu_before) / len(batch):6.1f} CPU ms/req", flush=True)
        if sb is not None:
            sb.close()
    finally:
        if lora_dir is not None:
            shutil.rmtree(lora_dir, ignore_errors=True)
        for process in processes.values():
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()

    results = {}
    for side, total in totals.items():
        latencies = total.pop("latencies")
        results[side] = {
            **{k: v for k, v in total.items()},
            "requests": len(latencies) + total["lost"],
            "throughput_requests_per_s": len(latencies) / total["wall_s"] if total["wall_s"] else 0.0,
            "latency_p50_s": percentile(latencies, 0.5),
            "latency_p95_s": percentile(latencies, 0.95),
            "latency_mean_s": statistics.fmean(latencies) if latencies else float("nan"),
            "rss_growth_after_warmup_mib": max(total["rss_mib"], default=0) - total["rss_after_warmup_mib"],
            "cpu_ms_per_request": 1000 * total["cpu_s"] / max(len(latencies), 1),
        }
    ratios = {}
    if "server" in results and "in-process" in results:
        ratios["server_vs_in_process"] = (results["server"]["throughput_requests_per_s"]
                                          / results["in-process"]["throughput_requests_per_s"])
    if "server" in results and "in-process" in results:
        ratios["server_cpu_per_request_vs_in_process"] = (results["server"]["cpu_ms_per_request"]
                                                          / results["in-process"]["cpu_ms_per_request"])
    if "server" in results and "lock" in results:
        ratios["server_vs_lock"] = (results["server"]["throughput_requests_per_s"]
                                    / results["lock"]["throughput_requests_per_s"])
    report = {
        "benchmark": "serve", "smoke": args.smoke, "requests_per_side": args.requests,
        "concurrency": args.concurrency, "rounds": len(rounds), "max_batch_size": args.max_batch_size,
        "workload": {"sizes": [f"{w}x{h}" for w, h in SIZES], "steps": list(steps), "prompts": len(PROMPTS),
                     "mix": args.mix},
        "torch_threads": 1, "cpu_count": os.cpu_count(), "results": results, "ratios": ratios,
    }
    print(f"\n{'side':>10} | req/s | CPU ms/req | p50 s | p95 s | ok | lost | 5xx | RSS after warm-up -> max (MiB)")
    for side, r in results.items():
        print(f"{side:>10} | {r['throughput_requests_per_s']:5.2f} | {r['cpu_ms_per_request']:10.1f} | "
              f"{r['latency_p50_s']:5.2f} | "
              f"{r['latency_p95_s']:5.2f} | {r['ok']} | {r['lost']} | {r['status_5xx']} | "
              f"{r['rss_after_warmup_mib']:.0f} -> {max(r['rss_mib'], default=0):.0f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
