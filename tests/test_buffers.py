"""Latent buffer manager: bit-identical outputs, no allocations per step in the loop, safe reuse."""

import copy

import pytest
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.buffers import AllocationCounter, LatentBuffers, StepWorkspace
from diffusers_stepbatch.engine.scheduler import SchedulerConfig

from .references import flux_pipe, seeded

SIZES = {"dev-tiny": (32, 32), "schnell-tiny": (32, 48), "dev-wide": (24, 40)}


def kwargs_for(name, prompt="a red circle", **overrides):
    height, width = SIZES[name]
    kwargs = dict(prompt=prompt, height=height, width=width, num_inference_steps=4, seed=0, output_type="pt",
                  max_sequence_length=16)
    kwargs.update(overrides)
    return kwargs


def mixed_calls(name):
    return [
        kwargs_for(name, "a red circle", seed=1, num_inference_steps=3),
        kwargs_for(name, "a blue square", seed=2, num_inference_steps=5, guidance_scale=6.0,
                   negative_prompt="noise", true_cfg_scale=2.0),
        kwargs_for(name, "a cat", seed=3, num_inference_steps=4, num_images_per_prompt=2),
        kwargs_for(name, "a dog", seed=4, num_inference_steps=6, output_type="latent"),
    ]


def drive(sb, calls, counter=None):
    """Run `calls` in deterministic batches on a fresh `sb`, driving its engine in this thread.

    With a counter, allocations are counted only in engine steps where every pending item is a denoise item.
    Returns (outputs, allocations per counted step).
    """
    assert not sb.engine.is_alive
    requests = [sb._make_request((), seeded(kwargs), 0, None) for kwargs in calls]
    for request in requests:
        sb.engine.scheduler.add(request)
    per_step = []
    with torch.no_grad():
        while sb.engine.scheduler.has_work():
            pending = [r.pending for r in sb.engine.scheduler.running]
            in_loop = counter is not None and pending and all(p is not None and p.kind == "denoise" for p in pending)
            before = counter.count if in_loop else 0
            sb.engine.step()
            if in_loop:
                per_step.append(counter.count - before)
    return [request.handle.result().images for request in requests], per_step


@pytest.mark.parametrize("true_cfg", [False, True])
def test_solo_outputs_bit_identical_with_and_without_buffers(flux_name, true_cfg):
    pipe = flux_pipe(flux_name)
    extra = dict(negative_prompt="blurry", true_cfg_scale=2.5) if true_cfg else {}
    kwargs = kwargs_for(flux_name, guidance_scale=3.0, num_images_per_prompt=2, **extra)
    with StepBatched(pipe) as buffered, StepBatched(pipe, latent_buffers=False) as plain:
        assert torch.equal(buffered(**seeded(kwargs)).images, plain(**seeded(kwargs)).images)
        inputs = 5 if pipe.transformer.config.guidance_embeds else 4  # the batch inputs, guidance if any
        # the fused update's scratch (programs/fused_update.py): sample, prediction, dt, delta, result, and with
        # true CFG the negative prediction and the guided difference
        update = 7 if true_cfg else 5
        assert buffered.options.buffers.stats()["buffers"] == inputs + update


def test_batched_outputs_bit_identical_with_and_without_buffers(flux_name):
    pipe = flux_pipe(flux_name)
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    buffered, _ = drive(StepBatched(pipe, scheduler=config), mixed_calls(flux_name))
    plain, _ = drive(StepBatched(pipe, scheduler=config, latent_buffers=False), mixed_calls(flux_name))
    for a, b in zip(buffered, plain):
        assert torch.equal(a, b)


