"""Deterministic training of the toy-shapes FLUX pipeline: VAE, then flow transformer, then guidance distillation.

    python -m diffusers_stepbatch.toy.train --out diffusers_stepbatch/toy/weights

Stages (fixed step counts, fixed seeds, deterministic algorithms, 2 threads):
1. VAE: L1 + MSE with object pixels (and their rim) weighted up, a colour term on the object's mean colour,
   a tiny KL. Object pixels are few, and a plain loss lets hues drift (yellow -> orange, blue -> purple).
2. Latent statistics -> `scaling_factor`/`shift_factor`, so the flow model sees unit-variance latents.
3. Flow transformer without guidance embedding: rectified flow, logit-normal t, 10% caption dropout, EMA.
4. Guidance distillation into a `guidance_embeds=True` copy: the student learns the teacher's true-CFG
   velocity `v_u + g (v_c - v_u)` for g in [1, 5], so a plain `pipe(prompt)` is guided in one forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

# NOTE: OpenMP's default spin-waiting slows every step badly when other processes share the cores; it must be
# set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

from diffusers_stepbatch.toy import build
from diffusers_stepbatch.toy.judge import evaluate_pipeline, evaluate_vae, images_to_tensor
from diffusers_stepbatch.toy.scenes import object_mask, render_scene, sample_scene, train_captions


@dataclasses.dataclass
class TrainConfig:
    """Args: step counts, batch sizes and learning rates of the three stages; `seed` derives all others."""

    seed: int = 0
    threads: int = 2
    vae_steps: int = 1100
    vae_batch: int = 16
    vae_lr: float = 1e-3
    object_weight: float = 10.0
    color_weight: float = 1.0
    kl_weight: float = 1e-6
    renders_per_caption: int = 32
    flow_steps: int = 2000
    flow_batch: int = 64
    flow_lr: float = 8e-4
    caption_dropout: float = 0.1
    distill_steps: int = 500
    distill_lr: float = 5e-4
    guidance_range: tuple[float, float] = (1.0, 5.0)
    ema_decay: float = 0.998
    eval_steps: int = 20

    def __post_init__(self):
        for name in ("vae_steps", "flow_steps", "distill_steps", "vae_batch", "flow_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


def _log(start: float, message: str) -> None:
    print(f"[{(time.time() - start) / 60:6.1f} min] {message}", flush=True)


def _lr_factor(step: int, total: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def render_batch(rng: np.random.Generator, captions: list[str], batch: int, size: int = build.NATIVE_SIZE):
    """Random renders of random captions: images in [-1, 1] (B,3,H,W) and object coverage (B,1,H,W)."""
    scenes = [sample_scene(rng, captions[i]) for i in rng.integers(0, len(captions), size=batch)]
    images = images_to_tensor([render_scene(scene, size) for scene in scenes])
    masks = torch.from_numpy(np.stack([object_mask(scene, size) for scene in scenes]))[:, None]
    return images, masks


def train_vae(cfg: TrainConfig, start: float):
    vae = build.build_vae(cfg.seed + 2)
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed + 10)
    noise = torch.Generator().manual_seed(cfg.seed + 11)
    captions = train_captions()
    for step in range(cfg.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.vae_lr * _lr_factor(step, cfg.vae_steps)
        x, mask = render_batch(rng, captions, cfg.vae_batch)
        posterior = vae.encode(x).latent_dist
        rec = vae.decode(posterior.sample(generator=noise)).sample
        # NOTE: weight the object and its rim: they are few pixels but carry the caption (and the edges).
        weight = 1 + cfg.object_weight * F.max_pool2d(mask, 3, 1, 1)
        err = rec - x
        pixel = (weight * (err.abs() + err.square())).mean() / weight.mean()
        area = mask.sum((2, 3)).clamp_min(1.0)
        color = ((rec * mask).sum((2, 3)) / area - (x * mask).sum((2, 3)) / area).abs().mean()
        loss = pixel + cfg.color_weight * color + cfg.kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == cfg.vae_steps - 1:
            _log(start, f"vae step {step}/{cfg.vae_steps} loss {loss.item():.4f} colour {color.item():.4f}")
        if step % 500 == 499:
            vae.eval()
            _log(start, f"vae step {step} held-out: {evaluate_vae(vae, count=64)}")
            vae.train()
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_dataset(cfg: TrainConfig, vae):
    """Latents (posterior means) of `renders_per_caption` renders of each training caption; sets scale/shift."""
    rng = np.random.default_rng(cfg.seed + 20)
    captions = train_captions()
    index = np.repeat(np.arange(len(captions)), cfg.renders_per_caption)
    latents = []
    for i in range(0, len(index), 256):
        scenes = [sample_scene(rng, captions[j]) for j in index[i : i + 256]]
        x = images_to_tensor([render_scene(scene, build.NATIVE_SIZE) for scene in scenes])
        latents.append(vae.encode(x).latent_dist.mode())
    latents = torch.cat(latents)
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (latents - shift) * scale, torch.from_numpy(index), captions


@torch.no_grad()
def encode_captions(pipe, captions: list[str]):
    """T5 sequence and CLIP pooled embeddings, exactly as the pipeline computes them; row -1 is the empty caption."""
    embeds, pooled, _ = pipe.encode_prompt(
        prompt=captions + [""], prompt_2=None, max_sequence_length=build.MAX_SEQUENCE_LENGTH
    )
    return embeds, pooled


class _EMA:
    def __init__(self, model, decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model, step: int):
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in model.state_dict().items():
            self.shadow[k].lerp_(v, 1 - decay) if v.dtype.is_floating_point else self.shadow[k].copy_(v)

    def copy_to(self, model):
        model.load_state_dict(self.shadow)
        return model


def _flow_inputs(cfg, pipe, latents, index, embeds, pooled, rng: torch.Generator, dropout: float):
    rows = torch.randint(0, len(latents), (cfg.flow_batch,), generator=rng)
    x0 = pipe._pack_latents(latents[rows], cfg.flow_batch, 16, 8, 8)
    text = index[rows].clone()
    text[torch.rand(cfg.flow_batch, generator=rng) < dropout] = -1
    noise = torch.randn(x0.shape, generator=rng)
    t = torch.sigmoid(torch.randn(cfg.flow_batch, generator=rng))  # logit-normal
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
    return xt, t, embeds[text], pooled[text], noise - x0


def train_flow(cfg: TrainConfig, pipe, latents, index, embeds, pooled, start: float):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(cfg.seed + 3)
    model = FluxTransformer2DModel(**dict(build.TRANSFORMER_CONFIG, guidance_embeds=False)).train()
    ema = _EMA(model, cfg.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.flow_lr, betas=(0.9, 0.99), weight_decay=0.01)
    rng = torch.Generator().manual_seed(cfg.seed + 30)
    img_ids = pipe._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)
    txt_ids = torch.zeros(build.MAX_SEQUENCE_LENGTH, 3)
    for step in range(cfg.flow_steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.flow_lr * _lr_factor(step, cfg.flow_steps)
        xt, t, enc, pool, target = _flow_inputs(cfg, pipe, latents, index, embeds, pooled, rng, cfg.caption_dropout)
        pred = model(
            hidden_states=xt, timestep=t, pooled_projections=pool, encoder_hidden_states=enc,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        loss = F.mse_loss(pred, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        ema.update(model, step)
        if step % 100 == 0 or step == cfg.flow_steps - 1:
            _log(start, f"flow step {step}/{cfg.flow_steps} loss {loss.item():.4f}")
    return ema.copy_to(model).eval().requires_grad_(False)


def guided_velocity(teacher, xt, t, g, enc, pool, embeds, pooled, txt_ids, img_ids, guidance=None):
    """The teacher's true-CFG velocity v_u + g (v_c - v_u), the unconditional branch on the empty caption (the
    last row of `embeds` / `pooled`); `guidance` is the teacher's own guidance input where it takes one."""
    with torch.no_grad():
        both = teacher(
            hidden_states=torch.cat([xt, xt]), timestep=torch.cat([t, t]), guidance=guidance,
            pooled_projections=torch.cat([pool, pooled[-1:].expand_as(pool)]),
            encoder_hidden_states=torch.cat([enc, embeds[-1:].expand_as(enc)]),
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        cond, uncond = both.chunk(2)
        return uncond + g[:, None, None] * (cond - uncond)


def distill_guidance(cfg: TrainConfig, pipe, teacher, latents, index, embeds, pooled, start: float):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(cfg.seed + 4)
    student = FluxTransformer2DModel(**build.TRANSFORMER_CONFIG)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    if unexpected or any("guidance_embedder" not in k for k in missing):
        raise RuntimeError(f"teacher/student mismatch: missing={missing} unexpected={unexpected}")
    # NOTE: a zero guidance embedding makes the student start as the (conditional) teacher.
    linear = student.time_text_embed.guidance_embedder.linear_2
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    student.train()
    ema = _EMA(student, cfg.ema_decay)
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.distill_lr, betas=(0.9, 0.99), weight_decay=0.01)
    rng = torch.Generator().manual_seed(cfg.seed + 40)
    img_ids = pipe._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)
    txt_ids = torch.zeros(build.MAX_SEQUENCE_LENGTH, 3)
    low, high = cfg.guidance_range
    for step in range(cfg.distill_steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.distill_lr * _lr_factor(step, cfg.distill_steps)
        xt, t, enc, pool, _ = _flow_inputs(cfg, pipe, latents, index, embeds, pooled, rng, 0.0)
        g = low + (high - low) * torch.rand(cfg.flow_batch, generator=rng)
        target = guided_velocity(teacher, xt, t, g, enc, pool, embeds, pooled, txt_ids, img_ids)
        pred = student(
            hidden_states=xt, timestep=t, guidance=g, pooled_projections=pool, encoder_hidden_states=enc,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]  # fmt: skip
        loss = F.mse_loss(pred, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        ema.update(student, step)
        if step % 100 == 0 or step == cfg.distill_steps - 1:
            _log(start, f"distill step {step}/{cfg.distill_steps} loss {loss.item():.4f}")
    return ema.copy_to(student).eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the saved FluxPipeline")
    parser.add_argument("--vae-from", help="skip stage 1: load the VAE saved by an earlier run (out/vae_stage)")
    for field in dataclasses.fields(TrainConfig):
        if field.type in ("int", "float"):
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=eval(field.type), default=field.default)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)})
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    _log(start, f"config {cfg}")

    if args.vae_from:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(args.vae_from).eval().requires_grad_(False)
    else:
        vae = train_vae(cfg, start)
        vae.save_pretrained(f"{args.out}_vae_stage")  # NOTE: lets stages 2-4 be rerun with --vae-from
    _log(start, f"vae held-out round trip: {evaluate_vae(vae)}")
    latents, index, captions = encode_dataset(cfg, vae)
    _log(start, f"latents {tuple(latents.shape)} shift {vae.config.shift_factor:.4f} scale {vae.config.scaling_factor:.4f}")

    pipe = build.build_pipeline(cfg.seed, vae=vae)
    embeds, pooled = encode_captions(pipe, captions)
    teacher = train_flow(cfg, pipe, latents, index, embeds, pooled, start)
    student = distill_guidance(cfg, pipe, teacher, latents, index, embeds, pooled, start)
    pipe = build.build_pipeline(cfg.seed, vae=vae, transformer=student)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(args.out, safe_serialization=True)
    _log(start, f"saved to {args.out}")
    for scale in (2.0, 3.5):
        _log(start, f"held-out generation, guidance {scale}: {evaluate_pipeline(pipe, scale, cfg.eval_steps)}")


if __name__ == "__main__":
    main()
