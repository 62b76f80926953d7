"""Device-true call times (CUDA events read later, never a sync) and the engine's host reads, counted."""

import collections
import threading
from types import SimpleNamespace

import pytest
import torch

from diffusers_stepbatch import SchedulerConfig, StepBatched
from diffusers_stepbatch.cache import TeaCacheConfig
from diffusers_stepbatch.engine import host_sync
from diffusers_stepbatch.engine.batch import WorkItem
from diffusers_stepbatch.engine.core import EngineCore
from diffusers_stepbatch.engine.timing import CallTimer

from .references import TOLERANCE, family_pipe, flux_pipe, in_lockstep, max_diff, seeded


class FakeDevice:
    """A device clock the test advances, and events that complete only when the test says so."""

    def __init__(self):
        self.clock_ms = 0.0
        self.completed_up_to = float("inf")

    def event(self):
        device = self

        class Event:
            def record(self):
                self.at = device.clock_ms

            def query(self):
                return self.at <= device.completed_up_to

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()


@pytest.fixture
def no_sync(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the timer synchronized the device")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_device_calls_are_delivered_once_finished_with_event_time(no_sync):
    device = FakeDevice()
    timer = CallTimer(events=device.event, on_device=lambda output: True)
    seen = []
    started = timer.start()
    device.clock_ms += 40.0  # the call's kernels take 40 ms on the device
    device.completed_up_to = 0.0  # ...which have not run yet
    wall = timer.stop(started, torch.zeros(1), seen.append)
    assert seen == [] and timer.pending == 1 and wall < 0.04
    assert timer.poll() == 0 and seen == []
    device.completed_up_to = float("inf")
    assert timer.poll() == 1 and seen == [pytest.approx(0.040)]


def test_host_calls_are_delivered_at_once_with_wall_time():
    timer = CallTimer(events=FakeDevice().event, on_device=lambda output: False)
    seen = []
    wall = timer.stop(timer.start(), torch.zeros(1), seen.append)
    assert seen == [wall] and timer.pending == 0
    assert CallTimer(events=None).events is None


def test_cost_model_decides_on_device_time_not_launch_time(no_sync):
    """Made-up device costs where a batch of n rows takes n^2 ms: the engine learns to run rows alone."""
    pipe = flux_pipe("dev-tiny")
    device = FakeDevice()

    def run_on_device(module, args, kwargs):
        device.clock_ms += kwargs["hidden_states"].shape[0] ** 2

    handle = pipe.transformer.register_forward_pre_hook(run_on_device, with_kwargs=True)
    requests = [dict(prompt=f"a red circle {i}", height=32, width=32, num_inference_steps=12, seed=i,
                     output_type="pt", max_sequence_length=16) for i in range(4)]
    try:
        sb = StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8), mixed_resolution=False)
        sb.engine.timer = CallTimer(events=device.event, on_device=lambda output: True)
        got = in_lockstep(sb, requests)
    finally:
        handle.remove()
    key = next(k for k in sb.engine.costs._samples if k[0] == "denoise")
    # NOTE: the whole group of 4 ran once, as warm-up (not recorded); exploration measured its halves and single rows
    assert sb.engine.costs.estimate(key, 2) == pytest.approx(0.004)  # 2 rows: 4 fake ms, whatever the CPU took
    assert sb.engine.costs.estimate(key, 1) == pytest.approx(0.001)
    rows = [r for _, r in sb.stats()["denoise_rows_over_time"]]
    assert rows[-8:] == [1] * 8, f"the engine kept batching although the device said it costs more: {rows}"
    for kwargs, image in zip(requests, got):
        assert max_diff(image, pipe(**seeded(kwargs)).images) <= TOLERANCE


@pytest.mark.parametrize("device_output", [True, False])
def test_calls_timed_on_the_device_warm_up_every_row_count(no_sync, device_output):
    """A call timed by device events (CUDA) paid one-time costs at its row count; a wall-timed one did not."""
    device = FakeDevice()
    engine = EngineCore(SchedulerConfig(), timer=CallTimer(events=device.event, on_device=lambda o: device_output))
    seen = []
    engine.costs.observe = lambda key, rows, seconds, new_size_warms_up: seen.append((rows, new_size_warms_up))
    engine._deliver = lambda *args, **kwargs: None
    item = WorkItem("denoise", "k", {"x": [torch.zeros(1), torch.zeros(1)]}, lambda x: torch.stack(x), rows=2)
    request = SimpleNamespace(pending=item, request_id=1)
    engine._execute([request])
    engine.timer.poll()
    assert seen == [(2, device_output)]


