"""An idle engine waits for calls still being prepared in their callers' threads (SchedulerConfig.burst_wait_s).

A call's preparation (validation, planning, the caller-side prologue) is held here by blocking its planning on an
event, so what the engine does meanwhile is observable without timing races.
"""

import threading
import time

import pytest

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.scheduler import SchedulerConfig

from .references import TOLERANCE, flux_pipe, max_diff, seeded

LONG = 30.0  # a wait no test may reach: reaching it would show as a test that takes 30 s or more


def kwargs_for(prompt, seed=0, steps=3, side=32, **overrides):
    return dict(prompt=prompt, height=side, width=side, num_inference_steps=steps, seed=seed, output_type="pt",
                max_sequence_length=16, **overrides)


class HeldPreparation:
    """The call with prompt `prompt` blocks in its planning until `release()` (then raises `error`, if given)."""

    def __init__(self, sb, prompt, error=None):
        self.entered, self.released, self.error = threading.Event(), threading.Event(), error
        self.outcome = {}
        plan = sb._plan

        def plan_or_hold(pipe, call_args, context):
            if call_args.get("prompt") == prompt:
                self.entered.set()
                assert self.released.wait(60)
                if self.error is not None:
                    raise self.error
            return plan(pipe, call_args, context)

        sb._plan = plan_or_hold

    def submit_in_thread(self, sb, kwargs):
        def caller():
            try:
                self.outcome["images"] = sb(**seeded(kwargs)).images
            except BaseException as exc:
                self.outcome["error"] = exc

        self.thread = threading.Thread(target=caller)
        self.thread.start()
        assert self.entered.wait(60)

    def release(self):
        self.released.set()
        self.thread.join(120)
        assert not self.thread.is_alive()


def calls(sb, kind=None):
    return [(c.kind, c.rows) for c in sb.engine.metrics.calls if kind is None or c.kind == kind]


@pytest.mark.parametrize("side, steps", [(32, 3), (48, 2)])
def test_an_idle_engine_waits_for_a_call_being_prepared_and_starts_both_in_one_batch(side, steps):
    pipe = flux_pipe("dev-tiny")
    first, second = kwargs_for("first", 1, steps, side), kwargs_for("second", 2, steps, side)
    expected = [pipe(**seeded(k)).images for k in (first, second)]
    # NOTE: cost_aware=False: the cost model's exploration would split some of these calls on purpose
    with StepBatched(pipe, scheduler=SchedulerConfig(burst_wait_s=LONG, cost_aware=False)) as sb:
        held = HeldPreparation(sb, "second")
        held.submit_in_thread(sb, second)
        handle = sb.submit(**seeded(first))
        time.sleep(0.3)
        assert calls(sb) == [] and not handle.done()  # nothing ran while the second call was being prepared
        held.release()
        images = handle.result(60).images
    assert calls(sb, "encode") == [("encode", 2)]  # one encode of both prompts
    assert {rows for _, rows in calls(sb, "denoise")} == {2}  # every step shared
    assert max_diff(images, expected[0]) <= TOLERANCE
    assert max_diff(held.outcome["images"], expected[1]) <= TOLERANCE


def test_the_wait_ends_when_no_call_was_submitted_for_burst_wait_s():
    pipe = flux_pipe("dev-tiny")
    first, second = kwargs_for("first", 1), kwargs_for("second", 2)
    expected = [pipe(**seeded(k)).images for k in (first, second)]
    with StepBatched(pipe, scheduler=SchedulerConfig(burst_wait_s=0.2)) as sb:
        held = HeldPreparation(sb, "second")
        held.submit_in_thread(sb, second)
        images = sb(**seeded(first)).images  # finishes while the second call is still being prepared
        assert not held.released.is_set()
        held.release()
    assert max_diff(images, expected[0]) <= TOLERANCE
    assert max_diff(held.outcome["images"], expected[1]) <= TOLERANCE


def test_a_preparation_that_fails_releases_the_engine_at_once():
    pipe = flux_pipe("dev-tiny")
    first = kwargs_for("first", 1)
    expected = pipe(**seeded(first)).images
    with StepBatched(pipe, scheduler=SchedulerConfig(burst_wait_s=LONG)) as sb:
        held = HeldPreparation(sb, "second", error=ValueError("bad second call"))
        held.submit_in_thread(sb, kwargs_for("second", 2))
        handle = sb.submit(**seeded(first))
        started = time.perf_counter()
        held.release()
        images = handle.result(LONG / 2).images
        assert time.perf_counter() - started < LONG / 2
    assert isinstance(held.outcome["error"], ValueError) and "bad second call" in str(held.outcome["error"])
    assert max_diff(images, expected) <= TOLERANCE


