"""Prometheus metrics an autoscaler can use: requests waiting / running in the engine now, video jobs by status,
and per-request histograms (queue time, time to first step, seconds per step, end to end) by endpoint and
model, plus rows per forward as a histogram. Gauges are read at scrape time; histograms are observed when a
request finishes, from the engine's own timings of it (`sb.stats()["requests"]`, its batched calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class RequestMetrics:
    """The histograms of one app, in its registry; `observe` one finished HTTP request."""

    def __init__(self, registry: Any):
        from prometheus_client import Histogram

        labels = ["endpoint", "model"]

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, text, labels, buckets=buckets, registry=registry)

        self.queue = histogram("stepbatch_request_queue_seconds", "Seconds from submit to admission", _SECONDS)
        self.first_step = histogram("stepbatch_request_first_step_seconds",
                                    "Seconds from submit to the end of the request's first denoising step", _SECONDS)
        self.step = histogram("stepbatch_request_step_seconds", "Seconds of each denoising forward a request rode",
                              _STEP_SECONDS)
        self.end_to_end = histogram("stepbatch_request_seconds",
                                    "Seconds from the HTTP request to its answer (a stream's last event)", _SECONDS)

    def observe(self, sb: Any, request_ids: list[int], endpoint: str, model: str, started: float) -> None:
        """A request that finished OK: `request_ids` are the engine requests it submitted; `started` its
        `time.perf_counter()` on arrival."""
        self.end_to_end.labels(endpoint, model).observe(time.perf_counter() - started)
        wanted = set(request_ids)
        records = [r for r in sb.stats()["requests"] if r["request_id"] in wanted]
        for record in records:
            if record["queue_time"] is not None:
                self.queue.labels(endpoint, model).observe(record["queue_time"])
            for seconds in record["step_times"]:
                self.step.labels(endpoint, model).observe(seconds)
        if records and records[0]["total_time"] is not None:
            # NOTE: the record keeps durations; it was written when the request finished, a moment ago
            arrival = time.time() - records[0]["total_time"]
            first = next((call.time for call in sb.recent_calls(records[0]["total_time"] + 1.0, "denoise")
                          if wanted & set(call.request_ids)), None)
            if first is not None:
                self.first_step.labels(endpoint, model).observe(max(first - arrival, 0.0))


def register_gauges(registry: Any, model: Callable[[], Any], videos: Callable[[], Any]) -> None:
    """Scrape-time gauges: `model()` is the served `ServingModel` (or None while loading), `videos()` the
    video job store (or None before the first job)."""
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    class ServeCollector:
        def collect(self):
            served = model()
            engine = GaugeMetricFamily("stepbatch_engine_requests", "Requests in the engine now, by state",
                                       labels=["state", "model"])
            rows = HistogramMetricFamily("stepbatch_forward_rows", "Rows per batched model call, by kind",
                                         labels=["kind"])
            if served is not None:
                for state, count in served.sb.queue_lengths().items():
                    engine.add_metric([state, served.name], count)
                for kind, counts in served.sb.stats()["rows_histogram"].items():
                    buckets = [(str(bound), sum(n for r, n in counts.items() if r <= bound)) for bound in ROW_BUCKETS]
                    total = sum(counts.values())
                    rows.add_metric([kind], [*buckets, ("+Inf", total)],
                                    sum_value=sum(r * n for r, n in counts.items()))
            yield engine
            yield rows
            jobs = GaugeMetricFamily("stepbatch_video_jobs", "Video jobs kept by the server, by status",
                                     labels=["status"])
            for status, count in video_status_counts(videos()).items():
                jobs.add_metric([status], count)
            yield jobs

    registry.register(ServeCollector())


def video_status_counts(videos: Any) -> dict[str, int]:
    counts = dict.fromkeys(("queued", "in_progress", "completed", "failed"), 0)
    if videos is None:
        return counts
    if hasattr(videos, "status_counts"):
        return {**counts, **videos.status_counts()}
    for job in videos.page(limit=2**31, after=None, order="asc")["data"]:  # NOTE: the in-memory store's listing
        counts[job["status"]] = counts.get(job["status"], 0) + 1
    return counts
