"""The generic program against a dedicated one on the same model, side by side in one run.

    python benchmarks/generic.py              # 8 concurrent requests, 3 interleaved rounds per pair
    python benchmarks/generic.py --smoke      # a few seconds, for CI

Each pair runs the same tiny components through a pipeline with a dedicated step program and through one that
only the generic program serves:
- flux: `FluxPipeline` (dedicated) vs a `FluxPipeline` subclass with its own `__call__` (the same call, served
  by the generic program: the same work on both sides), at 256 px;
- flux-small: the same pair at 32 px with a 2-block VAE, where per-call host work dominates;
- flux-img2img: `FluxPipeline` vs `FluxImg2ImgPipeline` at strength 1.0 (the same denoising loop, plus a VAE
  encode of the input image per request);
- unet: `StableDiffusionPipeline` vs a subclass with its own `__call__` (generic).
Per side: sequential plain calls and StepBatched with N concurrent requests (closed loop), in worker threads,
rounds interleaved. Printed: images/s, StepBatched / sequential, and generic / dedicated StepBatched; for the
flux pairs also the batched ceiling (`throughput.measure_ceiling`: encode + steps x forward + decode at each
stage's best rows per call), which bounds any batching's gain over sequential on this config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import WORKLOADS, Workload, command_line, in_worker_thread, measure_ceiling, run_sequential  # noqa: E402
from throughput import run_stepbatched, write_report  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.programs import generic, program_for  # noqa: E402
from diffusers_stepbatch.testing import FluxSize  # noqa: E402


def _generic_only(pipeline_class):
    """A subclass with a `__call__` of its own: no dedicated program serves it, the generic program does."""

    def __call__(self, *args, **kwargs):
        return pipeline_class.__call__(self, *args, **kwargs)

    return type(f"Generic{pipeline_class.__name__}", (pipeline_class,), {"__call__": __call__})


def _tiny_flux():
    from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline

    return tiny_flux_pipeline(guidance_embeds=True, size=FluxSize(), vae_blocks=4)


def _flux_pair():
    dedicated = _tiny_flux()
    generic_pipe = _generic_only(type(dedicated))(**dedicated.components)
    return dedicated, generic_pipe, 256, dict(max_sequence_length=32, guidance_scale=3.5), False


def _flux_small_pair():
    from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline

    dedicated = tiny_flux_pipeline(guidance_embeds=True, size=FluxSize(), vae_blocks=2)
    generic_pipe = _generic_only(type(dedicated))(**dedicated.components)
    return dedicated, generic_pipe, SMALL_SIDE, dict(max_sequence_length=32, guidance_scale=3.5), False


def _flux_img2img_pair():
    from diffusers import FluxImg2ImgPipeline

    dedicated = _tiny_flux()
    return (dedicated, FluxImg2ImgPipeline(**dedicated.components), 256,
            dict(max_sequence_length=32, guidance_scale=3.5), True)


def _unet_pair():
    from diffusers_stepbatch.testing import tiny_sd_pipeline

    dedicated = tiny_sd_pipeline()
    generic_pipe = _generic_only(type(dedicated))(**dedicated.components)
    return dedicated, generic_pipe, 64, dict(guidance_scale=3.0), False


SMALL_SIDE = 32  # 64 image tokens and a 2-block VAE: per-call host work dominates every stage
PAIRS = {"flux": _flux_pair, "flux-small": _flux_small_pair, "flux-img2img": _flux_img2img_pair, "unet": _unet_pair}
CEILINGS = {"flux": WORKLOADS["overhead-bound"], "flux-small": Workload("flux-small", FluxSize(), SMALL_SIDE)}


def _kwargs(side: int, extra: dict, steps: int, image: torch.Tensor | None):
    def make(i: int) -> dict:
        kwargs = dict(prompt=f"a red circle {i}", num_inference_steps=steps, output_type="pt", height=side,
                      width=side, generator=torch.Generator().manual_seed(i), **extra)
        if image is not None:
            kwargs.update(image=image, strength=1.0)
        return kwargs

    return make


def bench_pair(name: str, n: int, steps: int, rounds: int) -> dict:
    dedicated, generic_pipe, side, extra, takes_image = PAIRS[name]()
    for pipe in (dedicated, generic_pipe):
        pipe.set_progress_bar_config(disable=True)
    if program_for(generic_pipe) is not generic.plan_generic or program_for(dedicated) is generic.plan_generic:
        raise RuntimeError(f"{name}: the pair must be one dedicated and one generic pipeline")
    image = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(0))
    sides = {"dedicated": (dedicated, _kwargs(side, extra, steps, None)),
             "generic": (generic_pipe, _kwargs(side, extra, steps, image if takes_image else None))}
    engines = {label: StepBatched(pipe, max_batch_size=n) for label, (pipe, _) in sides.items()}
    closed = [0.0] * n
    for label, (pipe, make) in sides.items():  # warm-up: first calls, and the engines' cost models
        in_worker_thread(lambda: pipe(**make(0)))
        for _ in range(2):
            run_stepbatched(engines[label], make, n, closed)
    results: dict[str, dict[str, list]] = {label: {"sequential": [], "stepbatched": [], "rows": []} for label in sides}
    for _ in range(rounds):
        for label, (pipe, make) in sides.items():
            sequential = in_worker_thread(run_sequential, pipe, make, n, closed)
            batched = run_stepbatched(engines[label], make, n, closed)
            results[label]["sequential"].append(sequential["throughput_images_per_s"])
            results[label]["stepbatched"].append(batched["throughput_images_per_s"])
            results[label]["rows"].append(batched["rows_per_call_by_kind"])
    for sb in engines.values():
        sb.close()
    summary = {}
    for label, runs in results.items():
        sequential, batched = statistics.median(runs["sequential"]), statistics.median(runs["stepbatched"])
        summary[label] = {"sequential_images_per_s": sequential, "stepbatched_images_per_s": batched,
                          "speedup_vs_sequential": batched / sequential, "rows_per_call_last_round": runs["rows"][-1],
                          "rounds": runs}
    summary["generic_vs_dedicated"] = (summary["generic"]["stepbatched_images_per_s"]
                                       / summary["dedicated"]["stepbatched_images_per_s"])
    if name in CEILINGS:
        ceiling = in_worker_thread(measure_ceiling, dedicated, CEILINGS[name], n, steps, 5)
        summary["ceiling_images_per_s"] = ceiling["throughput_images_per_s"]
        summary["ceiling_vs_sequential"] = ceiling["throughput_images_per_s"] / summary["dedicated"][
            "sequential_images_per_s"]
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is fastest for tiny models)")
    parser.add_argument("--smoke", action="store_true", help="2 requests, 2 steps, 1 round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generic.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.steps, args.rounds = 2, 2, 1
    torch.set_num_threads(args.threads)
    report = {"command": command_line("benchmarks/generic.py", argv), "requests": args.requests,
              "steps": args.steps, "threads": args.threads, "pairs": {}}
    for name in args.pairs.split(","):
        result = bench_pair(name, args.requests, args.steps, args.rounds)
        report["pairs"][name] = result
        print(f"{name}: images/s  sequential / StepBatched (x sequential)")
        for label in ("dedicated", "generic"):
            side = result[label]
            print(f"  {label:9s} {side['sequential_images_per_s']:7.2f} / {side['stepbatched_images_per_s']:7.2f} "
                  f"({side['speedup_vs_sequential']:.2f}x)  rows per call: {side['rows_per_call_last_round']}")
        print(f"  generic / dedicated StepBatched: {result['generic_vs_dedicated']:.2f}")
        if "ceiling_images_per_s" in result:
            print(f"  batched ceiling {result['ceiling_images_per_s']:.2f} images/s "
                  f"({result['ceiling_vs_sequential']:.2f}x sequential)")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
