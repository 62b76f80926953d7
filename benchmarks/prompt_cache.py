"""Prompt-embedding cache: text-encode time saved on a repeated-prompt workload, with and without the cache.

    python benchmarks/prompt_cache.py            # 10 prompts x 5 repeats, shuffled; toy model
    python benchmarks/prompt_cache.py --smoke    # a few seconds

Each request runs on two engines over the same pipeline, one with the default cache and one with
`prompt_cache=None`, alternately, so machine load hits both alike. Encode time is the sum of the engines'
"encode" calls; a request's time is its wall time. The toy model is used when its weights exist, else its
untrained architecture (same text encoders' shapes, random weights: encode cost is what matters here).
Text encoding is a few percent of a FLUX request, so end to end the gain is small.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "prompt_cache.json"
COLORS = ("red", "green", "blue", "yellow", "white")
SHAPES = ("circle", "square")


def load_model():
    try:
        from diffusers_stepbatch.toy import load_pipeline

        return load_pipeline(), "toy model (diffusers_stepbatch.toy.load_pipeline())"
    except (ImportError, FileNotFoundError) as exc:
        from diffusers_stepbatch.toy.build import build_pipeline

        pipe = build_pipeline(seed=0)
        pipe.set_progress_bar_config(disable=True)
        return pipe, f"untrained toy-architecture pipeline ({exc.__class__.__name__}: toy weights unavailable)"


def encode_seconds(sb: StepBatched, since: int) -> float:
    return sum(c.seconds for c in list(sb.engine.metrics.calls)[since:] if c.kind == "encode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see benchmarks/teacache.py)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (.smoke.json with --smoke)")
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_suffix(".smoke.json") if args.smoke else RESULTS)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.prompts, args.repeats, args.steps = 3, 2, 2
    pipe, model = load_model()
    prompts = [f"a {c} {s} in the center on a gray background" for c in COLORS for s in SHAPES][: args.prompts]
    workload = prompts * args.repeats
    random.Random(0).shuffle(workload)
    kwargs = dict(height=64, width=64, num_inference_steps=args.steps, guidance_scale=3.5, max_sequence_length=16,
                  output_type="pt")
    results = {}
    with StepBatched(pipe) as cached, StepBatched(pipe, prompt_cache=None) as uncached:
        for sb in (cached, uncached):  # warm-up on a prompt outside the workload
            sb("a black cross at the top left on a white background", **dict(kwargs, num_inference_steps=1))
        marks = {id(sb): len(sb.engine.metrics.calls) for sb in (cached, uncached)}
        walls = {"cached": [], "uncached": []}
        identical = True
        for i, prompt in enumerate(workload):
            images = {}
            for name, sb in (("cached", cached), ("uncached", uncached))[:: 1 if i % 2 == 0 else -1]:
                started = time.perf_counter()
                images[name] = sb(prompt, generator=torch.Generator().manual_seed(i), **kwargs).images
                walls[name].append(time.perf_counter() - started)
            identical = identical and torch.equal(images["cached"], images["uncached"])
        for name, sb in (("cached", cached), ("uncached", uncached)):
            results[name] = {
                "encode_s": encode_seconds(sb, marks[id(sb)]),
                "encode_calls": sum(1 for c in list(sb.engine.metrics.calls)[marks[id(sb)]:] if c.kind == "encode"),
                "request_s_mean": statistics.fmean(walls[name]),
            }
        stats = cached.stats()["prompt_cache"]
    saved = 1 - results["cached"]["encode_s"] / results["uncached"]["encode_s"]
    share = results["uncached"]["encode_s"] / sum(walls["uncached"])
    summary = {
        "model": model, "requests": len(workload), "distinct_prompts": len(prompts), "steps": args.steps,
        "torch_threads": args.threads, "smoke": args.smoke, "cache": stats, "sides": results,
        "encode_time_saved": saved, "encode_share_without_cache": share,
        "request_time_ratio": results["cached"]["request_s_mean"] / results["uncached"]["request_s_mean"],
        "outputs_identical": identical,
    }
    print(f"model: {model}")
    print(f"{len(workload)} requests over {len(prompts)} prompts, {args.steps} steps, sequential")
    for name in ("cached", "uncached"):
        r = results[name]
        print(f"  {name:>8}: encode {r['encode_s']:.3f} s in {r['encode_calls']} calls, "
              f"{1000 * r['request_s_mean']:.1f} ms per request")
    print(f"  text-encode time saved: {saved:.1%} (cache totals incl. warm-up: hits {stats['hits']}, "
          f"misses {stats['misses']}, {stats['bytes']} bytes); encoding was {share:.1%} of request time "
          "without the cache")
    print(f"  request time with/without: x{summary['request_time_ratio']:.3f}; outputs identical: {identical}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
