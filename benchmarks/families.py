"""The newer image families on tiny overhead-bound configs: sequential vs StepBatched per size vs packed.

    python benchmarks/families.py                 # every family, 8 concurrent requests, 3 interleaved rounds
    python benchmarks/families.py --families z-image,flux-kontext
    python benchmarks/families.py --smoke         # a few seconds, for CI

Per family, 8 requests over 4 sizes (square and not), different prompts and seeds, run
- sequentially (one plain pipeline call after another),
- StepBatched with `mixed_resolution=False` (forwards shared only by requests of one size),
- StepBatched packed (`mixed_resolution=True`: sizes share forwards where the model layer packs them).
The last row, `flux1-reference`, is no new family: `FluxPipeline` on Kontext's tiny components, served by FLUX.1's
dedicated step program, as a reference for what a dedicated program reaches on this config.
Every side runs its model calls off the main thread at the same intra-op thread count; rounds are interleaved.
Printed: images/s per side, StepBatched / sequential and packed / per-size. JSON: `benchmarks/results/families.json`.
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
from throughput import command_line, in_worker_thread, run_clients, write_report  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402

SIZES = [(32, 32), (32, 64), (64, 32), (48, 48)]


def _z_image():
    from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline

    # NOTE: the tests' 2-block VAE of 32/64 channels decodes at half resolution: a third of a request here
    return tiny_z_image_pipeline(vae_blocks=3), dict(guidance_scale=0.0, max_sequence_length=32)


def _flux2_klein():
    from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

    # NOTE: a VAE that quarters the sides, as the other families' tiny VAEs do: with one block (the tests' default)
    # a 48x48 image is 576 tokens, and the forwards, not the per-request overhead, decide the time
    return tiny_flux2_klein_pipeline(vae_blocks=3), dict(guidance_scale=1.0, text_encoder_out_layers=(1,),
                                                         max_sequence_length=32)


def _flux1_components() -> dict:
    from diffusers_stepbatch.testing import tiny_flux_pipeline

    # NOTE: a VAE that quarters the sides, as klein's: with two blocks a 48x48 edit is 288 image tokens
    return tiny_flux_pipeline(guidance_embeds=True, vae_blocks=3).components


_FLUX1_CALL = dict(guidance_scale=3.5, max_sequence_length=32)


def _flux_kontext():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_flux1_components()), dict(_FLUX1_CALL, _auto_resize=False, image=_reference)


def _flux1_reference():
    from diffusers import FluxPipeline

    # NOTE: Kontext's components and requests without the reference image, through FLUX.1's dedicated program (its
    # own loop, fused update, no per-request pipeline code): what a dedicated program reaches on this config
    return FluxPipeline(**_flux1_components()), dict(_FLUX1_CALL)


def _qwenimage_img2img():
    from diffusers import QwenImageImg2ImgPipeline

    from diffusers_stepbatch.testing import tiny_qwenimage_pipeline

    # NOTE: a VAE of 8 channels at full resolution (the tests' 24 made its convolutions three quarters of a request)
    pipe = QwenImageImg2ImgPipeline(**tiny_qwenimage_pipeline(vae_base_dim=8).components)
    return pipe, dict(true_cfg_scale=1.0, max_sequence_length=32, strength=1.0, image=_reference)


def _qwenimage21():
    from diffusers_stepbatch.testing.image_models import tiny_qwenimage21_pipeline

    # NOTE: its sizes are multiples of 32 (a VAE of scale 16 and 2x2 patches): twice the other families' sides
    return tiny_qwenimage21_pipeline(), dict(output_resolution=64, _scale=2)


FAMILIES = {"z-image": _z_image, "flux2-klein": _flux2_klein, "flux-kontext": _flux_kontext,
            "qwenimage-img2img": _qwenimage_img2img, "qwenimage21": _qwenimage21, "flux1-reference": _flux1_reference}


def _reference(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _requests(extra: dict, n: int, steps: int) -> list[dict]:
    requests = []
    scale = extra.get("_scale", 1)
    for i in range(n):
        height, width = (side * scale for side in SIZES[i % len(SIZES)])
        kwargs = {name: value for name, value in extra.items() if name not in ("image", "_scale")}
        if "image" in extra:
            kwargs["image"] = extra["image"](height, width, i)
            if "max_area" not in kwargs and "_auto_resize" in kwargs:
                kwargs["max_area"] = height * width
        kwargs.update(prompt=f"a red circle {i}", height=height, width=width, num_inference_steps=steps,
                      output_type="pt", generator=torch.Generator().manual_seed(i))
        requests.append(kwargs)
    return requests


def _sequential(pipe, requests: list[dict]) -> float:
    import time

    start = time.perf_counter()
    for kwargs in requests:
        pipe(**kwargs).images.cpu()
    return len(requests) / (time.perf_counter() - start)


def _concurrent(sb: StepBatched, requests: list[dict]) -> tuple[float, dict]:
    import time

    sb.engine.wait_idle()
    sb.reset_stats()
    start = run_clients(len(requests), lambda i, _: sb(**requests[i]).images.cpu())
    wall = time.perf_counter() - start
    sb.engine.wait_idle()
    stats = sb.stats()
    return len(requests) / wall, {"mean_denoise_rows": stats["mean_denoise_rows"], "mixed": stats["mixed"]}


def bench_family(name: str, n: int, steps: int, rounds: int) -> dict:
    pipe, extra = FAMILIES[name]()
    pipe.set_progress_bar_config(disable=True)
    engines = {"per_size": StepBatched(pipe, max_batch_size=n, mixed_resolution=False),
               "packed": StepBatched(pipe, max_batch_size=n, mixed_resolution=True)}
    in_worker_thread(lambda: [pipe(**kwargs) for kwargs in _requests(extra, len(SIZES), steps)])  # warm-up
    for sb in engines.values():
        for _ in range(2):
            _concurrent(sb, _requests(extra, n, steps))
    runs: dict[str, list[float]] = {"sequential": [], "per_size": [], "packed": []}
    details = {}
    for _ in range(rounds):
        runs["sequential"].append(in_worker_thread(_sequential, pipe, _requests(extra, n, steps)))
        for label, sb in engines.items():
            rate, details[label] = _concurrent(sb, _requests(extra, n, steps))
            runs[label].append(rate)
    for sb in engines.values():
        sb.close()
    medians = {label: statistics.median(values) for label, values in runs.items()}
    return {"images_per_s": medians, "rounds": runs, "last_round": details,
            "packed_vs_sequential": medians["packed"] / medians["sequential"],
            "per_size_vs_sequential": medians["per_size"] / medians["sequential"],
            "packed_vs_per_size": medians["packed"] / medians["per_size"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is fastest for tiny models)")
    parser.add_argument("--smoke", action="store_true", help="4 requests, 2 steps, 1 round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/families.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.steps, args.rounds = 4, 2, 1
    torch.set_num_threads(args.threads)
    report = {"command": command_line("benchmarks/families.py", argv), "requests": args.requests,
              "steps": args.steps, "threads": args.threads, "sizes": SIZES, "families": {}}
    print(f"{args.requests} requests over {len(SIZES)} sizes, {args.steps} steps: images/s")
    for name in args.families.split(","):
        result = bench_family(name, args.requests, args.steps, args.rounds)
        report["families"][name] = result
        rates = result["images_per_s"]
        print(f"  {name:18s} sequential {rates['sequential']:7.2f}  per-size {rates['per_size']:7.2f} "
              f"({result['per_size_vs_sequential']:.2f}x)  packed {rates['packed']:7.2f} "
              f"({result['packed_vs_sequential']:.2f}x; {result['packed_vs_per_size']:.2f}x per-size)  "
              f"mixed calls {result['last_round']['packed']['mixed']['calls']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
