"""Demo: concurrent prompts of several sizes through StepBatched; saves an image grid and prints batch statistics.

    python examples/demo.py [--requests 8] [--steps 20] [--out outputs/demo_grid.png]

Uses the shipped toy-shapes FLUX pipeline when it is installed (`diffusers_stepbatch.toy`), otherwise a tiny
random-weight FluxPipeline built offline (its images are noise: it shows the mechanics, not the art). The
requests cycle through sizes the toy model draws (it was trained at every multiple of 16 from 48 to 128 px,
aspect 1:2 to 2:1); requests of different sizes share forwards (their tokens are packed into one call).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NOTE: before torch loads: OpenMP threads that sleep instead of spinning; on a shared CPU spinning made
# the same calls several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402

CAPTIONS = [
    "a red circle at the top left on a white background",
    "a blue square at the bottom right on a black background",
    "a yellow triangle in the center on a gray background",
    "a green cross at the top right on a black background",
    "a purple circle at the bottom left on a white background",
    "a orange square in the center on a black background",
    "a white triangle at the top left on a gray background",
    "a black cross at the bottom right on a white background",
]


DEMO_SIZES = [(64, 64), (128, 64), (48, 96), (96, 96)]  # (width, height)


def load_demo_pipeline():
    """The trained toy model if available, else a random tiny pipeline (which one, its call, its sizes)."""
    try:
        from diffusers_stepbatch.toy import DEFAULT_GUIDANCE, MAX_SEQUENCE_LENGTH, load_pipeline
        from diffusers_stepbatch.toy.build import supported_sizes

        pipe, name = load_pipeline(), "toy-shapes FLUX (trained, shipped with the package)"
        call = {"max_sequence_length": MAX_SEQUENCE_LENGTH, "guidance_scale": DEFAULT_GUIDANCE}
        sizes = supported_sizes()
        print(f"sizes it draws: {len(sizes)}, from {sizes[0][0]}x{sizes[0][1]} to {sizes[-1][0]}x{sizes[-1][1]} "
              f"(multiples of 16, aspect 1:2 to 2:1)")
    except (ImportError, OSError, FileNotFoundError):
        from diffusers_stepbatch.testing import tiny_flux_pipeline

        pipe, name = tiny_flux_pipeline(guidance_embeds=True), "tiny RANDOM-weight FluxPipeline (images are noise)"
        call = {"max_sequence_length": 64}
    return pipe, name, call


def grid(images: list[Image.Image], columns: int = 4) -> Image.Image:
    """Images of any sizes, each centred in a cell of the largest size."""
    width, height = max(image.width for image in images), max(image.height for image in images)
    rows = (len(images) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * width, rows * height), (40, 40, 40))
    for i, image in enumerate(images):
        x, y = (i % columns) * width + (width - image.width) // 2, (i // columns) * height + (height - image.height) // 2
        sheet.paste(image, (x, y))
    return sheet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo_grid.png"))
    args = parser.parse_args()

    pipe, name, call = load_demo_pipeline()
    print(f"model: {name}")
    captions = [CAPTIONS[i % len(CAPTIONS)] for i in range(args.requests)]
    sizes = [DEMO_SIZES[i % len(DEMO_SIZES)] for i in range(args.requests)]
    kwargs = [dict(prompt=c, width=w, height=h, num_inference_steps=args.steps,
                   generator=torch.Generator().manual_seed(i), **call) for i, (c, (w, h)) in enumerate(zip(captions, sizes))]

    def sequential_baseline() -> float:
        pipe(**{**kwargs[0], "generator": torch.Generator()})  # warm-up, so the baseline is fair
        started = time.perf_counter()
        sample = kwargs[:len(DEMO_SIZES)]  # one request of each size
        for kw in sample:
            pipe(**{**kw, "generator": torch.Generator().manual_seed(0)})
        return (time.perf_counter() - started) / len(sample)

    # NOTE: off the main thread, like StepBatched's engine: on a busy CPU OpenMP in the main thread can be
    # several times slower, which would flatter the comparison.
    baseline = threading.Thread(target=lambda: timings.append(sequential_baseline()))
    timings: list[float] = []
    baseline.start()
    baseline.join()
    sequential_per_image = timings[0]

    images: list[Image.Image | None] = [None] * len(kwargs)
    with StepBatched(pipe, max_batch_size=8) as sb:
        started = time.perf_counter()

        def client(i: int) -> None:
            time.sleep(0.02 * i)  # staggered arrivals: later requests join batches already in flight
            images[i] = sb(**kwargs[i]).images[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(kwargs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batched_wall = time.perf_counter() - started
        stats = sb.stats()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid(images).save(args.out)
    print(f"saved {len(images)} images ({', '.join(f'{w}x{h}' for w, h in DEMO_SIZES)}) to {args.out}")
    print(f"denoise batch sizes (rows: forwards): {stats['rows_histogram'].get('denoise')}")
    print(f"mean rows per denoise forward: {stats['mean_denoise_rows']:.2f}")
    print(f"batch rows over time, first request: {stats['requests'][0]['batch_rows']}")
    mixed = stats["mixed"]
    print(f"forwards that mixed sizes: {mixed['calls']} ({100 * mixed['fraction_of_denoise_calls']:.0f}% of denoise "
          f"forwards, {mixed['sizes_per_call']:.1f} sizes and {mixed['rows_per_call']:.1f} rows per call)")
    print(f"throughput: StepBatched {len(images) / batched_wall:.2f} images/s vs sequential "
          f"{1 / sequential_per_image:.2f} images/s ({sequential_per_image * len(images) / batched_wall:.2f}x)")


if __name__ == "__main__":
    main()
