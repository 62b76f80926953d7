"""A pixel judge for toy scenes: which colour is the object, and where is it?

The background is the median colour of the image border; foreground pixels are those that differ from it
by more than `threshold` in some channel. Each foreground pixel votes for its nearest palette colour; the
centroid of the foreground picks the nearest of the five caption positions.

>>> from diffusers_stepbatch.toy.scenes import Scene, render_scene
>>> verdict = judge_image(render_scene(Scene("red", "circle", "at the top left", "white"), 64))
>>> verdict.color, verdict.position
('red', 'at the top left')
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

from diffusers_stepbatch.toy.scenes import COLORS, POSITIONS

_PALETTE_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[n] for n in _PALETTE_NAMES], dtype=np.float32)
_ANCHORS = np.array([POSITIONS[p] for p in POSITIONS], dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the judge sees: `color`/`position` are None when no foreground was found."""

    color: str | None
    position: str | None
    foreground_fraction: float
    centroid: tuple[float, float] | None  # (x, y) as fractions of the side


def judge_image(image: Image.Image | np.ndarray, threshold: float = 48.0) -> Verdict:
    """Judge one RGB image (PIL or uint8/float array in 0..255, shape HxWx3)."""
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 RGB image, got shape {pixels.shape}")
    height, width, _ = pixels.shape
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    mask = np.abs(pixels - background).max(axis=-1) > threshold
    count = int(mask.sum())
    if count == 0:
        return Verdict(None, None, 0.0, None)
    foreground = pixels[mask]
    nearest = np.argmin(((foreground[:, None, :] - _PALETTE[None]) ** 2).sum(-1), axis=1)
    color = _PALETTE_NAMES[int(np.bincount(nearest, minlength=len(_PALETTE)).argmax())]
    ys, xs = np.nonzero(mask)
    centroid = np.array([(xs.mean() + 0.5) / width, (ys.mean() + 0.5) / height], dtype=np.float32)
    position = list(POSITIONS)[int(np.argmin(((_ANCHORS - centroid) ** 2).sum(-1)))]
    return Verdict(color, position, count / (height * width), (float(centroid[0]), float(centroid[1])))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two uint8-range images."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@dataclasses.dataclass(frozen=True)
class Scores:
    """Fractions of images whose judged colour / position match the caption, and mean PSNR (VAE only)."""

    color: float
    position: float
    psnr: float | None = None
    count: int = 0


def score_images(images: list[Image.Image], captions: list[str]) -> Scores:
    """Judge `images` against the scenes their `captions` describe."""
    from diffusers_stepbatch.toy.scenes import parse_caption

    if len(images) != len(captions):
        raise ValueError(f"got {len(images)} images for {len(captions)} captions")
    verdicts = [judge_image(image) for image in images]
    scenes = [parse_caption(text) for text in captions]
    color = np.mean([v.color == s.color for v, s in zip(verdicts, scenes)])
    position = np.mean([v.position == s.position for v, s in zip(verdicts, scenes)])
    return Scores(float(color), float(position), None, len(images))


def images_to_tensor(images) -> torch.Tensor:
    """PIL images -> float tensor in [-1, 1], (B, 3, H, W)."""
    import torch

    array = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0


def tensor_to_uint8(x: torch.Tensor) -> np.ndarray:
    # NOTE: the same rounding as diffusers' VaeImageProcessor.postprocess + numpy_to_pil.
    return ((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)


def evaluate_vae(vae, count: int = 256, seed: int = 1234) -> Scores:
    """Round-trip held-out renders through `vae` (posterior mode): mean PSNR and judge agreement."""
    import torch

    from diffusers_stepbatch.toy.scenes import NATIVE_SIZE, heldout_captions, render_scene, sample_scene

    rng = np.random.default_rng(seed)
    captions = heldout_captions()
    texts = [captions[i % len(captions)] for i in range(count)]
    originals = [render_scene(sample_scene(rng, text), NATIVE_SIZE) for text in texts]
    decoded = []
    for i in range(0, count, 64):
        x = images_to_tensor(originals[i : i + 64])
        with torch.no_grad():
            decoded.append(tensor_to_uint8(vae.decode(vae.encode(x).latent_dist.mode()).sample))
    decoded = np.concatenate(decoded)
    values = [psnr(np.asarray(o), d) for o, d in zip(originals, decoded)]
    judged = score_images([Image.fromarray(d) for d in decoded], texts)
    return Scores(judged.color, judged.position, float(np.mean(values)), count)


def evaluate_pipeline(
    pipe, guidance_scale: float = 3.5, steps: int = 20, seed: int = 0, size: int | tuple[int, int] | None = None
) -> Scores:
    """Generate one image per held-out caption in one batch and judge them; `size` is a side or (width, height)."""
    import torch

    from diffusers_stepbatch.toy.scenes import NATIVE_SIZE, heldout_captions, image_size

    width, height = image_size(NATIVE_SIZE if size is None else size)
    captions = heldout_captions()
    images = pipe(
        captions, height=height, width=width, num_inference_steps=steps,
        guidance_scale=guidance_scale, max_sequence_length=pipe.tokenizer_2.model_max_length,
        generator=torch.Generator().manual_seed(seed),
    ).images  # fmt: skip
    return score_images(images, captions)


if __name__ == "__main__":
    # `python -m diffusers_stepbatch.toy.judge`: the quality numbers of the shipped model (as in the tests).
    import torch

    from diffusers_stepbatch.toy import DEFAULT_GUIDANCE, DEFAULT_STEPS, load_pipeline

    torch.set_num_threads(1)  # NOTE: tiny model: one thread is faster than two on a shared CPU
    pipe = load_pipeline()
    print(f"vae round trip, 256 held-out renders: {evaluate_vae(pipe.vae, count=256, seed=1234)}")
    for scale in (2.0, DEFAULT_GUIDANCE, 5.0):
        scores = evaluate_pipeline(pipe, guidance_scale=scale, steps=DEFAULT_STEPS, seed=0)
        print(f"generation, 80 held-out captions, {DEFAULT_STEPS} steps, guidance {scale}: {scores}")
