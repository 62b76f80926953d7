"""The throughput comparison on a CUDA machine, at real FLUX.1 width (fewer blocks), 512 and 1024 pixels.

    bash benchmarks/gpu_suite.sh          # needs torch with CUDA and this package; no Hub access

Builds a random-weight Flux transformer of FLUX.1's width (hidden 3072 = 24 heads x 128, joint attention
4096, pooled 768, 64 input channels) with 2 double + 4 single blocks instead of 19 + 38 so that the whole
suite fits in a few minutes, tiny random text encoders and VAE, in bf16, and runs benchmarks/throughput.py's
sequential-vs-StepBatched comparison at 512x512 (1024 tokens) and 1024x1024 (4096 tokens). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from throughput import Workload, bench_workload  # noqa: E402

from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline  # noqa: E402

FLUX1_WIDTH = FluxSize(num_layers=2, num_single_layers=4, attention_head_dim=128, num_attention_heads=24,
                       joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measured rounds (medians)")
    parser.add_argument("--warmup-rounds", type=int, default=3, help="unmeasured StepBatched rounds first")
    parser.add_argument("--compile", action="store_true",
                        help="pipe.transformer.compile(dynamic=True) for every side (inductor; minutes of compiling)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_suite.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_suite needs a CUDA device")
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=FLUX1_WIDTH, vae_blocks=4).to("cuda", torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for side in args.sizes:
        workload = Workload(f"flux1-width-{side}px", FLUX1_WIDTH, side)
        results["results"].append(bench_workload(workload, args.concurrency, args.steps, repeats=5, seed=0, pipe=pipe,
                                                 rounds=args.rounds, warmup_rounds=args.warmup_rounds,
                                                 compile_transformer=args.compile))
        print(json.dumps(results["results"][-1]["ratios"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
