"""benchmarks/profile_steps.py's reading of a Chrome trace: where the device sat idle."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from profile_steps import device_gaps, profile_device_spans, trace_device_spans  # noqa: E402


def write_trace(tmp_path, spans, cat="kernel"):
    events = [{"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur} for ts, dur in spans]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50_000})  # host ops don't count
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("cat", ["kernel", "gpu_memcpy", "gpu_memset"])
def test_gaps_between_overlapping_and_separate_device_work(tmp_path, cat):
    # busy 0-150 (two overlapping kernels) and 160-170, 2000-3000, 9000-10000 (microseconds)
    spans = trace_device_spans(write_trace(tmp_path, [(0, 100), (50, 100), (160, 10), (2000, 1000), (9000, 1000)], cat))
    gaps = device_gaps(spans[::-1])  # in any order
    assert gaps["span_ms"] == pytest.approx(10.0)
    assert gaps["busy_ms"] == pytest.approx(0.15 + 0.01 + 1 + 1)
    assert gaps["idle_ms"] == pytest.approx(0.01 + 1.83 + 6.0)
    assert gaps["idle_ms_by_gap_length"] == pytest.approx({"<50us": 0.01, "1-5ms": 1.83, ">=5ms": 6.0})
    assert gaps["idle_ms_by_tenth_of_span"] == pytest.approx([1.84, 0, 0, 6.0, 0, 0, 0, 0, 0, 0])
    assert gaps["longest_gaps_ms"][0] == {"at_ms": 3.0, "ms": 6.0}


def test_untimed_or_missing_device_work_gives_no_timeline(tmp_path):
    assert trace_device_spans(write_trace(tmp_path, [])) == []
    assert trace_device_spans(write_trace(tmp_path, [(0, 0), (0, 0)])) == []  # kernels without durations
    assert device_gaps([]) is None


class FakeKinetoEvent:
    def __init__(self, device, start_ns, duration_ns):
        self._device, self._start, self._duration = device, start_ns, duration_ns

    def device_type(self):
        return self._device

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._start + self._duration

    def duration_ns(self):
        return self._duration


def test_device_spans_from_the_profilers_own_records():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [FakeKinetoEvent(cuda, 1_000, 2_000), FakeKinetoEvent(cpu, 0, 50_000),
              FakeKinetoEvent(cuda, 9_000, 0), FakeKinetoEvent(cuda, 5_000, 1_000)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    spans = profile_device_spans(prof)
    assert spans == [(1.0, 3.0), (5.0, 6.0)]  # microseconds; host ops and untimed kernels left out
    assert device_gaps(spans)["idle_ms"] == pytest.approx(0.002)