@pytest.mark.parametrize("first_call_extra_ms", [30.0, 80.0])
def test_a_bursts_prompts_encode_in_one_call_though_each_new_row_count_costs_more_once(no_sync, first_call_extra_ms):
    """Made-up device costs for the T5 encoder: 5 ms + 0.2 ms a row, and more at each row count's first call (as
    CUDA's per-shape plans): the engine still settles on one encode call for a burst's eight prompts."""
    pipe = flux_pipe("dev-tiny")
    device = FakeDevice()
    seen_rows: set[int] = set()

    def encode_on_device(module, args, kwargs):
        rows = (args[0] if args else kwargs["input_ids"]).shape[0]
        device.clock_ms += 5 + 0.2 * rows + (0 if rows in seen_rows else first_call_extra_ms)
        seen_rows.add(rows)

    handle = pipe.text_encoder_2.register_forward_pre_hook(encode_on_device, with_kwargs=True)
    encodes = []
    try:
        sb = StepBatched(pipe, scheduler=SchedulerConfig(max_batch_size=8), mixed_resolution=False, prompt_cache=None)
        sb.engine.timer = CallTimer(events=device.event, on_device=lambda output: True)
        for burst in range(6):
            calls = [dict(prompt=f"burst {burst}: a red circle {i}", height=32, width=32, num_inference_steps=1,
                          seed=i, output_type="latent", max_sequence_length=16) for i in range(8)]
            before = len(sb.engine.metrics.calls)
            in_lockstep(sb, calls)
            encodes.append([call.rows for call in list(sb.engine.metrics.calls)[before:] if call.kind == "encode"])
    finally:
        handle.remove()
    # the whole burst first (a warm-up), two exploring bursts, then one call; one re-measurement probe among them
    assert encodes[0] == [8] and encodes[3] == [8] and encodes[5] == [8], encodes
    assert all(len(calls) <= 2 for calls in encodes[3:]), encodes


class HostReads:
    """Counts implicit device-to-host reads (`float(t)`, `t.item()`, `if t:` ...) made in the engine thread."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self, monkeypatch):
        self.sites = collections.Counter()
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name, original):
        def counted(tensor, *args, **kwargs):
            if threading.current_thread().name.startswith("StepBatched"):
                self.sites[name] += 1
            return original(tensor, *args, **kwargs)

        return counted


def given_embeddings(name, pipe, prompt):
    """Call arguments with the prompt already encoded, so a call runs no text encoder."""
    if name == "flux":
        embeds, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=16)
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
    if name.startswith("sd3"):
        embeds, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=1.0)
    embeds, mask = pipe.encode_prompt(prompt)
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask)


@pytest.mark.parametrize("name", ["flux", "sd3-tiny", "qwen-tiny"])
def test_the_step_loop_reads_nothing_back_from_the_device(monkeypatch, name):
    """Denoising steps (with latent output and encoded prompts: nothing else runs) make no host read at all."""
    pipe = flux_pipe("dev-tiny") if name == "flux" else family_pipe(name)
    requests = [dict(height=32, width=[32, 48, 16][i], num_inference_steps=3 + i, output_type="latent",
                     generator=torch.Generator().manual_seed(i), **given_embeddings(name, pipe, prompt))
                for i, prompt in enumerate(["a red circle", "a blue square at the top", "x"])]
    reads = HostReads(monkeypatch)
    before = host_sync.reads
    with StepBatched(pipe) as sb:
        for future in [sb.submit(**kwargs) for kwargs in requests]:
            future.result()
    assert sum(sb.stats()["rows_histogram"]["denoise"].values()) >= 3, "no denoise call ran"
    assert dict(reads.sites) == {} and host_sync.reads == before


def test_teacache_reads_one_value_per_decision(monkeypatch):
    pipe = flux_pipe("dev-tiny")
    embeds, pooled, _ = pipe.encode_prompt("a red circle", prompt_2=None, max_sequence_length=16)
    steps, requests = 12, 3
    reads = HostReads(monkeypatch)
    before = host_sync.reads
    with StepBatched(pipe, teacache=TeaCacheConfig(threshold=0.4)) as sb:
        for future in [sb.submit(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=32, width=32,
                                 num_inference_steps=steps, output_type="latent",
                                 generator=torch.Generator().manual_seed(i)) for i in range(requests)]:
            future.result()
    # first and last steps always compute without looking; every step between reads one distance per request
    assert host_sync.reads - before == requests * (steps - 2)
    assert dict(reads.sites) == {"__float__": requests * (steps - 2)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (set_sync_debug_mode is a CUDA feature)")
@pytest.mark.parametrize("true_cfg", [False, True])
def test_the_denoising_loop_never_syncs_on_cuda(true_cfg):
    pipe = flux_pipe().to("cuda")
    steps = 4

    def sync_checks(pipeline, i, t, tensors):
        # from the end of step 0 to the end of the last step, any host-device sync raises in the engine thread
        torch.cuda.set_sync_debug_mode("error" if i < steps - 1 else "default")
        return tensors

    extra = dict(negative_prompt="noise", true_cfg_scale=2.0) if true_cfg else {}
    calls = [dict(prompt=f"a shape {i}", height=32, width=32, num_inference_steps=steps, max_sequence_length=16,
                  output_type="latent", callback_on_step_end=sync_checks, **extra) for i in range(3)]
    try:
        with StepBatched(pipe) as sb:
            outputs = [future.result(timeout=120) for future in [sb.submit(**kwargs) for kwargs in calls]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        pipe.to("cpu")
    assert all(output.images.device.type == "cuda" for output in outputs)
