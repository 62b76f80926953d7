"""The fused scheduler update: all requests' CFG combine + flow-matching Euler step of an engine step as one call,
bit-identical to each request's own `scheduler.step`."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.buffers import LatentBuffers
from diffusers_stepbatch.engine.batch import make_batch, run_batch, split
from diffusers_stepbatch.programs import fused_update
from diffusers_stepbatch.programs.fused_update import FusedEuler

from .references import family_pipe, family_size, flux_pipe, in_lockstep


def _scheduler(steps: int, mu: float, kind: str = "flow"):
    """A flow-matching scheduler (`mu`: its shift) or an Euler one (`mu` picks Karras sigmas or not)."""
    if kind == "flow":
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        scheduler.set_timesteps(steps, mu=mu)
    else:
        scheduler = EulerDiscreteScheduler(use_karras_sigmas=mu > 0.7, timestep_spacing="trailing")
        scheduler.set_timesteps(steps)
    scheduler.set_begin_index(0)
    return scheduler


def _run_together(generators):
    """Drive each request's update generator to its work item, run them as one batched call, return results."""
    items = [next(generator) for generator in generators]
    assert all(item.immediate and item.kind == "update" for item in items)
    assert len({item.key for item in items}) == 1, "the requests' updates share one compatibility key"
    batch = make_batch(items)
    parts = split(run_batch(batch), batch.bounds)
    results = []
    for generator, rows in zip(generators, parts):
        with pytest.raises(StopIteration) as stop:
            generator.send(rows)
        results.append(stop.value.value)
    return results


@pytest.mark.parametrize("kind", ["flow", "euler"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("shape, pooled", [((2, 16, 8), False), ((1, 6, 64), True), ((3, 5, 4, 4), True)])
def test_fused_update_is_each_schedulers_own_step_bit_for_bit(kind, dtype, guided, shape, pooled):
    generator = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    buffers = LatentBuffers() if pooled else None
    # four requests at different steps of different schedules, each with its own CFG scale
    plans = [(4, 0.5, 0), (7, 1.1, 3), (5, 0.8, 4), (9, 0.3, 1)]
    generators, expected, schedulers, references = [], [], [], []
    for steps, mu, index in plans:
        scheduler, reference = _scheduler(steps, mu, kind), _scheduler(steps, mu, kind)
        scheduler._step_index = reference._step_index = index  # both at the same step
        sample = torch.randn(shape, generator=generator).to(dtype)
        cond = torch.randn(shape, generator=generator).to(dtype)
        uncond = torch.randn(shape, generator=generator).to(dtype) if guided else None
        scale = 1.5 + index if guided else None
        t = scheduler.timesteps[index]
        guided_pred = uncond + scale * (cond - uncond) if guided else cond
        expected.append(reference.step(guided_pred, t, sample, return_dict=False)[0])
        references.append(reference)
        workspace = buffers.workspace() if buffers is not None else None
        update = FusedEuler.for_scheduler(scheduler, sample, buffers, workspace)
        assert update is not None
        generators.append(update.step(t, sample, cond, uncond, scale))
        schedulers.append(scheduler)
    results = _run_together(generators)
    for got, want, scheduler, reference in zip(results, expected, schedulers, references):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert scheduler.step_index == reference.step_index  # each request's scheduler advanced


def test_pooled_results_are_each_requests_own_and_survive_the_next_update():
    buffers = LatentBuffers()
    schedulers = [_scheduler(6, 0.5), _scheduler(6, 0.9)]
    samples = [torch.randn(2, 8, 4), torch.randn(1, 8, 4)]
    updates = [FusedEuler.for_scheduler(s, x, buffers, buffers.workspace()) for s, x in zip(schedulers, samples)]
    first = _run_together([u.step(s.timesteps[0], x, torch.randn_like(x)) for u, s, x in
                           zip(updates, schedulers, samples)])
    kept = [r.clone() for r in first]
    second = _run_together([u.step(s.timesteps[1], x, torch.randn_like(x)) for u, s, x in
                            zip(updates, schedulers, first)])
    assert all(torch.equal(a, b) for a, b in zip(first, kept)), "a step overwrote the latents it read"
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))


def test_schedulers_without_a_stateless_step_keep_their_own():
    sample = torch.zeros(1, 4, 4)
    stochastic = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    assert FusedEuler.for_scheduler(stochastic, sample) is None
    assert FusedEuler.for_scheduler(EulerDiscreteScheduler(prediction_type="v_prediction"), sample) is None
    assert FusedEuler.for_scheduler(DPMSolverMultistepScheduler(), sample) is None  # keeps a history
    assert FusedEuler.for_scheduler(EulerDiscreteScheduler(), sample) is not None

    class Custom(FlowMatchEulerDiscreteScheduler):  # a subclass may change `step`
        pass

    assert FusedEuler.for_scheduler(Custom(), sample) is None


