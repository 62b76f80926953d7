"""A request's two denoiser calls of a step run as one engine call (`programs/generic/branch_pairs.py`): the second
call is predicted from the step before, computed with the first, and answered only if it matches."""

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.programs.generic.branch_pairs import BranchPairs, same
from diffusers_stepbatch.toy.video import tiny_wan_pipeline

from .references import TOLERANCE, count_forwards, engine_held, max_diff, seeded


class _Denoiser(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width + 1, 32), torch.nn.SiLU(), torch.nn.Linear(32, width))

    def forward(self, x, t, context):
        return self.net(torch.cat([x + context, t[:, None]], dim=1))


class _TwoCallsPipeline(DiffusionPipeline):
    """Two denoiser calls per step: a CFG pair, or (`dependent`) a second call that reads the first's output,
    or (`truncate_after`) CFG dropped after some steps, as CFG truncation does."""

    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, num_inference_steps: int = 4, guidance_scale: float = 3.0, generator=None,
                 dependent: bool = False, truncate_after: int | None = None, callback_on_step_end=None):
        x = torch.randn(2, 8, generator=generator)
        cond, uncond = torch.randn(2, 8, generator=generator), torch.zeros(2, 8)
        self.scheduler.set_timesteps(num_inference_steps)
        for i, t in enumerate(self.scheduler.timesteps):
            timestep = t.expand(2) / 1000
            first = self.transformer(x, timestep, context=cond)
            if truncate_after is None or i < truncate_after:
                second = self.transformer(first if dependent else x, timestep, context=uncond)
                first = second + guidance_scale * (first - second)
            x = self.scheduler.step(first, t, x).prev_sample
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, t, {})
        return x


def _pipe():
    torch.manual_seed(0)
    pipe = _TwoCallsPipeline(_Denoiser().eval(), FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("case, paired", [({}, True), (dict(dependent=True), False),
                                          (dict(truncate_after=2), True)])
def test_second_calls_are_answered_only_where_they_match_their_prediction(case, paired):
    pipe = _pipe()
    requests = [dict(case, seed=i, num_inference_steps=4 + i % 2, guidance_scale=2.0 + i) for i in range(3)]
    expected = [pipe(**seeded(kwargs)) for kwargs in requests]
    with StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=32, cost_aware=False)) as sb:
        rows, handle = count_forwards(pipe.transformer)
        with engine_held(sb, dict(seed=9, num_inference_steps=1)):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(60) for future in futures]
        handle.remove()
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
    if paired:  # from step 1 on, a request's step is one call of 4 rows: one forward holds every request's pair
        assert max(rows) == 4 * len(requests)
    else:  # a second call on the first's output is no branch pair: never predicted, each call runs as it comes
        assert max(rows) <= 2 * len(requests), rows


@pytest.mark.parametrize("frames, sizes", [(5, [(16, 32), (32, 32), (16, 16)]), (9, [(32, 16), (16, 32), (32, 32)])])
def test_wan_requests_run_one_denoise_call_per_step_and_equal_plain_runs(frames, sizes):
    pipe = tiny_wan_pipeline(layers=1)
    requests = [dict(prompt=f"a kite {i}", negative_prompt="blur", height=h, width=w, num_frames=frames,
                     num_inference_steps=3 + i, guidance_scale=4.0 + i, max_sequence_length=16, output_type="pt",
                     seed=i) for i, (h, w) in enumerate(sizes)]
    expected = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    plain_rows, handle = count_forwards(pipe.transformer)
    for kwargs in requests:
        pipe(**seeded(kwargs))
    handle.remove()
    config = SchedulerConfig(max_batch_size=32, cost_aware=False)
    with StepBatched(pipe, scheduler=config, mixed_resolution=False) as sb:  # one call per shape and step
        rows, handle = count_forwards(pipe.transformer)
        futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(120).frames for future in futures]
        handle.remove()
    for got, want in zip(results, expected):
        assert max_diff(got, want) <= TOLERANCE
    # each request: its first step's two calls, then one call of both branches per step
    assert len(rows) <= sum(1 + r["num_inference_steps"] for r in requests) < len(plain_rows)
    assert max(rows) >= 2


