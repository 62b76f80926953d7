"""Nothing a caller (or a buggy model) does takes the engine down: BaseExceptions from callbacks fail their own
request, wrong row counts and out-of-memory errors are contained, re-entrant calls raise, aborted Futures notify
waiters, close() resolves every Future and the process can always exit."""

import concurrent.futures
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook

from diffusers_stepbatch import StepBatched
from diffusers_stepbatch.engine.faults import BatchRowMismatch, RowCaps

from .dropin_helpers import call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


class Custom(BaseException):
    pass


def raising(exc_type, at_step=1):
    def callback(view, i, t, callback_kwargs):
        if i == at_step:
            raise exc_type("from a callback")
        return callback_kwargs
    return callback


def with_callback(name, callback, **kwargs):
    """A call with a step callback: PixArtSigmaPipeline only has the legacy `callback(step, timestep, latents)`."""
    if name.startswith("pixart"):
        return call_kwargs(name, callback=lambda i, t, latents: callback(None, i, t, {}), **kwargs)
    return call_kwargs(name, callback_on_step_end=callback, **kwargs)


@pytest.mark.parametrize("name", ["flux", "sdxl-euler", "pixart-tiny"])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, Custom])
def test_base_exception_in_a_callback_fails_only_its_request(name, exc_type):
    pipe = pipe_for(name)
    others = [call_kwargs(name, seed=1), call_kwargs(name, seed=2, num_inference_steps=4)]
    expected = [run(pipe, kwargs) for kwargs in others]
    with StepBatched(pipe) as sb:
        bad = sb.submit(**seeded(with_callback(name, raising(exc_type))))
        good = [sb.submit(**seeded(kwargs)) for kwargs in others]
        assert isinstance(bad.exception(timeout=300), exc_type)
        for future, want in zip(good, expected):
            assert max_diff(future.result(timeout=300).images, want) <= TOLERANCE
        with pytest.raises(exc_type):  # a synchronous call re-raises it in the caller's thread
            sb(**seeded(with_callback(name, raising(exc_type))))
        assert max_diff(run(sb, others[0]), expected[0]) <= TOLERANCE  # the engine still serves
        assert sb.engine.is_alive


def test_close_resolves_every_future_after_base_exceptions():
    pipe = pipe_for("flux")
    sb = StepBatched(pipe, max_batch_size=2)
    futures = [sb.submit(**seeded(call_kwargs("flux", seed=i, callback_on_step_end=raising(SystemExit, i % 3))))
               for i in range(6)]
    futures += [sb.submit(**seeded(call_kwargs("flux", seed=i))) for i in range(6)]
    sb.close(cancel_pending=True)
    _, not_done = concurrent.futures.wait(futures, timeout=60)
    assert not not_done and not sb.engine.is_alive


def test_an_engine_step_that_raises_fails_requests_instead_of_spinning(monkeypatch):
    pipe = pipe_for("flux")
    with StepBatched(pipe) as sb:
        calls = []

        def broken(now):
            calls.append(now)
            raise SystemExit("scheduler bug")

        monkeypatch.setattr(sb.engine.scheduler, "schedule", broken)
        futures = [sb.submit(**seeded(call_kwargs("flux", seed=i))) for i in range(3)]
        for future in futures:
            assert isinstance(future.exception(timeout=60), SystemExit)
        time.sleep(0.2)
        assert len(calls) <= 3 and sb.engine.is_alive
        monkeypatch.undo()
        assert max_diff(run(sb, call_kwargs("flux")), run(pipe, call_kwargs("flux"))) <= TOLERANCE


class RowDropper(ModelHook):
    """A buggy hook: returns one row fewer than it was given (always, or only for batches of several rows)."""

    def __init__(self, only_batches: bool):
        super().__init__()
        self.only_batches = only_batches

    def post_forward(self, module, output):
        sample = output[0]
        if sample.shape[0] > 1 or not self.only_batches:
            return (sample[:-1] if sample.shape[0] > 1 else sample[:0],) + tuple(output[1:])
        return output


@pytest.mark.parametrize("only_batches", [True, False])
def test_a_wrong_row_count_is_a_clear_error_and_the_group_retries_alone(only_batches, caplog):
    pipe = pipe_for("flux")
    requests = [call_kwargs("flux", seed=i, num_inference_steps=2) for i in range(3)]
    expected = [run(pipe, kwargs) for kwargs in requests]
    registry = HookRegistry.check_if_exists_or_initialize(pipe.transformer)
    registry.register_hook(RowDropper(only_batches), "row_dropper")
    try:
        with StepBatched(pipe) as sb:
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
            if only_batches:
                for future, want in zip(futures, expected):
                    assert max_diff(future.result(timeout=300).images, want) <= TOLERANCE
                assert "retrying each alone" in caplog.text
            else:
                for future in futures:
                    error = future.exception(timeout=300)
                    assert isinstance(error, BatchRowMismatch) and "returned 0 rows" in str(error)
    finally:
        registry.remove_hook("row_dropper")


