"""The packed Flux forward alone: rows of several sizes in one packed call vs one forward per size.

    python benchmarks/packed_forward.py
    python benchmarks/packed_forward.py --workloads flux1-width   # CUDA: FLUX.1 width, bf16, 512/768x512/1024

Times only the transformer (no engine, no text encoders, no VAE), interleaved, in a worker thread at one
intra-op thread, for the two Flux workloads of `throughput.py` with four sizes of two rows each: one forward
per size, the packed forward with recover-scatter attention, and with flex attention (block-diagonal mask;
eager on the CPU), and on CUDA with varlen (flash) attention too. Prints the ratios per workload and writes JSON;
what the engine's cost model weighs when it chooses packed or per-size, and what `packed_attention="auto"` picks
from (`models/packing/attention.py`'s AUTO_CHOICE).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import warnings  # noqa: E402

import torch  # noqa: E402

# NOTE: eager flex_attention warns once that it is unfused; that is the side being measured.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
from throughput import WORKLOADS, in_worker_thread  # noqa: E402

from diffusers_stepbatch.models.flux.packing import FluxPart, flux_packed_forward  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_transformer  # noqa: E402

GRIDS = {"overhead-bound": [(4, 4), (2, 2), (3, 5), (5, 3)],
         "compute-bound": [(32, 32), (16, 16), (24, 40), (40, 24)],
         # CUDA only: 512x512, 768x512 and 1024x1024 images (vae_scale_factor 8, 2x2 patches) on the GPU suite's
         # FLUX.1-width transformer, in bfloat16
         "flux1-width": [(32, 32), (48, 32), (64, 64)]}
CUDA_WORKLOADS = {"flux1-width"}


def image_ids(height: int, width: int) -> torch.Tensor:
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(-1, 3)


def thread_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def bench(name: str, rows: int, repeats: int, flex_repeats: int) -> dict:
    cuda = name in CUDA_WORKLOADS
    if cuda:
        from gpu_suite import FLUX1_WIDTH

        size, device, dtype = FLUX1_WIDTH, torch.device("cuda"), torch.bfloat16
    else:
        size, device, dtype = WORKLOADS[name].size, torch.device("cpu"), torch.float32
    transformer = tiny_flux_transformer(size, guidance_embeds=True).to(device, dtype)

    def tensor(*shape, uniform=False):
        return (torch.rand if uniform else torch.randn)(*shape, device=device, dtype=dtype)

    parts = [FluxPart(tensor(rows, h * w, size.in_channels), tensor(rows, 32, size.joint_attention_dim),
                      tensor(rows, size.pooled_projection_dim), tensor(rows, uniform=True), tensor(rows, uniform=True),
                      torch.zeros(32, 3, device=device), image_ids(h, w).to(device)) for h, w in GRIDS[name]]

    def per_size():
        for p in parts:
            transformer(hidden_states=p.hidden_states, encoder_hidden_states=p.encoder_hidden_states,
                        pooled_projections=p.pooled_projections, timestep=p.timestep, guidance=p.guidance,
                        txt_ids=p.txt_ids, img_ids=p.img_ids, return_dict=False)

    sides = {"per-size": per_size,
             "packed": lambda: flux_packed_forward(transformer, parts, packed_attention="recover_scatter"),
             "packed-flex": lambda: flux_packed_forward(transformer, parts, packed_attention="flex")}
    if cuda:
        sides["packed-varlen"] = lambda: flux_packed_forward(transformer, parts, packed_attention="varlen")

    def timed(fn):
        fn()
        if cuda:
            torch.cuda.synchronize()  # NOTE: a benchmark's sync: the kernels' time, not their launches

    def measure():
        torch.set_num_threads(1)
        times = {side: [] for side in sides}
        cpu = {side: [] for side in sides}
        with torch.no_grad():
            for fn in sides.values():  # warm-up
                timed(fn)
            for repeat in range(repeats):
                for side, fn in sides.items():
                    if side == "packed-flex" and repeat >= flex_repeats:
                        continue  # NOTE: eager flex is slow on the CPU; its first repeats only
                    start, start_cpu = time.perf_counter(), thread_cpu_seconds()
                    timed(fn)
                    times[side].append(time.perf_counter() - start)
                    cpu[side].append(thread_cpu_seconds() - start_cpu)
        return ({side: statistics.median(values) for side, values in times.items()},
                {side: statistics.median(values) for side, values in cpu.items()})

    medians, cpu_medians = in_worker_thread(measure)
    varlen = {"packed_varlen_ms": 1000 * medians["packed-varlen"],
              "packed_varlen_speedup": medians["per-size"] / medians["packed-varlen"]} if cuda else {}
    return {"workload": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
            "grids": GRIDS[name], "rows_per_size": rows, **varlen, "per_size_ms": 1000 * medians["per-size"],
            "packed_ms": 1000 * medians["packed"], "packed_speedup": medians["per-size"] / medians["packed"],
            "packed_flex_ms": 1000 * medians["packed-flex"],
            "packed_flex_speedup": medians["per-size"] / medians["packed-flex"],
            # NOTE: this thread's CPU time (user + system, page faults included): on a shared machine the
            # wall clock also counts time the thread waited for a core.
            "cpu_ms": {side: 1000 * seconds for side, seconds in cpu_medians.items()},
            "packed_cpu_speedup": cpu_medians["per-size"] / cpu_medians["packed"]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--flex-repeats", type=int, default=2, help="repeats (of --repeats) that time packed-flex")
    parser.add_argument("--workloads", nargs="+", default=[w for w in GRIDS if w not in CUDA_WORKLOADS],
                        choices=list(GRIDS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packed_forward.json")
    args = parser.parse_args(argv)
    if set(args.workloads) & CUDA_WORKLOADS and not torch.cuda.is_available():
        parser.error("the flux1-width workload needs a CUDA device")
    results = [bench(name, args.rows, args.repeats, args.flex_repeats) for name in args.workloads]
    for r in results:
        varlen = (f", packed-varlen {r['packed_varlen_ms']:8.2f} ms ({r['packed_varlen_speedup']:.2f}x)"
                  if "packed_varlen_ms" in r else "")
        print(f"{r['workload']:<15} {len(r['grids'])} sizes x {r['rows_per_size']} rows: per-size "
              f"{r['per_size_ms']:8.2f} ms, packed {r['packed_ms']:8.2f} ms, packed-flex {r['packed_flex_ms']:8.2f} ms"
              f"{varlen} -> packed {r['packed_speedup']:.2f}x, packed-flex {r['packed_flex_speedup']:.2f}x per-size "
              f"(CPU time: packed {r['packed_cpu_speedup']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
