"""A compiled transformer keeps working under StepBatched, compiled either way diffusers' docs show
(`pipe.transformer.compile(...)` in place, or `pipe.transformer = torch.compile(pipe.transformer, ...)`): its
batched forwards run the compiled code, one dynamic graph serves every row count, and outputs equal solo runs."""

import pytest
import torch

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline, tiny_qwenimage_pipeline, tiny_sd3_pipeline

from .references import TOLERANCE, in_lockstep, max_diff, seeded

# NOTE: the "eager" backend traces with dynamo (guards, graph breaks, recompiles) without inductor's codegen
BACKEND = "eager"


def requests_of(sizes):
    return [dict(prompt=f"a red circle {i}", height=h, width=w, num_inference_steps=2 + i % 2, seed=i,
                 guidance_scale=2.0 + i, output_type="pt", max_sequence_length=16) for i, (h, w) in enumerate(sizes)]


def compile_in_place(pipe):
    pipe.transformer.compile(dynamic=True, backend=BACKEND)


def compile_as_new_module(pipe):
    pipe.transformer = torch.compile(pipe.transformer, dynamic=True, backend=BACKEND)


class CompiledCalls:
    """Row counts of the calls that ran the transformer's compiled code: `nn.Module.compile` sets
    `_compiled_call_impl`, which `module(...)` then calls instead of the eager forward; `torch.compile` returns an
    `OptimizedModule` whose `forward` is the compiled one."""

    def __init__(self, module):
        self.rows: list[int] = []
        name = "forward" if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else "_compiled_call_impl"
        compiled = getattr(module, name)

        def counted(*args, **kwargs):
            self.rows.append(kwargs["hidden_states"].shape[0])
            return compiled(*args, **kwargs)

        setattr(module, name, counted)


@pytest.mark.parametrize("size, sizes", [
    (FluxSize(), [(32, 32)] * 4),
    (FluxSize(num_layers=2, num_single_layers=1, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=24,
              pooled_projection_dim=40, in_channels=8), [(32, 32), (32, 32), (48, 32), (32, 32), (48, 32)]),
])
@pytest.mark.parametrize("compile_transformer", [compile_in_place, compile_as_new_module])
def test_a_compiled_transformer_runs_compiled_in_batches_and_equals_solo(size, sizes, compile_transformer):
    torch._dynamo.reset()
    pipe = tiny_flux_pipeline(guidance_embeds=True, size=size, vae_blocks=2)  # its own: compiling changes it
    compile_transformer(pipe)
    requests = requests_of(sizes)
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    compiled = CompiledCalls(pipe.transformer)
    compilations = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    sb = StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8, cost_aware=False), mixed_resolution=False)
    try:
        got = in_lockstep(sb, requests)
    finally:
        sb.close()
    for kwargs, image, want in zip(requests, got, expected):
        assert max_diff(image, want) <= TOLERANCE, kwargs
    assert compiled.rows and max(compiled.rows) > 1, "no batched forward ran the compiled transformer"
    assert len(set(compiled.rows)) >= 2  # several row counts (requests with 2 and 3 steps)...
    # ...and at most one new graph for all of them (dynamic batch), not one per row count
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compilations <= 1


# the MMDiT families that pack mixed sizes: (pipeline, what their requests add)
PACKING_FAMILIES = {
    "flux": (lambda: tiny_flux_pipeline(guidance_embeds=True, vae_blocks=2), {}),
    "sd3": (tiny_sd3_pipeline, {"max_sequence_length": None}),
    "qwenimage": (tiny_qwenimage_pipeline, {"max_sequence_length": None, "true_cfg_scale": 2.0,
                                            "negative_prompt": "blurry"}),
}


@pytest.mark.parametrize("family", sorted(PACKING_FAMILIES))
@pytest.mark.parametrize("compile_transformer", [compile_in_place, compile_as_new_module])
def test_mixed_sizes_still_pack_around_a_compiled_transformer(family, compile_transformer):
    # packed calls drive the transformer's submodules (eagerly): sizes still share calls, outputs stay exact
    torch._dynamo.reset()
    build, extra = PACKING_FAMILIES[family]
    pipe = build()
    compile_transformer(pipe)
    requests = [{k: v for k, v in {**kwargs, **extra}.items() if v is not None}
                for kwargs in requests_of([(32, 32), (48, 32), (16, 48), (32, 32)])]
    expected = [pipe(**seeded(kwargs)).images for kwargs in requests]
    sb = StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8, cost_aware=False))
    try:
        got = in_lockstep(sb, requests)
        mixed = sb.stats()["mixed"]
    finally:
        sb.close()
    for kwargs, image, want in zip(requests, got, expected):
        assert max_diff(image, want) <= TOLERANCE, kwargs
    assert mixed["calls"] > 0 and mixed["sizes_per_call"] >= 2