def test_prediction_takes_the_first_calls_objects_and_keeps_the_others():
    latents, timestep, positive, negative, kwargs = torch.ones(1), torch.zeros(1), torch.ones(2), torch.zeros(2), {}
    pairs = BranchPairs()
    assert pairs.predict(0, ((latents, timestep), dict(context=positive, extra=kwargs))) is None  # no step before
    assert pairs.answer(0, ((latents, timestep), dict(context=negative, extra=kwargs))) == (False, None)
    pairs.predict(0, ((latents, timestep), dict(context=negative, extra=kwargs)))
    new_latents, new_timestep = torch.full((1,), 2.0), torch.ones(1)
    args, named = pairs.predict(1, ((new_latents, new_timestep), dict(context=positive, extra=kwargs)))
    assert args[0] is new_latents and args[1] is new_timestep
    assert named["context"] is negative and named["extra"] is kwargs


def test_same_compares_objects_values_and_containers():
    a = torch.arange(4.0)
    assert same(a, a.clone()) and not same(a, a + 1) and not same(a, a.double())
    assert same({"x": [a, 1]}, {"x": [a.clone(), 1]}) and not same({"x": [a, 1]}, {"x": (a, 1)})
    assert not same(a, None) and same(None, None) and not same(1, 1.0)


def _negative_changed_at(step: int):
    """A step callback that replaces the negative prompt's embeddings at `step`: the next step's second call
    then differs from its prediction."""
    def callback(pipe, i, t, tensors):
        return {"negative_prompt_embeds": tensors["negative_prompt_embeds"] * 1.5} if i == step else {}
    return callback


@pytest.mark.parametrize("change_at", [None, 1, 3])
# NOTE: (threshold, coefficients): 0.8 with Wan's polynomial skips most steps; with the identity polynomial and a
# tiny threshold nearly every step computes, so a predicted second call that missed computed its residual and
# commits it, which its real call must not see
@pytest.mark.parametrize("teacache", [None, (0.8, None), (1e-3, (1.0, 0.0))])
def test_wan_pairs_keep_teacache_per_branch_and_undo_a_missed_prediction(change_at, teacache, monkeypatch):
    """Each request equals its solo run without branch pairs: a missed prediction gives back its TeaCache state
    as it was before the predicted rows ran."""
    from diffusers_stepbatch.cache import TeaCacheConfig

    pipe = tiny_wan_pipeline(layers=1)
    requests = [dict(prompt=f"a kite {i}", negative_prompt="blur", height=16, width=32, num_frames=5,
                     num_inference_steps=10 + i, guidance_scale=4.0 + i, max_sequence_length=16,
                     output_type="latent", seed=i) for i in range(3)]  # NOTE: latents: the tiny VAE shrinks changes
    for kwargs in requests[:2]:
        if change_at is not None:
            kwargs.update(callback_on_step_end=_negative_changed_at(change_at),
                          callback_on_step_end_tensor_inputs=["negative_prompt_embeds"])
    config = SchedulerConfig(max_batch_size=32, cost_aware=False)
    cache = None if teacache is None else TeaCacheConfig(threshold=teacache[0], coefficients=teacache[1], min_steps=3)
    with StepBatched(pipe, scheduler=config, teacache=cache) as sb, monkeypatch.context() as unpaired:
        unpaired.setattr(BranchPairs, "predict", lambda self, step, call: None)
        solo = [sb(**seeded(kwargs)).frames for kwargs in requests]
    with StepBatched(pipe, scheduler=config, teacache=cache) as sb:
        with engine_held(sb, dict(requests[2], num_inference_steps=1, callback_on_step_end=None)):
            sb.reset_stats()
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        results = [future.result(120).frames for future in futures]
        rows = sb.stats()["rows_histogram"]["denoise"]
    plain = [pipe(**seeded(kwargs)).frames for kwargs in requests]
    for got, want, exact in zip(results, solo, plain):
        assert max_diff(got, want) <= TOLERANCE
        if teacache is None:
            assert max_diff(got, exact) <= TOLERANCE
        elif teacache[1] is None:  # TeaCache skipped steps
            assert max_diff(want, exact) > 1e-4
    assert max(rows) == 2 * len(requests), rows  # every request's pair of calls in one forward
