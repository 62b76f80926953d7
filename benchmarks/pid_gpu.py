"""PiD early exit at the real sizes, for a GPU: FLUX.1-dev's transformer and the released flux PiD config.

    python benchmarks/pid_gpu.py                        # CUDA: 2048 x 2048, N = 28, K = 24, 1 request; bf16
    python benchmarks/pid_gpu.py --concurrency 1 4      # also 4 concurrent requests
    python benchmarks/pid_gpu.py --pair scaled --device cpu --output 256 --steps 3 --exit-step 2   # smoke, CPU

Random weights (timing and memory do not depend on them): FLUX.1-dev's transformer config (11.9B) and FLUX's VAE
in bf16, with stand-in text encoders (a 1-layer T5 of width 4096, a CLIP of width 768: text encoding is the same
for both sides and not what is compared), and the released `PiD_res2k_sr4x_official_flux_distill_4step` network
(1.36B, bf16) fed stand-in Gemma-2 caption embeddings [B, 300, 2304]. Both sides are served by StepBatched, each in
a fresh process: (a) FLUX at the output size for N steps + VAE decode, (b) FLUX at 1/4 of it for K steps + PiD.
Peak memory: `torch.cuda.max_memory_allocated` over the process (weights included, as the PiD paper reports it),
or peak RSS minus RSS after imports on a CPU. The paper's figures at 2048 x 2048 are written beside ours in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SIDES = ("full", "pid")
SEED_DOCUMENT = {"output": 2048, "peak_memory_gb": [16.84, 11.53], "latency_change": -0.918}


class _StandInCaptions:
    """Gemma-2-2B-it caption embeddings' shape ([B, 300, 2304]) without Gemma: the decode's cost does not depend on
    the values."""

    def __init__(self, length: int, dim: int, device, dtype):
        self.length, self.dim, self.device, self.dtype = length, dim, device, dtype

    def encode(self, prompts):
        import torch

        return torch.randn(len(prompts), self.length, self.dim, device=self.device, dtype=self.dtype)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def build(pair: str, device: str, dtype):
    """(FluxPipeline, PiDDecoding) with random weights on `device`."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    import pid_scaled
    from diffusers_stepbatch import PiDDecoder, PiDDecoding
    from diffusers_stepbatch.decoders.pid.configs import get_official_config
    from diffusers_stepbatch.testing import tiny_clip_tokenizer, tiny_t5_tokenizer

    real = pair == "real"
    transformer_config = pid_scaled.REAL_FLUX_TRANSFORMER if real else pid_scaled.SCALED_FLUX_TRANSFORMER
    vae_config = pid_scaled.REAL_FLUX_VAE if real else pid_scaled.scaled_vae_config()
    pid_config = get_official_config(pid_scaled.PID_CHECKPOINT).constructor if real else pid_scaled.scaled_pid_config()
    scheduler = dict(pid_scaled.SCHEDULER_CONFIG)
    if real:
        scheduler.update(base_image_seq_len=256, max_image_seq_len=4096)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = FluxTransformer2DModel(**transformer_config).to(dtype).eval()
        vae = AutoencoderKL(**vae_config).to(dtype).eval()
        clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        text_encoder = CLIPTextModel(CLIPTextConfig(
            bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id, hidden_size=transformer_config["pooled_projection_dim"],
            intermediate_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=len(clip_tokenizer),
            max_position_embeddings=clip_tokenizer.model_max_length,
        )).to(dtype).eval()  # fmt: skip
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tokenizer), d_model=transformer_config["joint_attention_dim"], d_kv=64, d_ff=256,
            num_layers=1, num_heads=4, pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
            decoder_start_token_id=0,
        )).to(dtype).eval()  # fmt: skip
        decoder = PiDDecoder(**pid_config).to(dtype).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), vae=vae, text_encoder=text_encoder,
        tokenizer=clip_tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    captions = _StandInCaptions(pid_config["txt_max_length"], pid_config["txt_embed_dim"], device, dtype)
    return pipe, PiDDecoding(decoder, text_encoder=captions)


def worker(side: str, concurrency: int, args: argparse.Namespace) -> dict:
    import torch

    from diffusers_stepbatch import StepBatched

    cuda = args.device.startswith("cuda")
    base_kib = _rss_kib("VmRSS")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pipe, decoding = build(args.pair, args.device, dtype)
    if cuda:  # NOTE: after the build, whose float32 init is transient; the peak still counts the resident weights
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sb = StepBatched(pipe, decoder=decoding if side == "pid" else None,
                     pid_exit_step=args.exit_step if side == "pid" else None)
    size = args.output

    def round_(seed: int, count: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        handles = [sb.submit(f"a photo of scene {seed + i}", height=size, width=size, num_inference_steps=args.steps,
                             guidance_scale=3.5, max_sequence_length=args.max_sequence_length, output_type="pt",
                             generator=torch.Generator().manual_seed(seed + i)) for i in range(count)]  # fmt: skip
        outputs = [h.result().images for h in handles]
        if cuda:
            torch.cuda.synchronize()
        assert all(o.shape[-2:] == (size, size) for o in outputs)
        return time.perf_counter() - started

    round_(1000, 1)  # warm-up
    times = [round_(r * concurrency, concurrency) for r in range(args.repeats)]
    sb.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else (_rss_kib("VmHWM") - base_kib) / 2**20
    return {"side": side, "concurrency": concurrency, "latency_s": min(times), "latency_all_s": times,
            "peak_memory_gib": peak, "memory_measure": "torch.cuda.max_memory_allocated" if cuda else "peak RSS",
            "engine_calls": sb.stats()["rows_histogram"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("real", "scaled"), default="real")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--output", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--exit-step", type=int, default=24)
    parser.add_argument("--max-sequence-length", type=int, default=None, help="default 512 (real), 32 (scaled)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pid_gpu.json")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-concurrency", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_sequence_length is None:
        args.max_sequence_length = 512 if args.pair == "real" else 32
    if args.worker:
        print(json.dumps(worker(args.worker, args.worker_concurrency, args)))
        return
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    rows = []
    for concurrency in args.concurrency:
        sides = {}
        for side in SIDES:
            command = [sys.executable, __file__, *forwarded, "--worker", side, "--worker-concurrency", str(concurrency)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{side} x{concurrency} failed:\n{done.stderr[-3000:]}")
            sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
        full, pid = sides["full"], sides["pid"]
        row = {"concurrency": concurrency, "full": full, "pid": pid,
               "speedup": full["latency_s"] / pid["latency_s"],
               "latency_change": pid["latency_s"] / full["latency_s"] - 1,
               "memory_saving": 1 - pid["peak_memory_gib"] / full["peak_memory_gib"]}  # fmt: skip
        rows.append(row)
        print(f"{concurrency} request(s) of {args.output}px: full {full['latency_s']:.2f} s {full['peak_memory_gib']:.2f} "
              f"GiB, pid {pid['latency_s']:.2f} s {pid['peak_memory_gib']:.2f} GiB -> {row['speedup']:.2f}x faster "
              f"({100 * row['latency_change']:.1f}%), {100 * row['memory_saving']:.1f}% less memory")  # fmt: skip
    report = {"command": "python benchmarks/pid_gpu.py " + " ".join(forwarded), "pair": args.pair,
              "device": args.device, "dtype": args.dtype, "output": args.output, "steps": args.steps,
              "exit_step": args.exit_step, "seed_document": SEED_DOCUMENT, "results": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
