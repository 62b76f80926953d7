"""Per-request LoRA: mixed-adapter forwards vs one forward per adapter group, and the per-row path's cost.

    python benchmarks/adapters.py            # tiny Flux, 8 rows over 4 adapters, 9 rounds
    python benchmarks/adapters.py --smoke    # a few seconds

The overhead-bound tiny Flux transformer (`diffusers_stepbatch.testing`) with 4 random LoRA adapters. One
denoising step of 8 rows (2 per adapter) is run four ways, interleaved round by round on a worker thread:

- split (peft): what splitting batches by adapter gives: per group, `set_adapters([name])` + a batch-2 forward;
- split (rows): the same 4 batch-2 forwards through `per_row_lora` (no global state switch);
- mixed: one batch-8 forward through `per_row_lora`, each row its own adapter;
- single adapter (peft): one batch-8 forward with one adapter active (set before timing): the LoRA floor.

And the base model: 8 rows without adapters through `per_row_lora` on the LoRA model ("base rows") vs the same
transformer without any LoRA layers ("no LoRA"), and vs peft with the adapters disabled (`disable_lora()` before
timing). A third part runs 8
concurrent requests end to end through StepBatched: mixed adapters in one engine vs the 4 adapter groups one
after another (each group's 2 requests batched), which is the forward count a split-by-adapter engine gets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from diffusers_stepbatch import StepBatched  # noqa: E402
from diffusers_stepbatch.adapters.lora import per_row_lora  # noqa: E402
from diffusers_stepbatch.testing import (  # noqa: E402
    add_random_lora_adapters,
    tiny_flux_pipeline,
    tiny_flux_transformer,
)

RESULTS = Path(__file__).parent / "results" / "adapters.json"
ADAPTERS = ("a", "b", "c", "d")


def step_inputs(model, rows: int, tokens: int = 16, text: int = 16) -> dict:
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(rows, tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(rows, text, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, cfg.pooled_projection_dim, generator=g),
        timestep=torch.rand(rows, generator=g), guidance=torch.full((rows,), 3.5),
        img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3), return_dict=False,
    )


def rows_of(inputs: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] if k not in ("img_ids", "txt_ids", "return_dict") else v for k, v in inputs.items()}


def forward_sides(lora_model, plain_model, rows: int) -> dict:
    """name -> (setup, a callable running one 8-row denoising step that way); setup runs before its timing."""
    inputs = step_inputs(lora_model, rows)
    per_group = rows // len(ADAPTERS)
    groups = [(name, rows_of(inputs, i * per_group, (i + 1) * per_group)) for i, name in enumerate(ADAPTERS)]
    mixed_rows = [{ADAPTERS[r // per_group]: 1.0} for r in range(rows)]

    def split_peft():
        for name, group in groups:
            lora_model.set_adapters([name])
            lora_model(**group)

    def split_rows():
        for name, group in groups:
            with per_row_lora(lora_model, [{name: 1.0}] * per_group):
                lora_model(**group)

    def mixed():
        with per_row_lora(lora_model, mixed_rows):
            lora_model(**inputs)

    def single_adapter():
        lora_model(**inputs)

    def base_rows():
        with per_row_lora(lora_model, [{}] * rows):
            lora_model(**inputs)

    def peft_disabled():
        lora_model(**inputs)

    def no_lora():
        plain_model(**inputs)

    def enable(names=None):
        lora_model.enable_lora()
        if names:
            lora_model.set_adapters(names)

    return {"split_peft": (enable, split_peft), "split_rows": (enable, split_rows), "mixed": (enable, mixed),
            "single_adapter": (lambda: enable(["a"]), single_adapter), "base_rows": (enable, base_rows),
            "peft_disabled": (lora_model.disable_lora, peft_disabled), "no_lora": (enable, no_lora)}


def time_sides(sides: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each side, sides interleaved round by round."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    with torch.no_grad():
        for setup, side in sides.values():  # warm-up
            setup()
            side()
        for _ in range(rounds):
            for name, (setup, side) in sides.items():
                setup()
                start = time.perf_counter()
                for _ in range(calls):
                    side()
                samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def end_to_end(pipe, steps: int, rounds: int) -> dict[str, float]:
    """Seconds for 8 requests (2 per adapter): all in one engine vs the adapter groups one after another."""
    requests = [dict(prompt=f"a shape {i}", adapters={ADAPTERS[i // 2]: 1.0}, num_inference_steps=steps,
                     height=32, width=32, max_sequence_length=16, output_type="latent",
                     generator=torch.Generator().manual_seed(i)) for i in range(8)]
    samples: dict[str, list[float]] = {"mixed": [], "split": []}
    with StepBatched(pipe, max_batch_size=8, prompt_cache=None) as sb:
        for round_ in range(rounds + 1):
            start = time.perf_counter()
            for future in [sb.submit(**request) for request in requests]:
                future.result()
            mixed = time.perf_counter() - start
            start = time.perf_counter()
            for group in range(len(ADAPTERS)):
                for future in [sb.submit(**request) for request in requests[2 * group:2 * group + 2]]:
                    future.result()
            split = time.perf_counter() - start
            if round_:  # the first round warms up
                samples["mixed"].append(mixed)
                samples["split"].append(split)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20, help="calls per side per round")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request (end to end)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default (fastest for these tiny models on a shared CPU)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (.smoke.json with --smoke)")
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_suffix(".smoke.json") if args.smoke else RESULTS)
    if args.smoke:
        args.rounds, args.calls, args.steps = 2, 3, 2

    result: dict = {}

    def measure():  # NOTE: on a worker thread: main-thread OpenMP ran tiny models up to ~20x slower here
        torch.set_num_threads(args.threads)
        lora_model = tiny_flux_transformer(guidance_embeds=True)
        plain_model = tiny_flux_transformer(guidance_embeds=True)
        add_random_lora_adapters(lora_model, ADAPTERS)
        result["forward_s"] = time_sides(forward_sides(lora_model, plain_model, rows=8), args.rounds, args.calls)
        pipe = tiny_flux_pipeline(guidance_embeds=True)
        add_random_lora_adapters(pipe.transformer, ADAPTERS)
        result["end_to_end_s"] = end_to_end(pipe, args.steps, max(1, args.rounds // 3))

    worker = threading.Thread(target=measure)
    worker.start()
    worker.join()
    f, e = result["forward_s"], result["end_to_end_s"]
    ratios = {
        "mixed_vs_split_peft": f["split_peft"] / f["mixed"],
        "mixed_vs_split_rows": f["split_rows"] / f["mixed"],
        "mixed_cost_vs_single_adapter": f["mixed"] / f["single_adapter"],
        "base_rows_cost_vs_no_lora": f["base_rows"] / f["no_lora"],
        "peft_disabled_cost_vs_no_lora": f["peft_disabled"] / f["no_lora"],
        "end_to_end_mixed_vs_split": e["split"] / e["mixed"],
    }
    print("one 8-row step of tiny Flux, 4 adapters x 2 rows (median ms per step):")
    for name, seconds in f.items():
        print(f"  {name:>16}: {seconds * 1e3:7.3f} ms")
    print(f"end to end, 8 requests x {args.steps} steps: mixed {e['mixed']:.3f} s, groups one after another "
          f"{e['split']:.3f} s")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    print("targets: mixed >= 1.5x split; base rows <= 1.15x of no LoRA")
    out = {"model": "tiny Flux (diffusers_stepbatch.testing.tiny_flux_transformer, guidance_embeds=True)",
           "adapters": list(ADAPTERS), "rows": 8, "rounds": args.rounds, "calls_per_round": args.calls,
           "steps": args.steps, "torch_threads": args.threads, "forward_s": f, "end_to_end_s": e,
           "ratios": ratios, "smoke": args.smoke}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
