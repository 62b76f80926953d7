"""Deterministic training of a tiny PiD decoder for the toy-shapes pipeline (its VAE's latent space).

    python -m diffusers_stepbatch.toy.train_pid --vae diffusers_stepbatch/toy/weights \
        --out diffusers_stepbatch/toy/pid_adapter

Data: random renders of the training captions (`scenes.train_captions`). The condition is the toy VAE's latent
of the 64 x 64 render, normalised as the toy transformer sees it (`(z - shift_factor) * scaling_factor`), and
degraded as an early exit leaves it: `(1 - sigma) z + sigma eps` with sigma = 0 (a clean x0) or uniform in
[0, `sigma_max`]. The target is the same scene rendered at 4x (256 x 256). Text: the toy pipeline's own T5
caption embeddings ([16, 64]), which it computes anyway, so PiD needs no text model of its own.

The network is trained only at the four flow times of the distilled sampler, on an x0 loss (what the last step
returns). Half of the batches at later times start from the network's own earlier predictions (a rollout of
the sampler without gradients), so it learns from what it will see when sampling. Fixed seeds, deterministic
algorithms and a fixed thread count make two runs identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor

from diffusers_stepbatch.decoders.pid import PID_DISTILLED_TIMESTEPS, PiDDecoder, decode, sampler_step
from diffusers_stepbatch.toy import build
from diffusers_stepbatch.toy.judge import psnr
from diffusers_stepbatch.toy.scenes import heldout_captions, render_scene, sample_scene, train_captions

OUTPUT_SIZE = 4 * build.NATIVE_SIZE

# The released network's structure at toy width: 1024 patch tokens of 8 x 8 pixels for a 256 x 256 output; the
# model card (model_cards/toy-shapes-pid.md) has the measurements behind the choices noted here.
PID_TOY_CONFIG = dict(
    num_groups=2,
    hidden_size=96,
    # NOTE: 8, not 4: the output x0 = x_t - t v needs v to carry x_t's noise almost linearly through the final RMS
    # norm over these channels, which 4 channels do poorly.
    pixel_hidden_size=8,
    pixel_attn_hidden_size=32,
    pixel_num_groups=2,
    patch_depth=4,
    pixel_depth=1,
    patch_size=8,
    txt_embed_dim=build.TEXT_DIM,
    txt_max_length=build.MAX_SEQUENCE_LENGTH,
    rope_ref_h=OUTPUT_SIZE,
    rope_ref_w=OUTPUT_SIZE,
    lq_latent_channels=16,
    lq_hidden_dim=64,
    lq_num_res_blocks=3,
    lq_interval=1,
    # NOTE: the v1.5 additions: the adapter also feeds the pixel blocks, and its training-only RGB head gives the
    # adapter a direct loss on the 64 px image; both make training converge faster.
    pit_lq_inject=True,
    lq_aux_rgb_head=True,
    sr_scale=4,
    latent_spatial_down_factor=8,
)


@dataclasses.dataclass
class PiDTrainConfig:
    """Args: step count, batch, learning rate, latent degradation and evaluation size; `seed` derives all others."""

    seed: int = 0
    threads: int = 2  # NOTE: part of the recipe: the trained weights depend on the thread count
    steps: int = 3400
    batch: int = 4
    lr: float = 1.5e-3
    ema_decay: float = 0.995
    p_clean: float = 0.5  # share of clean latents (sigma = 0); the rest are early exits
    sigma_max: float = 0.4
    rollout: float = 0.75  # share of batches at t < 0.999 that start from the network's own prediction ...
    rollout_from: float = 0.6  # ... from this fraction of the steps on (before, its predictions are too poor)
    aux_rgb_weight: float = 1.0  # weight of the adapter's 64 px RGB loss (needs lq_aux_rgb_head); 0: off
    eval_count: int = 64
    init: str = ""  # a saved adapter to start from (stage 2); "" starts from the seed's random init
    device: str = "cpu"  # noise and data are drawn on the CPU either way, so the run is the same on any device

    def __post_init__(self):
        if self.steps < 0 or self.batch < 1:
            raise ValueError(f"steps={self.steps} must be >= 0 and batch={self.batch} >= 1")
        if not all(0 <= v <= 1 for v in (self.p_clean, self.rollout, self.rollout_from)) or not 0 < self.sigma_max <= 1:
            raise ValueError(f"p_clean, rollout, rollout_from must be in [0, 1] and sigma_max in (0, 1]; got {self}")
        if self.aux_rgb_weight < 0:
            raise ValueError(f"aux_rgb_weight={self.aux_rgb_weight} must be >= 0")


def _log(start: float, message: str) -> None:
    print(f"[{(time.time() - start) / 60:6.1f} min] {message}", flush=True)


def _to_tensor(images) -> torch.Tensor:
    array = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """[-1, 1] images [B, 3, H, W] -> uint8 [B, H, W, 3], rounded as diffusers' postprocess does."""
    return ((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)


def load_vae(path: str, renders_per_caption: int = 16):
    """The toy VAE from a pipeline folder (`vae/`) or a VAE folder; placeholder latent statistics are measured.

    A stage-1 VAE (saved before the toy trainer measures the latent statistics) gets them measured here by the toy
    trainer's own `encode_dataset`, with its `renders_per_caption`, so they equal the shipped pipeline's.
    """
    from diffusers import AutoencoderKL

    folder = Path(path)
    vae = AutoencoderKL.from_pretrained(folder / "vae" if (folder / "vae").is_dir() else folder)
    vae = vae.eval().requires_grad_(False)
    if vae.config.scaling_factor == 1.0 and vae.config.shift_factor == 0.0:
        # NOTE: a stage-1 VAE: measure the statistics exactly as the toy trainer does before it saves the pipeline.
        from diffusers_stepbatch.toy.train import TrainConfig, encode_dataset

        encode_dataset(TrainConfig(renders_per_caption=renders_per_caption), vae)
    return vae


@torch.no_grad()
def latents_of(vae, images: torch.Tensor) -> torch.Tensor:
    """The normalised latent the toy transformer works in (posterior mode), [B, 16, 8, 8]."""
    z = vae.encode(images).latent_dist.mode()
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


@functools.lru_cache(maxsize=1)
def _text_pipeline():
    # NOTE: built once per process: every held-out evaluation needs the same text encoders.
    return build.build_pipeline(0)


@torch.no_grad()
def caption_embeddings(captions: list[str]) -> dict[str, torch.Tensor]:
    """The toy pipeline's T5 embeddings of each caption ([16, 64]); its text encoders are fixed by the seed."""
    pipe = _text_pipeline()
    embeds, _, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, max_sequence_length=build.MAX_SEQUENCE_LENGTH)
    return {text: row for text, row in zip(captions, embeds)}


