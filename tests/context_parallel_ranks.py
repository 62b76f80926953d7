"""What each rank runs in the context-parallel tests (`tests/test_context_parallel.py` starts two of them, with
torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    families OUT NAME...  `checks`, then per family: rank 0 runs four requests through the plain pipeline
                          (before any rank switches context parallelism on), then the same four concurrently
                          through `StepBatched(pipe, parallel=...)` while rank 1 follows; each rank writes what
                          it saw.
    kill OUT              rank 0 runs long requests; the test kills rank 1 once rank 0 writes OUT/mid-run.
    checks OUT            what every rank gets for a config these ranks can't run (Ring on the CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from diffusers import ContextParallelConfig
from diffusers_stepbatch import StepBatched, TeaCacheConfig
from diffusers_stepbatch.testing import tiny_flux_pipeline
from diffusers_stepbatch.testing.hunyuan_video_models import tiny_hunyuan_video15_pipeline
from diffusers_stepbatch.testing.image_models import tiny_flux2_pipeline, tiny_z_image_pipeline
from diffusers_stepbatch.testing.ltx_models import LTX2_PLAIN, LTX2Size, tiny_ltx2_pipeline
from diffusers_stepbatch.testing.pipelines import tiny_qwenimage_pipeline
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

ULYSSES_2 = dict(ulysses_degree=2)


def _image_calls(sizes, **common):
    return [dict(prompt="a cat " * (i + 1), height=height, width=width, num_inference_steps=2 + i % 3, seed=i,
                 output_type="pt", **common) for i, (height, width) in enumerate(sizes)]


def _video_calls(sizes, **common):
    return [dict(prompt="a fox " * (i + 1), height=height, width=width, num_frames=frames,
                 num_inference_steps=2 + i % 2, seed=i, output_type="pt", **common)
            for i, (height, width, frames) in enumerate(sizes)]


# family -> (pipeline builder, four calls: sizes or frame counts, steps, seeds and prompt lengths all differ; the
# image tokens of FLUX.1's 36x36 (81) and Wan's 9 frames at 16x16 (3) don't divide by two ranks)
FAMILIES = {
    "flux": (tiny_flux_pipeline, _image_calls([(32, 32), (32, 48), (48, 32), (36, 36)])),
    "flux2": (tiny_flux2_pipeline, _image_calls([(32, 32), (32, 48), (48, 32), (32, 32)],
                                                text_encoder_out_layers=(1,), max_sequence_length=32)),
    "qwenimage": (tiny_qwenimage_pipeline, _image_calls([(16, 16), (16, 32), (32, 16), (16, 16)])),
    "z-image": (tiny_z_image_pipeline, _image_calls([(32, 32), (32, 64), (64, 32), (32, 32)])),
    "wan2.1": (tiny_wan_pipeline, _video_calls([(16, 16, 5), (16, 32, 9), (32, 16, 13), (16, 16, 9)],
                                               max_sequence_length=16)),
    "wan2.2": (lambda: tiny_wan_pipeline(experts=True),
               _video_calls([(16, 16, 5), (16, 32, 9), (32, 16, 5), (16, 16, 5)], max_sequence_length=16)),
    "ltx2": (tiny_ltx2_pipeline, _video_calls([(32, 32, 9), (32, 64, 9), (64, 32, 17), (32, 32, 5)],
                                              frame_rate=25.0, **LTX2_PLAIN)),
    # LTX-2.3's interleaved RoPE, gated attention and timestep-modulated prompt
    "ltx2.3": (lambda: tiny_ltx2_pipeline(LTX2Size(heads=4, head_dim=8, audio_heads=2, audio_head_dim=8,
                                                   rope_type="interleaved", gated_attn=True, cross_attn_mod=True)),
               _video_calls([(32, 32, 9), (32, 64, 17), (64, 32, 9), (32, 32, 5)], frame_rate=25.0,
                            **LTX2_PLAIN)),
    "hunyuan-video-1.5": (tiny_hunyuan_video15_pipeline,
                          _video_calls([(16, 16, 5), (16, 32, 9), (32, 16, 5), (16, 16, 5)])),
}


def _seeded(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(kwargs.pop("seed"))
    return kwargs


def _output(result) -> torch.Tensor:
    return torch.as_tensor(result.frames if hasattr(result, "frames") else result.images)


def _write(out: Path, name: str, seen: dict) -> None:
    (out / f"{name}.rank{os.environ['RANK']}.json").write_text(json.dumps(seen))


def run_family(name: str, out: Path) -> None:
    build, calls = FAMILIES[name]
    pipe = build()
    pipe.set_progress_bar_config(disable=True)
    rank = int(os.environ["RANK"])
    expected = [_output(pipe(**_seeded(kwargs))) for kwargs in calls] if rank == 0 else None
    sb = StepBatched(pipe, parallel=ContextParallelConfig(**ULYSSES_2))
    if sb.rank > 0:
        _write(out, name, {"calls_followed": sb.follow()})
        return
    handles = [sb.submit(**_seeded(kwargs)) for kwargs in calls]
    outputs = [_output(handle.result()) for handle in handles]
    refused = {}
    for option, value in (("teacache", TeaCacheConfig(threshold=0.2)), ("adapters", {"a": 1.0})):
        try:
            sb.submit(**_seeded(calls[0]), **{option: value})
            refused[option] = "accepted"
        except ValueError as exc:
            refused[option] = str(exc)
    stats = sb.stats()
    sb.close()
    _write(out, name, dict(differences=[(got - want).abs().max().item() for got, want in zip(outputs, expected)],
                           shapes=[list(output.shape) for output in outputs], splits=stats["splits"],
                           parallel=stats["parallel"], mixed=stats["mixed"],
                           steps=sum(kwargs["num_inference_steps"] for kwargs in calls), refused=refused))


def run_kill(out: Path) -> None:
    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    sb = StepBatched(pipe, parallel=ContextParallelConfig(**ULYSSES_2))
    if sb.rank > 0:
        (out / "follower.pid").write_text(str(os.getpid()))
        sb.follow()
        return

    def mark_mid_run(pipeline, step, timestep, tensors):
        if step == 3:
            (out / "mid-run").touch()
        return tensors

    handles = [sb.submit(prompt="a cat", height=32, width=32 + 16 * i, num_inference_steps=400,
                         callback_on_step_end=mark_mid_run if i == 0 else None, output_type="pt")
               for i in range(3)]
    outcomes = []
    for handle in handles:
        try:
            handle.result(timeout=120)
            outcomes.append("finished")
        except Exception as exc:  # noqa: BLE001 - what the caller sees is the point
            outcomes.append(f"{type(exc).__name__}: {exc}")
    started = time.perf_counter()
    try:
        sb(prompt="a dog", height=32, width=32, num_inference_steps=2)
        later = "finished"
    except Exception as exc:  # noqa: BLE001
        later = f"{type(exc).__name__}: {exc}"
    seconds_later = time.perf_counter() - started
    lost = sb.stats()["parallel"]["lost"]
    sb.close()
    _write(out, "kill", dict(outcomes=outcomes, later=later, later_seconds=seconds_later, lost=lost))


def run_checks(out: Path) -> None:
    pipe = tiny_flux_pipeline()
    try:
        StepBatched(pipe, parallel=ContextParallelConfig(ring_degree=2))
        ring = "accepted"
    except ValueError as exc:
        ring = str(exc)
    _write(out, "checks", dict(ring=ring))


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "families":
        run_checks(directory)
        for family in sys.argv[3:]:
            started = time.perf_counter()
            run_family(family, directory)
            print(f"rank {os.environ['RANK']}: {family} in {time.perf_counter() - started:.1f} s", flush=True)
    elif mode == "kill":
        run_kill(directory)
    else:
        run_checks(directory)
