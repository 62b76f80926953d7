"""optimum-quanto on CPU: transformer forward time and weight bytes, fp32 vs qint8 / qfloat8, side by side.

    python benchmarks/quanto.py            # hidden 256, 6 blocks, 1024 tokens; batch 1 and 4
    python benchmarks/quanto.py --smoke    # a few seconds

Quantized weights exist for memory; on this CPU the matmuls dequantize on the fly, so a forward is slower
than fp32. Every variant is a copy of the same random-weight transformer, timed interleaved (median).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from diffusers_stepbatch.quantize import quantize_transformer
from diffusers_stepbatch.testing import FluxSize, tiny_flux_transformer

RESULTS = Path(__file__).parent / "results" / "quanto.json"
SIZE = FluxSize(num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=4,
                joint_attention_dim=64, pooled_projection_dim=64, in_channels=64)


class _Holder:  # quantize_transformer takes a pipeline; this is the smallest thing with a transformer
    def __init__(self, transformer):
        self.transformer = transformer


def weight_bytes(module: torch.nn.Module) -> int:
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        inner = getattr(tensor, "_data", None)  # quanto QTensor: int8/fp8 data plus scales
        if inner is not None:
            total += inner.numel() * inner.element_size() + tensor._scale.numel() * tensor._scale.element_size()
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def inputs(rows: int, tokens: int, text: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(rows, tokens, SIZE.in_channels, generator=g),
        encoder_hidden_states=torch.randn(rows, text, SIZE.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, SIZE.pooled_projection_dim, generator=g),
        timestep=torch.full([rows], 0.5), guidance=torch.full([rows], 3.5),
        img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3), return_dict=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see benchmarks/teacache.py)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (.smoke.json with --smoke)")
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_suffix(".smoke.json") if args.smoke else RESULTS)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.tokens, args.rows, args.repeats = 64, [1], 2
    base = tiny_flux_transformer(SIZE, guidance_embeds=True)
    variants = {"fp32": base}
    for weights in ("qint8", "qfloat8"):
        variants[weights] = quantize_transformer(_Holder(copy.deepcopy(base)), weights=weights).transformer
    results = {"tokens": args.tokens, "torch_threads": args.threads, "smoke": args.smoke, "rows": {},
               "weight_bytes": {name: weight_bytes(m) for name, m in variants.items()}}
    with torch.no_grad():
        for rows in args.rows:
            batch = inputs(rows, args.tokens)
            times = {name: [] for name in variants}
            for name, model in variants.items():
                model(**batch)  # warm-up
            for _ in range(args.repeats):
                for name, model in variants.items():  # NOTE: interleaved against machine-load drift
                    started = time.perf_counter()
                    model(**batch)
                    times[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(t) for name, t in times.items()}
            results["rows"][rows] = {"seconds": medians,
                                     "slowdown_vs_fp32": {n: medians[n] / medians["fp32"] for n in medians}}
            print(f"batch {rows}, {args.tokens} tokens: " + ", ".join(
                f"{n} {1000 * s:.1f} ms (x{s / medians['fp32']:.2f})" for n, s in medians.items()))
    print("weights: " + ", ".join(f"{n} {b / 2**20:.2f} MiB" for n, b in results["weight_bytes"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