def test_a_dtype_whose_rounding_differs_falls_back(monkeypatch):
    monkeypatch.setattr(fused_update, "_rows_match_scalars_cached", lambda device, dtype, kind: False)
    assert FusedEuler.for_scheduler(_scheduler(4, 0.5), torch.zeros(1, 4, 4, dtype=torch.bfloat16)) is None
    assert FusedEuler.for_scheduler(_scheduler(4, 0.5), torch.zeros(1, 4, 4)) is not None  # fp32 needs no probe


def _flux_calls(steps):
    base = dict(height=32, width=32, max_sequence_length=16, output_type="pt")
    return [
        dict(base, prompt="a red circle", seed=1, num_inference_steps=steps),
        dict(base, prompt="a blue square", seed=2, num_inference_steps=steps + 1, negative_prompt="noise",
             true_cfg_scale=2.0),
        dict(base, prompt="a cat", seed=3, num_inference_steps=steps, num_images_per_prompt=2),
        dict(base, prompt="a dog", seed=4, num_inference_steps=steps + 2, negative_prompt="blur",
             true_cfg_scale=3.5, guidance_scale=5.0),
    ]


def _family_calls(name, steps):
    height, width = family_size(name)
    base = dict(height=height, width=width, output_type="pt")
    if name.startswith("sd-") or name.startswith("sdxl"):
        return [dict(base, prompt="a", seed=1, num_inference_steps=steps, guidance_scale=5.0),
                dict(base, prompt="b", seed=2, num_inference_steps=steps + 1, guidance_scale=1.0),
                dict(base, prompt="c", seed=3, num_inference_steps=steps + 2, guidance_scale=7.0,
                     guidance_rescale=0.5),
                dict(base, prompt="d", seed=4, num_inference_steps=steps, guidance_scale=3.0,
                     num_images_per_prompt=2)]
    if name.startswith("sd3"):
        return [dict(base, prompt="a", seed=1, num_inference_steps=steps, guidance_scale=5.0),
                dict(base, prompt="b", seed=2, num_inference_steps=steps + 1, guidance_scale=1.0),
                dict(base, prompt="c", seed=3, num_inference_steps=steps + 2, guidance_scale=4.0,
                     skip_guidance_layers=[0], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)]
    return [dict(base, prompt="a", seed=1, num_inference_steps=steps),
            dict(base, prompt="b", seed=2, num_inference_steps=steps + 1, true_cfg_scale=3.0, negative_prompt="x")]


def _outputs_with_and_without_fusion(monkeypatch, pipe, calls, **options):
    config = SchedulerConfig(max_batch_size=16, cost_aware=False)
    sb = StepBatched(pipe, scheduler=config, **options)
    fused = in_lockstep(sb, calls)
    update_rows = sb.stats()["rows_histogram"].get("update", {})
    sb.close()
    with monkeypatch.context() as patch:
        patch.setattr(FusedEuler, "for_scheduler", classmethod(lambda cls, *args, **kwargs: None))
        sb = StepBatched(pipe, scheduler=config, **options)
        alone = in_lockstep(sb, calls)
        assert "update" not in sb.stats()["rows_histogram"]
        sb.close()
    return fused, alone, update_rows


@pytest.mark.parametrize("flux_name", ["dev-tiny", "schnell-tiny"])
@pytest.mark.parametrize("steps, latent_buffers", [(2, True), (3, False)])
def test_flux_requests_share_one_update_per_step_bit_identical(monkeypatch, flux_name, steps, latent_buffers):
    fused, alone, update_rows = _outputs_with_and_without_fusion(monkeypatch, flux_pipe(flux_name),
                                                                 _flux_calls(steps), latent_buffers=latent_buffers)
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)
    # while all four run: one update for the three images without true CFG, one for the two guided ones
    assert update_rows[3] == steps and update_rows[2] >= steps, update_rows


@pytest.mark.parametrize("name", ["sd3-tiny", "sd3-patch2", "qwen-tiny", "qwen-wide", "sdxl-euler", "sd-euler"])
def test_other_families_requests_share_one_update_per_step_bit_identical(monkeypatch, name):
    calls = _family_calls(name, 2)
    fused, alone, update_rows = _outputs_with_and_without_fusion(monkeypatch, family_pipe(name), calls)
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)
    assert max(update_rows) >= 2, update_rows


def test_the_update_runs_in_the_same_engine_step_as_the_forward():
    pipe = flux_pipe()
    sb = StepBatched(pipe, scheduler=SchedulerConfig(cost_aware=False))
    steps = 3
    in_lockstep(sb, [dict(prompt="a", seed=0, height=32, width=32, num_inference_steps=steps,
                          max_sequence_length=16, output_type="pt")])
    stats = sb.stats()
    sb.close()
    # encode, one step per denoising step (forward + its update), decode: no engine step for updates alone
    assert stats["engine_steps"] == 1 + steps + 1
    assert sum(stats["rows_histogram"]["update"].values()) == steps

