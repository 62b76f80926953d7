"""Fine-tune the toy transformer to draw at every supported size and aspect ratio (stages 5 and 6 of the recipe).

    python -m diffusers_stepbatch.toy.train_sizes --out diffusers_stepbatch/toy/weights

Starts from the 64 px model that `toy.train` writes (`--from`, default the shipped weights) and keeps its VAE,
text encoders and scheduler: the VAE is convolutional and already round-trips any size. Each step draws one
size from `SUPPORTED_SIZES` (every multiple of 16 from 48 to 128 px per side, aspect 1:2 to 2:1) and a batch of
about `tokens_per_batch` image tokens at that size, rendered and encoded on the fly.

5. Teacher: the guidance-distilled transformer called at guidance 1 (its conditional velocity) is fine-tuned with
   stage 3's flow loss (rectified flow, logit-normal t, 10% caption dropout, EMA), so it learns the
   unconditional velocity too.
6. Distillation: the 64 px student regresses the teacher's true-CFG velocity `v_u + g (v_c - v_u)` for g in
   [1, 5] at every size, as stage 4.
Deterministic (fixed seeds and step counts, `torch.use_deterministic_algorithms`, one thread), offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: see toy.train; before torch starts its pool

import numpy as np
import torch
import torch.nn.functional as F

from diffusers_stepbatch.toy import WEIGHTS_DIR, build
from diffusers_stepbatch.toy.judge import evaluate_pipeline, images_to_tensor
from diffusers_stepbatch.toy.scenes import render_scene, sample_scene, train_captions
from diffusers_stepbatch.toy.train import _EMA, _log, _lr_factor, encode_captions, guided_velocity


@dataclasses.dataclass
class SizesConfig:
    """Args: step counts, learning rates and the image-token budget of one batch; `seed` derives all others."""

    seed: int = 0
    threads: int = 1  # NOTE: the shipped weights' setting; the result depends on it
    teacher_steps: int = 1200
    teacher_lr: float = 3e-4
    distill_steps: int = 800
    distill_lr: float = 2e-4
    tokens_per_batch: int = 1024
    max_batch: int = 64
    caption_dropout: float = 0.1
    guidance_range: tuple[float, float] = (1.0, 5.0)
    ema_decay: float = 0.998
    warmup: int = 50

    def __post_init__(self):
        for name in ("teacher_steps", "distill_steps", "tokens_per_batch", "max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


class SizedBatches:
    """Deterministic stream of (size, packed latents, caption rows) at a random supported size per batch."""

    def __init__(self, cfg: SizesConfig, pipe, seed: int):
        self.cfg, self.pipe = cfg, pipe
        self.rng = np.random.default_rng(seed)
        self.captions = train_captions()
        self.sizes = build.supported_sizes()

    @torch.no_grad()
    def next(self):
        width, height = self.sizes[self.rng.integers(len(self.sizes))]
        tokens = (width // 16) * (height // 16)
        batch = min(self.cfg.max_batch, max(1, self.cfg.tokens_per_batch // tokens))
        rows = self.rng.integers(0, len(self.captions), size=batch)
        images = [render_scene(sample_scene(self.rng, self.captions[i]), (width, height)) for i in rows]
        vae = self.pipe.vae
        latents = vae.encode(images_to_tensor(images)).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        packed = self.pipe._pack_latents(latents, batch, 16, height // 8, width // 8)
        img_ids = self.pipe._prepare_latent_image_ids(1, height // 16, width // 16, "cpu", torch.float32)
        return packed, img_ids, torch.from_numpy(rows)


def _noised(x0: torch.Tensor, rng: torch.Generator):
    noise = torch.randn(x0.shape, generator=rng)
    t = torch.sigmoid(torch.randn(len(x0), generator=rng))  # logit-normal
    return (1 - t[:, None, None]) * x0 + t[:, None, None] * noise, t, noise - x0


def _step(optimizer, model, loss, lr: float, step: int, total: int, warmup: int):
    for group in optimizer.param_groups:
        group["lr"] = lr * _lr_factor(step, total, warmup)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def train_teacher(cfg: SizesConfig, pipe, embeds, pooled, start: float):
    teacher = _copy(pipe.transformer).train().requires_grad_(True)
    ema = _EMA(teacher, cfg.ema_decay)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=cfg.teacher_lr, betas=(0.9, 0.99), weight_decay=0.01)
    batches, rng = SizedBatches(cfg, pipe, cfg.seed + 50), torch.Generator().manual_seed(cfg.seed + 51)
    txt_ids = torch.zeros(build.MAX_SEQUENCE_LENGTH, 3)
    for step in range(cfg.teacher_steps):
        x0, img_ids, text = batches.next()
        text[torch.rand(len(text), generator=rng) < cfg.caption_dropout] = -1
        xt, t, target = _noised(x0, rng)
        pred = teacher(
            hidden_states=xt, timestep=t, guidance=torch.ones(len(t)), pooled_projections=pooled[text],
            encoder_hidden_states=embeds[text], txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        loss = F.mse_loss(pred, target)
        _step(optimizer, teacher, loss, cfg.teacher_lr, step, cfg.teacher_steps, cfg.warmup)
        ema.update(teacher, step)
        if step % 100 == 0 or step == cfg.teacher_steps - 1:
            _log(start, f"teacher step {step}/{cfg.teacher_steps} tokens {img_ids.shape[0]} loss {loss.item():.4f}")
    return ema.copy_to(teacher).eval().requires_grad_(False)


def distill(cfg: SizesConfig, pipe, teacher, embeds, pooled, start: float):
    student = _copy(pipe.transformer).train().requires_grad_(True)
    ema = _EMA(student, cfg.ema_decay)
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.distill_lr, betas=(0.9, 0.99), weight_decay=0.01)
    batches, rng = SizedBatches(cfg, pipe, cfg.seed + 60), torch.Generator().manual_seed(cfg.seed + 61)
    txt_ids = torch.zeros(build.MAX_SEQUENCE_LENGTH, 3)
    low, high = cfg.guidance_range
    for step in range(cfg.distill_steps):
        x0, img_ids, text = batches.next()
        xt, t, _ = _noised(x0, rng)
        g = low + (high - low) * torch.rand(len(t), generator=rng)
        enc, pool = embeds[text], pooled[text]
        target = guided_velocity(teacher, xt, t, g, enc, pool, embeds, pooled, txt_ids, img_ids,
                                 guidance=torch.ones(2 * len(t)))
        pred = student(
            hidden_states=xt, timestep=t, guidance=g, pooled_projections=pool, encoder_hidden_states=enc,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        loss = F.mse_loss(pred, target)
        _step(optimizer, student, loss, cfg.distill_lr, step, cfg.distill_steps, cfg.warmup)
        ema.update(student, step)
        if step % 100 == 0 or step == cfg.distill_steps - 1:
            _log(start, f"distill step {step}/{cfg.distill_steps} tokens {img_ids.shape[0]} loss {loss.item():.4f}")
    return ema.copy_to(student).eval().requires_grad_(False)


def _copy(model):
    from diffusers import FluxTransformer2DModel

    clone = FluxTransformer2DModel(**{k: v for k, v in model.config.items() if not k.startswith("_")})
    clone.load_state_dict(model.state_dict())
    return clone


def main(argv: list[str] | None = None) -> None:
    from diffusers_stepbatch.toy.pipeline import ToyFluxPipeline

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the saved pipeline (may equal --from)")
    parser.add_argument("--from", dest="source", default=str(WEIGHTS_DIR), help="the 64 px pipeline to start from")
    parser.add_argument("--teacher-from", help="skip stage 5: load the teacher saved by an earlier run")
    parser.add_argument("--no-eval", action="store_true", help="skip judging the result at the judged sizes")
    for field in dataclasses.fields(SizesConfig):
        if field.type in ("int", "float"):
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=eval(field.type), default=field.default)
    args = parser.parse_args(argv)
    cfg = SizesConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SizesConfig) if hasattr(args, f.name)})
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    _log(start, f"config {cfg}")

    pipe = ToyFluxPipeline.from_pretrained(args.source, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.requires_grad_(False)
    embeds, pooled = encode_captions(pipe, train_captions())
    if args.teacher_from:
        from diffusers import FluxTransformer2DModel

        teacher = FluxTransformer2DModel.from_pretrained(args.teacher_from).eval().requires_grad_(False)
    else:
        teacher = train_teacher(cfg, pipe, embeds, pooled, start)
        teacher.save_pretrained(f"{args.out}_teacher_stage")  # NOTE: lets stage 6 be rerun with --teacher-from
    student = distill(cfg, pipe, teacher, embeds, pooled, start)

    out = Path(args.out)
    if out.resolve() != Path(args.source).resolve():
        shutil.copytree(args.source, out, dirs_exist_ok=True)
    student.save_pretrained(out / "transformer", safe_serialization=True)
    _log(start, f"saved to {out}")
    pipe.transformer = student
    for width, height in () if args.no_eval else build.JUDGED_SIZES:
        scores = evaluate_pipeline(pipe, 3.5, 28, seed=0, size=(width, height))
        _log(start, f"held-out generation {width}x{height}, 28 steps, guidance 3.5: {scores}")


if __name__ == "__main__":
    main()