class OutOfMemoryAbove(ModelHook):
    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.raised, self.sizes = rows, 0, []

    def pre_forward(self, module, *args, **kwargs):
        size = kwargs["hidden_states"].shape[0]
        self.sizes.append(size)
        if size > self.rows:
            self.raised += 1
            raise torch.OutOfMemoryError(f"injected: {size} rows")
        return args, kwargs


def test_after_an_oom_the_key_is_capped_and_probed_slowly():
    pipe = pipe_for("flux")
    requests = [call_kwargs("flux", height=16, width=16, seed=i, num_inference_steps=3) for i in range(40)]
    expected = [run(pipe, kwargs) for kwargs in requests[:4]]
    hook = OutOfMemoryAbove(rows=4)
    registry = HookRegistry.check_if_exists_or_initialize(pipe.transformer)
    registry.register_hook(hook, "oom")
    try:
        with StepBatched(pipe, max_batch_size=8) as sb:
            results = [future.result(timeout=300) for future in [sb.submit(**seeded(k)) for k in requests]]
            limits = [limit for limit in (sb.engine.row_caps.limit(key) for key in sb.engine.row_caps._caps)]
    finally:
        registry.remove_hook("oom")
    for got, want in zip(results, expected):
        assert max_diff(got.images, want) <= TOLERANCE
    assert hook.raised <= 2, hook.raised  # one OOM to learn the cap, at most one failed probe
    assert limits == [4]
    assert max(size for size in hook.sizes[hook.sizes.index(8) + 1:] if size) <= 5


def test_row_caps_back_off():
    caps = RowCaps(first_probe_after=2, max_probe_after=8)
    caps.record_oom("k", 8)
    assert caps.limit("k") == 4 and caps.split("k", [1, 2, 2, 1]) == [[0, 1], [2, 3]]
    for _ in range(2):
        caps.record_success("k", 4)
    assert caps.limit("k") == 5  # a probe
    caps.record_oom("k", 5)
    assert caps.limit("k") == 4
    for _ in range(3):
        caps.record_success("k", 4)
    assert caps.limit("k") == 4  # the next probe waits twice as long
    caps.record_success("k", 4)
    assert caps.limit("k") == 5


@pytest.mark.parametrize("name", ["flux", "qwen-tiny", "sd-euler", "pixart-tiny"])
def test_a_synchronous_call_from_a_callback_raises_in_every_program(name):
    pipe = pipe_for(name)
    with StepBatched(pipe) as sb:
        def reenter(view, i, t, callback_kwargs):
            sb(**seeded(call_kwargs(name)))
            return callback_kwargs

        future = sb.submit(**seeded(with_callback(name, reenter)))
        error = future.exception(timeout=120)
        assert isinstance(error, RuntimeError) and "own engine thread" in str(error)
        assert max_diff(run(sb, call_kwargs(name)), run(pipe, call_kwargs(name))) <= TOLERANCE


def test_the_process_exits_while_the_engine_is_busy():
    script = textwrap.dedent("""
        import threading
        import time
        from diffusers_stepbatch import StepBatched
        from diffusers_stepbatch.testing import tiny_pixart_or_sana_pipeline
        pipe = tiny_pixart_or_sana_pipeline()
        pipe.set_progress_bar_config(disable=True)
        sb = StepBatched(pipe)
        busy = threading.Event()
        def stuck(i, t, latents):  # PixArtSigmaPipeline's (legacy) step callback
            busy.set()
            time.sleep(600)
        sb.submit("a cat", height=32, width=32, num_inference_steps=2, use_resolution_binning=False,
                  clean_caption=False, max_sequence_length=16, callback=stuck)
        assert busy.wait(60)  # the engine thread is inside the request's step now
        print("leaving", flush=True)
    """)
    started = time.time()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaving" in done.stdout
    assert time.time() - started < 100


@pytest.mark.parametrize("name", ["flux", "pixart-tiny"])
def test_aborted_futures_notify_waiters(name):
    pipe = pipe_for(name)
    with StepBatched(pipe, max_batch_size=1) as sb:
        futures = [sb.submit(**seeded(call_kwargs(name, seed=i, num_inference_steps=4))) for i in range(4)]
        futures[1].abort()
        futures[3].abort()
        _, not_done = concurrent.futures.wait(futures, timeout=120)
        assert not not_done
        finished = list(concurrent.futures.as_completed(futures, timeout=120))
        assert len(finished) == 4
        assert [f.cancelled() for f in futures] == [False, True, False, True]
        first = concurrent.futures.wait([sb.submit(**seeded(call_kwargs(name)))] + [futures[1]], timeout=60,
                                        return_when=concurrent.futures.FIRST_COMPLETED)[0]
        assert first
