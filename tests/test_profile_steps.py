"""benchmarks/profile_steps.py's reading of a Chrome trace: where the device sat idle."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from profile_steps import device_gaps  # noqa: E402


def write_trace(tmp_path, spans, cat="kernel"):
    events = [{"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur} for ts, dur in spans]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50_000})  # host ops don't count
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("cat", ["kernel", "gpu_memcpy", "gpu_memset"])
def test_gaps_between_overlapping_and_separate_device_work(tmp_path, cat):
    # busy 0-150 (two overlapping kernels) and 160-170, 2000-3000, 9000-10000 (microseconds)
    gaps = device_gaps(write_trace(tmp_path, [(0, 100), (50, 100), (160, 10), (2000, 1000), (9000, 1000)], cat))
    assert gaps["span_ms"] == pytest.approx(10.0)
    assert gaps["busy_ms"] == pytest.approx(0.15 + 0.01 + 1 + 1)
    assert gaps["idle_ms"] == pytest.approx(0.01 + 1.83 + 6.0)
    assert gaps["idle_ms_by_gap_length"] == pytest.approx({"<50us": 0.01, "1-5ms": 1.83, ">=5ms": 6.0})
    assert gaps["idle_ms_by_tenth_of_span"] == pytest.approx([1.84, 0, 0, 6.0, 0, 0, 0, 0, 0, 0])
    assert gaps["longest_gaps_ms"][0] == {"at_ms": 3.0, "ms": 6.0}


def test_untimed_or_missing_device_work_gives_no_timeline(tmp_path):
    assert device_gaps(write_trace(tmp_path, [])) is None
    assert device_gaps(write_trace(tmp_path, [(0, 0), (0, 0)])) is None  # kernels without durations
