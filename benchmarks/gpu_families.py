"""The image and video families at their real widths on a CUDA machine: sequential, StepBatched, ceiling.

    python benchmarks/gpu_families.py                 # CUDA, random bf16 weights, no Hub access; one device command
    python benchmarks/gpu_families.py --dry-run       # CPU, the tiny test configs: checks the script end to end

Per family, N concurrent requests (different prompts and seeds): sequential plain calls, StepBatched, and the
batched ceiling (one plain call with every request's prompt, seed and image as a batch). Rounds interleaved,
medians; the JSON gets the device, the library versions and the date with the numbers, after each family.
- Z-Image-Turbo (6B: width 3840, 30 + 2 refiner layers), 1024x1024, 8 steps, no CFG, 8 requests;
- FLUX.2 klein 4B (24 heads x 128, 5 + 20 blocks, 128 latent channels), 1024x1024, 4 steps, 8 requests;
- Qwen-Image-Edit (24 heads x 128; `--qwen-layers` of the 60 blocks, so that a round fits the device time), a
  1024x1024 reference image, true CFG 4.0, 8 steps, 8 requests;
- Wan 2.1 1.3B (12 heads x 128, 30 layers), 480x832, 33 frames, guidance 5.0, 8 steps, 4 requests.
Each transformer and VAE is the model's own class at its published config with random weights; text encoders
keep only the hidden width the transformer reads (2 layers), since their cost is once per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import command_line, in_worker_thread, run_clients  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402


@dataclass
class Family:
    name: str
    build: Callable[[bool, argparse.Namespace], Any]  # (real widths or the tiny dry-run config, args) -> pipeline
    request: Callable[[Any, int, bool], dict]  # (pipeline, i, real) -> request i's call arguments
    requests: int
    dry_requests: int = 3


def _gpu_model(cls, **config) -> torch.nn.Module:
    """The model built on the GPU, in bf16."""
    with torch.device("cuda"):
        return cls(**config).to(torch.bfloat16).eval()


def _gpu_text_encoder(encoder: torch.nn.Module) -> torch.nn.Module:
    return encoder.to("cuda", torch.bfloat16)


def _z_image(real: bool, args) -> Any:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from diffusers_stepbatch.testing.image_models import qwen3_text_encoder, tiny_chat_tokenizer
    from diffusers_stepbatch.testing.image_models import tiny_z_image_pipeline

    if not real:
        return tiny_z_image_pipeline(vae_blocks=3)
    tokenizer = tiny_chat_tokenizer()
    transformer = _gpu_model(ZImageTransformer2DModel)  # the class defaults are Z-Image-Turbo's config
    with torch.no_grad():  # NOTE: the pad tokens start as torch.empty
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    vae = _gpu_model(AutoencoderKL, in_channels=3, out_channels=3, latent_channels=16,
                     down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                     block_out_channels=[128, 256, 512, 512], layers_per_block=2, scaling_factor=0.3611,
                     shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    text_encoder = _gpu_text_encoder(qwen3_text_encoder(tokenizer, 2560, causal_lm=False, seed=1))
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, tokenizer=tokenizer,
                          text_encoder=text_encoder, transformer=transformer)


def _z_image_request(pipe, i: int, real: bool) -> dict:
    side = 1024 if real else 64
    return dict(prompt=f"a lighthouse on a cliff at dawn, view {i}", height=side, width=side,
                num_inference_steps=8 if real else 2, guidance_scale=0.0, max_sequence_length=64)


def _klein(real: bool, args) -> Any:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers import Flux2Transformer2DModel

    from diffusers_stepbatch.testing.image_models import qwen3_text_encoder, tiny_chat_tokenizer
    from diffusers_stepbatch.testing.image_models import tiny_flux2_klein_pipeline

    if not real:
        return tiny_flux2_klein_pipeline(vae_blocks=3)
    tokenizer = tiny_chat_tokenizer()
    transformer = _gpu_model(Flux2Transformer2DModel, num_layers=5, num_single_layers=20, num_attention_heads=24,
                             attention_head_dim=128, joint_attention_dim=3 * 2560, in_channels=128,
                             guidance_embeds=False)
    text_encoder = _gpu_text_encoder(qwen3_text_encoder(tokenizer, 2560, causal_lm=True, seed=1))
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_gpu_model(AutoencoderKLFlux2),
                              tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                              is_distilled=True)


def _klein_request(pipe, i: int, real: bool) -> dict:
    side = 1024 if real else 64
    # NOTE: three hidden layers of the text encoder, as the 4B's (9, 18, 27); (1,) on the tiny one
    return dict(prompt=f"a paper boat on a pond, view {i}", height=side, width=side, num_inference_steps=4 if real
                else 2, guidance_scale=1.0, max_sequence_length=64,
                text_encoder_out_layers=(1, 1, 2) if real else (1,))


def _qwen_edit(real: bool, args) -> Any:
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel

    from diffusers_stepbatch.testing.image_models import tiny_qwenimage_edit_pipeline

    tiny = tiny_qwenimage_edit_pipeline(text_hidden=3584 if real else 32)
    if not real:
        return tiny
    text_encoder = _gpu_text_encoder(tiny.text_encoder)
    transformer = _gpu_model(QwenImageTransformer2DModel, num_layers=args.qwen_layers)
    pipe = QwenImageEditPipeline(scheduler=tiny.scheduler, vae=_gpu_model(AutoencoderKLQwenImage),
                                 text_encoder=text_encoder, tokenizer=tiny.tokenizer, processor=tiny.processor,
                                 transformer=transformer)
    pipe.prompt_template_encode = tiny.prompt_template_encode
    pipe.prompt_template_encode_start_idx = tiny.prompt_template_encode_start_idx
    return pipe


def _qwen_edit_request(pipe, i: int, real: bool) -> dict:
    side = 1024 if real else 32
    pixels = torch.rand(side, side, 3, generator=torch.Generator().manual_seed(100 + i))
    image = PIL.Image.fromarray((pixels * 255).to(torch.uint8).numpy())  # NOTE: the pipeline reads a PIL size
    return dict(prompt=f"make the sky stormy, take {i}", negative_prompt="blurry", image=image, height=side,
                width=side, num_inference_steps=8 if real else 2, true_cfg_scale=4.0, max_sequence_length=64)


def _wan(real: bool, args) -> Any:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from diffusers_stepbatch.testing import tiny_t5_encoder, tiny_t5_tokenizer
    from diffusers_stepbatch.toy.video import tiny_wan_pipeline

    if not real:
        return tiny_wan_pipeline()
    tokenizer = tiny_t5_tokenizer()
    transformer = _gpu_model(WanTransformer3DModel, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                             num_layers=30)  # Wan 2.1 1.3B; the rest are the class defaults
    return WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_gpu_model(AutoencoderKLWan),
                       tokenizer=tokenizer, transformer=transformer,
                       text_encoder=_gpu_text_encoder(tiny_t5_encoder(tokenizer, d_model=4096)))


def _wan_request(pipe, i: int, real: bool) -> dict:
    height, width, frames = (480, 832, 33) if real else (32, 48, 5)
    return dict(prompt=f"a red kite over the sea, take {i}", negative_prompt="blurry", height=height, width=width,
                num_frames=frames, num_inference_steps=8 if real else 2, guidance_scale=5.0, max_sequence_length=64)


FAMILIES = {
    "z-image-turbo": Family("z-image-turbo", _z_image, _z_image_request, 8),
    "flux2-klein-4b": Family("flux2-klein-4b", _klein, _klein_request, 8),
    "qwen-image-edit": Family("qwen-image-edit", _qwen_edit, _qwen_edit_request, 8),
    "wan2.1-1.3b": Family("wan2.1-1.3b", _wan, _wan_request, 4),
}


def _with_seed(kwargs: dict, seed: int, device: str) -> dict:
    return dict(kwargs, generator=torch.Generator(device).manual_seed(seed), output_type="pt")


def _batched(requests: list[dict]) -> dict:
    """One plain call for all requests: prompts, negative prompts, images and generators as lists."""
    call = dict(requests[0])
    for name in ("prompt", "negative_prompt", "generator"):
        if name in call:
            call[name] = [request[name] for request in requests]
    if "image" in call:
        call["image"] = [request["image"] for request in requests]
    return call


def _wait(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_family(family: Family, real: bool, rounds: int, warmup_rounds: int, args) -> dict:
    device = "cuda" if real else "cpu"
    pipe = family.build(real, args)
    pipe.set_progress_bar_config(disable=True)
    n = family.requests if real else family.dry_requests
    requests = [family.request(pipe, i, real) for i in range(n)]

    def seeded() -> list[dict]:
        return [_with_seed(kwargs, i, device) for i, kwargs in enumerate(requests)]

    def sequential() -> float:
        start = time.perf_counter()
        for kwargs in seeded():
            pipe(**kwargs)
        _wait(device)
        return n / (time.perf_counter() - start)

    def ceiling() -> float:
        call = _batched(seeded())
        start = time.perf_counter()
        pipe(**call)
        _wait(device)
        return n / (time.perf_counter() - start)

    sb = StepBatched(pipe, max_batch_size=2 * n)  # NOTE: two rows per request where the pipeline runs CFG

    def stepbatched() -> float:
        sb.engine.wait_idle()
        sb.reset_stats()
        calls = seeded()
        start = run_clients(n, lambda i, start: sb(**calls[i]))
        _wait(device)
        return n / (time.perf_counter() - start)

    in_worker_thread(lambda: pipe(**seeded()[0]))  # warm-up: allocations, kernels' first calls
    in_worker_thread(ceiling)
    for _ in range(warmup_rounds):
        stepbatched()
    runs: dict[str, list[float]] = {"sequential": [], "stepbatched": [], "ceiling": []}
    sides = {"sequential": sequential, "stepbatched": stepbatched, "ceiling": ceiling}
    for _ in range(rounds):
        for label, side in sides.items():
            runs[label].append(in_worker_thread(side))
    stats = sb.stats()
    sb.close()
    medians = {label: statistics.median(values) for label, values in runs.items()}
    return {"requests": n, "per_s": medians, "rounds": runs,
            "stepbatched_vs_ceiling": medians["stepbatched"] / medians["ceiling"],
            "stepbatched_vs_sequential": medians["stepbatched"] / medians["sequential"],
            "mean_denoise_rows": stats["mean_denoise_rows"], "mixed": stats["mixed"], "splits": stats["splits"],
            "request": {k: v for k, v in requests[0].items() if isinstance(v, (str, int, float, tuple))}}


def _environment(real: bool) -> dict:
    import diffusers
    import transformers

    return {"device": torch.cuda.get_device_name() if real else "cpu (dry run)", "torch": torch.__version__,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d")}


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the families' builders read (`Family.build(real, args)`)."""
    parser.add_argument("--qwen-layers", type=int, default=12, help="Qwen-Image transformer blocks (the model has 60)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved measured rounds (medians)")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="unmeasured StepBatched rounds first")
    add_build_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="CPU, the tiny test configs, one round")
    parser.add_argument("--out", type=Path, help="the JSON (default: benchmarks/results/gpu_families.json; a dry "
                        "run's goes to the temp folder)")
    args = parser.parse_args(argv)
    real = not args.dry_run
    if real and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --dry-run)")
    rounds, warmup = (args.rounds, args.warmup_rounds) if real else (1, 1)
    out = args.out or (Path(__file__).parent / "results" / "gpu_families.json" if real
                       else Path(tempfile.gettempdir()) / "gpu_families_dry_run.json")
    report: dict[str, Any] = {"environment": _environment(real),
                              "command": command_line("benchmarks/gpu_families.py", argv), "families": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.families:
        result = bench_family(FAMILIES[name], real, rounds, warmup, args)
        report["families"][name] = result
        rates = result["per_s"]
        print(f"{name}: {result['requests']} requests, per s: sequential {rates['sequential']:.3f}, StepBatched "
              f"{rates['stepbatched']:.3f} ({result['stepbatched_vs_sequential']:.2f}x), ceiling "
              f"{rates['ceiling']:.3f} -> {result['stepbatched_vs_ceiling']:.2f} of the ceiling", flush=True)
        out.write_text(json.dumps(report, indent=2, default=str))  # NOTE: after each family, for a timeout
        if real:
            torch.cuda.empty_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