def render_pairs(rng: np.random.Generator, captions: list[str], count: int):
    """Random scenes of random captions: 64 px and 256 px renders in [-1, 1], and the captions."""
    texts = [captions[i] for i in rng.integers(0, len(captions), size=count)]
    scenes = [sample_scene(rng, text) for text in texts]
    low = _to_tensor([render_scene(scene, build.NATIVE_SIZE) for scene in scenes])
    high = _to_tensor([render_scene(scene, OUTPUT_SIZE) for scene in scenes])
    return low, high, texts


def degrade(latent: torch.Tensor, cfg: PiDTrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An early-exit latent: (1 - sigma) z + sigma eps, sigma = 0 for a `p_clean` share of rows."""
    b = latent.shape[0]
    sigma = torch.rand(b, generator=gen) * cfg.sigma_max
    sigma = torch.where(torch.rand(b, generator=gen) < cfg.p_clean, torch.zeros_like(sigma), sigma)
    eps = randn_tensor(latent.shape, generator=gen, device=latent.device)
    sigma = sigma.to(latent.device)
    s = sigma.view(-1, 1, 1, 1)
    return (1 - s) * latent + s * eps, sigma


def _lr_factor(step: int, total: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def training_input(model, x0, lq, sigma, text, step_index: int, rollout: bool, gen: torch.Generator):
    """x_t at the distilled time `step_index`: from the target (x0) or from a no-grad rollout of the sampler."""
    ts = PID_DISTILLED_TIMESTEPS
    b = x0.shape[0]
    noise = randn_tensor(x0.shape, generator=gen, device=x0.device)
    if not rollout or step_index == 0:
        t = ts[step_index]
        return (1 - t) * x0 + t * noise
    x = noise
    with torch.no_grad():
        for i in range(step_index):
            t_rows = torch.full((b,), ts[i], device=x0.device)
            v = model(x, t_rows * 1000, text, lq_latent=lq, degrade_sigma=sigma)
            eps = randn_tensor(x0.shape, generator=gen, device=x0.device)
            x = sampler_step(x, v, t_rows, torch.full_like(t_rows, ts[i + 1]), eps)
    return x


def aux_rgb(model: PiDDecoder, features: torch.Tensor) -> torch.Tensor:
    """The adapter's training-only head on its conv features [B, C, rows, cols]: the native-size image [B, 3, ., .]."""
    b, _, rows, cols = features.shape
    rgb = model.lq_proj.lq_aux_rgb_head(features.flatten(2).transpose(1, 2))  # [B, rows * cols, 3 * p * p]
    return F.pixel_shuffle(rgb.transpose(1, 2).reshape(b, -1, rows, cols), model.patch_size // model.sr_scale)


def train(cfg: PiDTrainConfig, vae, start: float) -> PiDDecoder:
    """Train from the seed; returns the EMA weights. Every 500 steps the EMA is scored on 16 held-out scenes."""
    torch.manual_seed(cfg.seed)
    model = PiDDecoder(**PID_TOY_CONFIG).train()
    if cfg.init:
        model.load_state_dict(PiDDecoder.from_pretrained(cfg.init).state_dict())
    model.to(cfg.device)
    vae.to(cfg.device)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapter_features = {}
    if cfg.aux_rgb_weight:
        if not hasattr(model.lq_proj, "lq_aux_rgb_head"):
            raise ValueError("aux_rgb_weight > 0 needs lq_aux_rgb_head=True in the network's config")
        # NOTE: the head reads the adapter's conv trunk, which the network's forward does not return.
        hook = model.lq_proj.latent_proj.register_forward_hook(lambda _m, _i, out: adapter_features.update(last=out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.01)
    captions = train_captions()
    embeds = {text: row.to(cfg.device) for text, row in caption_embeddings(captions).items()}
    rng = np.random.default_rng(cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    ts = PID_DISTILLED_TIMESTEPS
    # NOTE: the last step's x0 is the output; earlier steps only set up the re-noised input of the next.
    step_probs = torch.tensor([0.1, 0.15, 0.25, 0.5])
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, cfg.steps)
        low, x0, texts = render_pairs(rng, captions, cfg.batch)
        low, x0 = low.to(cfg.device), x0.to(cfg.device)
        lq, sigma = degrade(latents_of(vae, low), cfg, gen)
        text = torch.stack([embeds[t] for t in texts])
        k = int(torch.multinomial(step_probs, 1, generator=gen))
        rollout = bool(torch.rand(1, generator=gen) < cfg.rollout) and step >= cfg.rollout_from * cfg.steps
        x_t = training_input(model, x0, lq, sigma, text, k, rollout, gen)
        t_rows = torch.full((cfg.batch,), ts[k], device=cfg.device)
        v = model(x_t, t_rows * 1000, text, lq_latent=lq, degrade_sigma=sigma)
        x0_loss = F.mse_loss(x_t - ts[k] * v, x0)
        loss = x0_loss
        if cfg.aux_rgb_weight:
            loss = loss + cfg.aux_rgb_weight * F.mse_loss(aux_rgb(model, adapter_features["last"]), low)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, value in model.state_dict().items():
                ema[name].lerp_(value, 1 - decay)
        if step % 50 == 0 or step == cfg.steps - 1:
            losses = f"x0 mse {x0_loss.item():.5f} loss {loss.item():.5f}"
            _log(start, f"step {step}/{cfg.steps} t={ts[k]} rollout={rollout} {losses}")
        if step % 500 == 499:
            probe = PiDDecoder(**PID_TOY_CONFIG).to(cfg.device)
            probe.load_state_dict(ema)
            _log(start, f"step {step} EMA held-out: {evaluate(probe.eval(), vae, count=16)}")
    if cfg.aux_rgb_weight:
        hook.remove()  # the returned decoder should not keep its last features alive
    model.load_state_dict(ema)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def evaluate(decoder: PiDDecoder, vae, count: int = 64, seed: int = 4321, sigma: float = 0.0) -> dict[str, float]:
    """Mean PSNR (dB) against the 256 px render on held-out scenes: PiD vs VAE decode + bicubic 4x upsampling.

    The latent is the VAE's latent of the 64 px render; `sigma` > 0 degrades it as an early exit would, with
    noise from a fixed seed. PiD samples with one generator per scene (seeded by its index).
    """
    rng = np.random.default_rng(seed)
    device = next(decoder.parameters()).device
    captions = heldout_captions()
    embeds = caption_embeddings(captions)
    pid_scores, bicubic_scores = [], []
    for start in range(0, count, 16):
        texts = [captions[(start + i) % len(captions)] for i in range(min(16, count - start))]
        scenes = [sample_scene(rng, text) for text in texts]
        low = _to_tensor([render_scene(scene, build.NATIVE_SIZE) for scene in scenes])
        truth = np.stack([np.asarray(render_scene(scene, OUTPUT_SIZE)) for scene in scenes])
        latent = latents_of(vae, low.to(device))
        decoded = vae.decode(latent / vae.config.scaling_factor + vae.config.shift_factor).sample.cpu()
        bicubic = F.interpolate(decoded, size=(OUTPUT_SIZE, OUTPUT_SIZE), mode="bicubic", align_corners=False)
        if sigma > 0:
            noise = randn_tensor(latent.shape, generator=torch.Generator().manual_seed(seed + start), device=device)
            latent = (1 - sigma) * latent + sigma * noise
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(texts))]
        text = torch.stack([embeds[t] for t in texts])
        image = decode(decoder, latent, sigma, text, generator=generators)
        pid_scores += [psnr(a, b) for a, b in zip(truth, to_uint8(image.cpu()))]
        bicubic_scores += [psnr(a, b) for a, b in zip(truth, to_uint8(bicubic))]
    return {"pid_psnr": float(np.mean(pid_scores)), "bicubic_psnr": float(np.mean(bicubic_scores)), "count": count}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vae", required=True, help="the toy pipeline folder (or its stage-1 VAE folder)")
    parser.add_argument("--out", required=True, help="folder for the adapter (config.json + model.safetensors)")
    parser.add_argument("--stats-renders-per-caption", type=int, default=16,
                        help="for a stage-1 VAE: the toy trainer's renders_per_caption (its latent statistics)")
    for field in dataclasses.fields(PiDTrainConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=eval(field.type), default=field.default)
    args = parser.parse_args(argv)
    cfg = PiDTrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PiDTrainConfig)})
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    _log(start, f"config {cfg}")
    vae = load_vae(args.vae, args.stats_renders_per_caption)
    _log(start, f"vae latent shift {vae.config.shift_factor:.6f} scale {vae.config.scaling_factor:.6f}")
    decoder = train(cfg, vae, start)
    decoder.to("cpu").save_pretrained(args.out)
    decoder.to(cfg.device)
    scores = {f"sigma_{s}": evaluate(decoder, vae, cfg.eval_count, sigma=s) for s in (0.0, 0.16)}
    (Path(args.out) / "training.json").write_text(
        json.dumps({"config": dataclasses.asdict(cfg), "minutes": (time.time() - start) / 60, "heldout": scores}, indent=1)
    )
    _log(start, f"saved to {args.out}; held-out PSNR {scores}")


if __name__ == "__main__":
    main()