def test_denoise_loop_allocates_at_least_90_percent_less():
    pipe = flux_pipe("dev-tiny")
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    # NOTE: latent outputs: no request decodes, so every engine step after the encode is a loop step. Step
    # counts as in real use: the workspaces are allocated once per request, so short loops save less.
    guided, two_images = mixed_calls("dev-tiny")[1:3]
    calls = [dict(guided, output_type="latent", num_inference_steps=28),
             dict(two_images, output_type="latent", num_inference_steps=20)]
    counts = {}
    for buffers in (True, False):
        with AllocationCounter().exclude(pipe.transformer) as counter:
            _, per_step = drive(StepBatched(pipe, scheduler=config, latent_buffers=buffers), calls, counter)
        counts[buffers] = per_step
    assert len(counts[True]) == len(counts[False]) == 28
    # NOTE: with buffers only the first loop step allocates (the pooled inputs, each request's workspace);
    # after that a step allocates nothing outside the transformer.
    assert all(n == 0 for n in counts[True][2:]), counts[True]
    assert all(n > 0 for n in counts[False]), counts[False]
    assert sum(counts[True]) <= 0.1 * sum(counts[False]), counts


def test_stack_reuses_and_grows_the_pool():
    buffers = LatentBuffers()
    rows = [torch.randn(3, 4) for _ in range(4)]
    first = buffers.stack("x", rows[:2])
    assert torch.equal(first, torch.stack(rows[:2]))
    with AllocationCounter() as counter:
        again = buffers.stack("x", rows[2:])
        smaller = buffers.stack("x", rows[:1])
    assert counter.count == 0 and again.data_ptr() == smaller.data_ptr() == first.data_ptr()
    grown = buffers.stack("x", rows)  # more rows than ever: the pool doubles
    assert torch.equal(grown, torch.stack(rows)) and buffers.stats()["grows"] == 2
    other = buffers.stack("y", rows[:2])  # another input with the same row shape never shares a buffer
    assert other.data_ptr() != grown.data_ptr()
    assert buffers.stats() == {"buffers": 2, "bytes": (4 + 2) * 12 * 4, "grows": 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_step_and_guidance_match_the_scheduler_bit_for_bit(dtype):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    reference = copy.deepcopy(scheduler)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, generator=generator).to(dtype)
    expected_latents = latents.clone()
    workspace = StepWorkspace()
    outputs = []
    for t in scheduler.timesteps:
        cond, uncond = (torch.randn(2, 16, 8, generator=generator).to(dtype) for _ in range(2))
        guided = workspace.guide(cond, uncond, 3.5)
        assert torch.equal(guided, uncond + 3.5 * (cond - uncond))
        latents = workspace.scheduler_step(scheduler, guided, t, latents)
        expected_latents = reference.step(uncond + 3.5 * (cond - uncond), t, expected_latents, return_dict=False)[0]
        assert latents.dtype == expected_latents.dtype and torch.equal(latents, expected_latents)
        outputs.append(latents.data_ptr())
    assert len(set(outputs)) == 2 and outputs[0] != outputs[1]  # ping-pong between two buffers
    assert scheduler.step_index == reference.step_index == 6


def test_other_schedulers_fall_back_to_their_own_step():
    scheduler = EulerDiscreteScheduler()
    scheduler.set_timesteps(4)
    reference = copy.deepcopy(scheduler)
    sample = torch.randn(1, 4, 8, 8)
    output = torch.randn(1, 4, 8, 8)
    t = scheduler.timesteps[0]
    got = StepWorkspace().scheduler_step(scheduler, output, t, sample)
    assert torch.equal(got, reference.step(output, t, sample, return_dict=False)[0])


def test_callbacks_see_latents_that_are_never_overwritten():
    pipe = flux_pipe("dev-tiny")
    kept = []

    def keep(step_pipe, i, t, tensors):
        kept.append(tensors["latents"])
        return {}

    kwargs = kwargs_for("dev-tiny", num_inference_steps=4, output_type="latent", callback_on_step_end=keep)
    pipe(**seeded(kwargs))
    expected = [latents.clone() for latents in kept]
    kept.clear()
    with StepBatched(pipe) as sb:
        sb(**seeded(kwargs))
    assert len(kept) == 4 and len({t.data_ptr() for t in kept}) == 4
    assert all(torch.equal(a, b) for a, b in zip(kept, expected))