def test_running_requests_do_not_wait_for_calls_being_prepared():
    pipe = flux_pipe("dev-tiny")
    running, second = kwargs_for("running", 1, steps=4), kwargs_for("second", 2)
    expected = [pipe(**seeded(k)).images for k in (running, second)]
    with StepBatched(pipe, scheduler=SchedulerConfig(burst_wait_s=LONG)) as sb:
        held = HeldPreparation(sb, "second")
        started = threading.Event()

        def start_second_call(step_pipe, i, t, tensors):
            if i == 0:  # NOTE: in the engine thread; the second caller runs in its own
                threading.Thread(target=held.submit_in_thread, args=(sb, second)).start()
                assert held.entered.wait(60)
                started.set()
            return {}

        images = sb(**seeded(dict(running, callback_on_step_end=start_second_call))).images
        assert started.is_set() and not held.released.is_set()  # it finished while the second was prepared
        held.release()
    assert max_diff(images, expected[0]) <= TOLERANCE
    assert max_diff(held.outcome["images"], expected[1]) <= TOLERANCE


@pytest.mark.parametrize("config", [dict(burst_wait_s=0), dict(burst_wait_s=LONG, max_batch_size=1)])
def test_no_wait_when_disabled_or_the_batch_is_full(config):
    pipe = flux_pipe("dev-tiny")
    first = kwargs_for("first", 1)
    expected = pipe(**seeded(first)).images
    with StepBatched(pipe, scheduler=SchedulerConfig(**config)) as sb:
        held = HeldPreparation(sb, "second")
        held.submit_in_thread(sb, kwargs_for("second", 2))
        images = sb(**seeded(first)).images
        assert not held.released.is_set()
        held.release()
    assert max_diff(images, expected) <= TOLERANCE
    assert "images" in held.outcome


@pytest.mark.parametrize("side, steps, gap", [(32, 3, 0.05), (48, 2, 0.1)])
def test_calls_arriving_within_the_settle_time_start_in_one_batch(side, steps, gap):
    """Nothing is being prepared between the two submits: the settle time alone holds the engine."""
    pipe = flux_pipe("dev-tiny")
    first, second = kwargs_for("first", 1, steps, side), kwargs_for("second", 2, steps, side)
    expected = [pipe(**seeded(k)).images for k in (first, second)]
    config = SchedulerConfig(burst_wait_s=LONG, burst_settle_s=gap + 0.5, cost_aware=False)
    with StepBatched(pipe, scheduler=config) as sb:
        handles = [sb.submit(**seeded(first))]
        time.sleep(gap)
        handles.append(sb.submit(**seeded(second)))
        images = [handle.result(60).images for handle in handles]
    assert calls(sb, "encode") == [("encode", 2)]
    assert {rows for _, rows in calls(sb, "denoise")} == {2}
    assert all(max_diff(got, want) <= TOLERANCE for got, want in zip(images, expected))


@pytest.mark.parametrize("wait, settle", [(LONG, 0.2), (0.2, LONG)])
def test_a_lone_call_waits_the_settle_time_at_most_burst_wait_s(wait, settle):
    pipe = flux_pipe("dev-tiny")
    first = kwargs_for("first", 1)
    expected = pipe(**seeded(first)).images
    with StepBatched(pipe, scheduler=SchedulerConfig(burst_wait_s=wait, burst_settle_s=settle)) as sb:
        step, started = sb.engine.step, []

        def timed_step():
            started.append(time.perf_counter())
            step()

        sb.engine.step = timed_step
        submitted = time.perf_counter()
        images = sb(**seeded(first)).images
    assert 0.2 <= started[0] - submitted < LONG / 2
    assert max_diff(images, expected) <= TOLERANCE


@pytest.mark.parametrize("name", ["burst_wait_s", "burst_settle_s"])
@pytest.mark.parametrize("value", [-1, True, "0.1", float("inf"), None])
def test_burst_times_must_be_numbers_of_seconds(name, value):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: value})
