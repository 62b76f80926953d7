"""A request's prologue in its caller's thread: how long `submit` takes, and its module scans side by side.

    python benchmarks/prologue.py            # tiny Flux pipeline, 200 submits
    python benchmarks/prologue.py --smoke    # a few seconds, for CI

With N concurrent callers the prologues run one after another under the GIL while the engine waits for their
rows, so their cost adds up per burst. Measured in a worker thread at one intra-op thread:
- `submit` on an idle engine (each request finishes before the next is submitted; only the caller's share);
- diffusers' `pipe._execution_device` vs `module_scan.execution_device(pipe)` (remembered while nothing moved);
- `named_modules()` + `getattr` vs `module_scan.walk` + `own_attribute` over every component (the hook scans);
- the prologue of a request on a FLUX.1-sized pipeline (transformer, CLIP-L, T5-XXL and VAE built on the meta
  device: the real module trees, no weights): its scans over the marked modules of one walk per model (as
  shipped) vs each scan walking every module on its own (as before `module_scan.marked_modules`), interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from throughput import WORKLOADS, command_line, in_worker_thread, request_kwargs, write_report  # noqa: E402

import diffusers_stepbatch.module_scan as module_scan  # noqa: E402
from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.engine.request import start_in_caller  # noqa: E402
from diffusers_stepbatch.module_scan import execution_device, own_attribute, scan_scope, walk  # noqa: E402
from diffusers_stepbatch.testing import tiny_flux_pipeline  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def bench(repeats: int) -> dict:
    workload = WORKLOADS["overhead-bound"]
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=workload.size, vae_blocks=4)
    models = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    sb = StepBatched(pipe)

    def submit_ms() -> dict:
        # NOTE: the caller's CPU time too: once queued, the woken engine thread may hold the GIL before `submit`
        # returns, which the wall time counts and the thread's CPU time does not.
        wall, cpu = [], []
        for i in range(repeats):
            kwargs = request_kwargs(i % 4, workload, 2)  # NOTE: 4 prompts: prompt-cache hits after the first round
            started, started_cpu = time.perf_counter(), time.thread_time()
            handle = sb.submit(**kwargs)
            wall.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
            handle.result()
        return {"wall": 1000 * statistics.median(wall), "caller_cpu": 1000 * statistics.median(cpu)}

    def torch_scan():
        return [getattr(m, "_diffusers_hook", None) for model in models for _, m in model.named_modules()]

    def own_scan():
        return [own_attribute(m, "_diffusers_hook") for model in models for _, m in walk(model)]

    def measure() -> dict:
        torch.set_num_threads(1)
        with torch.no_grad():
            submit_ms()  # warm-up
            return {
                "submit_ms": submit_ms(),
                "execution_device_ms": {"diffusers": median_ms(lambda: pipe._execution_device, repeats),
                                        "module_scan": median_ms(lambda: execution_device(pipe), repeats)},
                "hook_scan_ms": {"named_modules": median_ms(torch_scan, repeats),
                                 "module_scan": median_ms(own_scan, repeats)},
                "modules": sum(1 for model in models for _ in model.modules()),
            }

    result = in_worker_thread(measure)
    sb.close()
    return result


def flux1_sized_pipeline():
    """The tiny Flux pipeline with FLUX.1-dev-sized models on the meta device (module trees without weights)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    pipe = tiny_flux_pipeline(guidance_embeds=True, vae_blocks=4)
    with torch.device("meta"):
        models = dict(
            transformer=FluxTransformer2DModel(guidance_embeds=True),  # diffusers' defaults: FLUX.1's widths
            text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=len(pipe.tokenizer), hidden_size=768,
                                                      intermediate_size=3072, num_hidden_layers=12,
                                                      num_attention_heads=12, projection_dim=768)).eval(),
            text_encoder_2=T5EncoderModel(T5Config(vocab_size=len(pipe.tokenizer_2), d_model=4096, d_kv=64,
                                                   d_ff=10240, num_layers=24, num_heads=64,
                                                   feed_forward_proj="gated-gelu")).eval(),
            vae=AutoencoderKL(latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                              up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                              layers_per_block=2),
        )
    pipe.register_modules(**models)
    return pipe


def bench_flux1_sized(repeats: int) -> dict:
    """Plan + prologue up to the first work item (nothing queued): marked modules of one walk per model vs each
    scan walking every module, interleaved."""
    pipe = flux1_sized_pipeline()
    sb = StepBatched(pipe)
    census = module_scan._census

    def every_module(model):  # a census that marks every module: each scan reads them all, as before
        walked = tuple(walk(model))
        return module_scan.Census(walked, tuple(module for _, module in walked))

    def prologue_seconds(i: int, walk_all: bool) -> float:
        module_scan._census = every_module if walk_all else census
        kwargs = request_kwargs(i, WORKLOADS["overhead-bound"], 2)
        started = time.perf_counter()
        # NOTE: as `submit` does; walking every module without a scope is each scan walking on its own, as before
        with contextlib.nullcontext() if walk_all else scan_scope():
            request = sb._make_request((), kwargs, 0, None)
            start_in_caller(request)
        seconds = time.perf_counter() - started
        request.program.close()
        return seconds

    def measure() -> dict:
        torch.set_num_threads(1)
        times = {False: [], True: []}
        try:
            for i in range(repeats + 5):
                for walk_all in ((False, True) if i % 2 else (True, False)):
                    seconds = prologue_seconds(i, walk_all)
                    if i >= 5:  # NOTE: the first few are warm-up (first touches, memo entries)
                        times[walk_all].append(seconds)
        finally:
            module_scan._census = census
        return {"marked_modules": 1000 * statistics.median(times[False]),
                "every_module": 1000 * statistics.median(times[True])}

    result = in_worker_thread(measure)
    sb.close()
    result["modules"] = {name: sum(1 for _ in model.modules()) for name, model in pipe.components.items()
                         if isinstance(model, torch.nn.Module)}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="20 repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prologue.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats = 20
    result = bench(args.repeats)
    result["flux1_sized_prologue_ms"] = bench_flux1_sized(args.repeats)
    device, scan = result["execution_device_ms"], result["hook_scan_ms"]
    print(f"tiny Flux pipeline, {result['modules']} modules; medians of {args.repeats}")
    submit = result["submit_ms"]
    print(f"submit on an idle engine (the caller's prologue): {submit['wall']:.3f} ms wall, "
          f"{submit['caller_cpu']:.3f} ms of the caller's CPU time")
    print(f"execution device: diffusers {device['diffusers']:.3f} ms, module_scan {device['module_scan']:.3f} ms "
          f"({device['diffusers'] / device['module_scan']:.1f}x)")
    print(f"hook scan: named_modules {scan['named_modules']:.3f} ms, module_scan {scan['module_scan']:.3f} ms "
          f"({scan['named_modules'] / scan['module_scan']:.1f}x)")
    sized = result["flux1_sized_prologue_ms"]
    print(f"prologue on a FLUX.1-sized pipeline ({sum(sized['modules'].values())} modules, meta device): scans over "
          f"the marked modules {sized['marked_modules']:.3f} ms, over every module {sized['every_module']:.3f} ms "
          f"({sized['every_module'] / sized['marked_modules']:.1f}x)")
    report = {"command": command_line("benchmarks/prologue.py", argv), "repeats": args.repeats, **result}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
