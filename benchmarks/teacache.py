"""TeaCache: denoise-loop speedup against PSNR and SSIM versus the exact (no-cache) output, per threshold.

    python benchmarks/teacache.py            # toy model, 28 steps, thresholds 0.1 ... 0.8
    python benchmarks/teacache.py --smoke    # a few seconds: one prompt, two thresholds, 12 steps

Uses the shipped toy FLUX model (`diffusers_stepbatch.toy.load_pipeline()`) when its weights exist; otherwise
an untrained toy-architecture pipeline with random weights, and says so in the output: random weights give
noise images, so their PSNR/SSIM only show how far TeaCache moves the output, not what a viewer would see.
Every configuration runs in the same process, interleaved repeat by repeat. "speedup" compares the engine
thread's CPU seconds inside the transformer's forwards (x_embedder to proj_out, TeaCache's decision
included): on this shared, loaded machine wall times swing by 2x between runs, CPU time much less. "(wall)"
is the same ratio for the wall time of the denoise calls as the engine measured them, host work included.
Published reference (TeaCache4FLUX, FLUX.1-dev, 28 steps): threshold 0.4 -> 1.8x at about 30 dB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.cache import TeaCacheConfig  # noqa: E402
from diffusers_stepbatch.cache.teacache_fit import fit_coefficients  # noqa: E402
from diffusers_stepbatch.models.flux.teacache import FLUX_COEFFICIENTS  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "teacache.json"
CALIBRATION_PROMPTS = [  # for fit_coefficients; never among the evaluated prompts
    "a purple circle at the bottom left on a white background",
    "an orange square at the top left on a gray background",
    "a white cross in the center on a black background",
]
PROMPTS = [
    "a red circle at the top left on a white background",
    "a blue square in the center on a gray background",
    "a yellow triangle at the bottom right on a black background",
    "a green cross at the top right on a white background",
]


def load_model(smoke: bool):
    """(pipe, description): the trained toy model, or an untrained stand-in with a note saying so."""
    if not smoke:
        try:
            from diffusers_stepbatch.toy import load_pipeline

            return load_pipeline(), "toy model (trained, diffusers_stepbatch.toy.load_pipeline())"
        except (ImportError, FileNotFoundError) as exc:
            reason = f"toy weights unavailable ({exc.__class__.__name__}: {exc})"
    else:
        reason = "--smoke"
    from diffusers_stepbatch.toy.build import build_pipeline

    pipe = build_pipeline(seed=0)
    pipe.default_sample_size = 64 // pipe.vae_scale_factor
    pipe.set_progress_bar_config(disable=True)
    return pipe, f"UNTRAINED toy-architecture pipeline with random weights ({reason}); images are noise"


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5) of [C, H, W] images in [0, 1]."""
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = g / g.sum()
    channels = a.shape[0]
    window = (g[:, None] * g[None, :]).expand(channels, 1, 11, 11)
    a, b = a[None].double(), b[None].double()

    def blur(x):
        return F.conv2d(x, window, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(ssim_map.mean())


class ForwardMeter:
    """Rows through the transformer, rows that entered its blocks, and the engine thread's CPU seconds spent
    in forwards (x_embedder to proj_out: the same span with and without TeaCache)."""

    def __init__(self, transformer):
        self.rows = self.entered = 0
        self.cpu_seconds = 0.0
        self._started = 0.0
        self._hooks = [
            transformer.x_embedder.register_forward_pre_hook(self._start),
            transformer.transformer_blocks[0].register_forward_pre_hook(self._enter, with_kwargs=True),
            transformer.proj_out.register_forward_hook(self._stop),
        ]

    def _start(self, module, args):
        self.rows += args[0].shape[0]
        self._started = time.thread_time()

    def _enter(self, module, args, kwargs):
        self.entered += kwargs["hidden_states"].shape[0]

    def _stop(self, module, args, output):
        self.cpu_seconds += time.thread_time() - self._started

    def remove(self):
        for hook in self._hooks:
            hook.remove()


def run(sb: StepBatched, prompts: list[str], steps: int, config: tuple | None) -> tuple[list, dict]:
    """Images and measurements (CPU and wall seconds of the denoise loop, block passes) of one configuration.

    `config` is None (no cache) or (coefficients name, threshold, coefficients).
    """
    teacache = None if config is None else TeaCacheConfig(threshold=config[1], coefficients=config[2])
    metrics = sb.engine.metrics
    before = len(metrics.calls)
    meter = ForwardMeter(sb.pipe.transformer)
    images = []
    try:
        for i, prompt in enumerate(prompts):
            out = sb(prompt, num_inference_steps=steps, guidance_scale=3.5, height=64, width=64,
                     max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(i),
                     teacache=teacache)
            images.append(out.images[0])
    finally:
        meter.remove()
    wall = sum(c.seconds for c in list(metrics.calls)[before:] if c.kind == "denoise")
    return images, {"cpu": meter.cpu_seconds, "wall": wall, "entered": meter.entered,
                    "skipped": meter.rows - meter.entered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: on a shared 2-core machine under load, OpenMP with 2 "
                             "threads ran these small models 10-25x slower and far noisier")
    parser.add_argument("--coefficients", choices=["flux", "fitted", "both"], default="both",
                        help="FLUX.1-dev's published polynomial, one fitted to this model (fit_coefficients), or both")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (.smoke.json with --smoke)")
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_suffix(".smoke.json") if args.smoke else RESULTS)
    torch.set_num_threads(args.threads)
    prompts = PROMPTS
    if args.smoke:
        args.steps, args.thresholds, args.repeats, prompts = 12, [0.2, 0.6], 1, PROMPTS[:1]
    pipe, model = load_model(args.smoke)
    print(f"model: {model}", flush=True)
    call = dict(num_inference_steps=args.steps, guidance_scale=3.5, height=64, width=64, max_sequence_length=16,
                output_type="latent")
    polynomials = {}
    if args.coefficients in ("flux", "both"):
        polynomials["flux"] = FLUX_COEFFICIENTS
    if args.coefficients in ("fitted", "both"):
        polynomials["fitted"] = fit_coefficients(pipe, CALIBRATION_PROMPTS[: 1 if args.smoke else 3], **call)
        print(f"fitted coefficients (highest power first): {[f'{c:.4g}' for c in polynomials['fitted']]}")
    configs = [None] + [(name, t, c) for name, c in polynomials.items() for t in args.thresholds]
    measured: dict = {c: [] for c in configs}
    outputs: dict = {}
    with StepBatched(pipe) as sb:
        run(sb, prompts[:1], 2, None)  # warm-up
        for _ in range(args.repeats):
            for config in configs:  # NOTE: interleaved, so that machine load hits every configuration alike
                outputs[config], measure = run(sb, prompts, args.steps, config)
                measured[config].append(measure)
    reference = outputs[None]

    def median(config, key):
        return statistics.median(m[key] for m in measured[config])

    base_cpu, base_wall = median(None, "cpu"), median(None, "wall")
    rows = []
    for config in configs[1:]:
        images, last = outputs[config], measured[config][-1]
        entered, skipped = last["entered"], last["skipped"]
        rows.append({
            "coefficients": config[0],
            "threshold": config[1],
            "speedup": base_cpu / median(config, "cpu"),
            "speedup_wall": base_wall / median(config, "wall"),
            "skipped_fraction": skipped / (entered + skipped),
            "ideal_speedup": (entered + skipped) / entered,
            "psnr_db": statistics.fmean(psnr(a, b) for a, b in zip(images, reference)),
            "ssim": statistics.fmean(ssim(a, b) for a, b in zip(images, reference)),
        })
    print(f"{args.steps} steps, {len(prompts)} prompts, median of {args.repeats}; no-cache forwards "
          f"{base_cpu:.3f} CPU s, loop {base_wall:.3f} wall s")
    header = ("coefficients", "threshold", "speedup", "(wall)", "ideal", "skipped", "PSNR dB", "SSIM")
    print("{:>12} {:>9} {:>8} {:>7} {:>6} {:>8} {:>8} {:>6}".format(*header))
    for row in rows:
        print(f"{row['coefficients']:>12} {row['threshold']:>9.2f} {row['speedup']:>7.2f}x "
              f"{row['speedup_wall']:>6.2f}x {row['ideal_speedup']:>5.2f}x {row['skipped_fraction']:>7.0%} "
              f"{row['psnr_db']:>8.2f} {row['ssim']:>6.3f}")
    result = {"model": model, "steps": args.steps, "prompts": prompts, "repeats": args.repeats,
              "no_cache_forward_cpu_s": base_cpu, "no_cache_loop_wall_s": base_wall,
              "torch_threads": torch.get_num_threads(),
              "coefficients": {name: list(c) for name, c in polynomials.items()}, "rows": rows,
              "smoke": args.smoke}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
