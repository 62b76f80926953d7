"""Prometheus exposition of engine metrics through `prometheus-client` (optional dependency)."""

from __future__ import annotations

from typing import Any

from .metrics import EngineMetrics


def register_collector(metrics: EngineMetrics, registry: Any = None, prefix: str = "stepbatch") -> Any:
    """Register a collector that reads `metrics` at scrape time; returns it (for `registry.unregister`).

    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> registry = CollectorRegistry(); sb.register_prometheus(registry)
    >>> print(generate_latest(registry).decode())
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:
        raise ImportError("Prometheus metrics need `pip install prometheus-client`") from exc

    class EngineCollector:
        def collect(self):
            snapshot = metrics.snapshot()
            calls = CounterMetricFamily(f"{prefix}_batched_calls", "Batched model calls by kind and rows",
                                        labels=["kind", "rows"])
            for kind, histogram in snapshot["rows_histogram"].items():
                for rows, count in histogram.items():
                    calls.add_metric([kind, str(rows)], count)
            yield calls
            finished = CounterMetricFamily(f"{prefix}_requests_finished", "Finished requests by status",
                                           labels=["status"])
            for status, count in snapshot["requests_finished"].items():
                finished.add_metric([status], count)
            yield finished
            splits = CounterMetricFamily(f"{prefix}_split_calls", "Calls that ran apart from others of their program, "
                                         "by the key fields that differed (engine/split_reasons.py)",
                                         labels=["reason"])
            for reason, count in snapshot["splits"].items():
                splits.add_metric([reason], count)
            yield splits
            yield GaugeMetricFamily(f"{prefix}_busy_fraction", "Share of wall time in model calls",
                                    value=snapshot["busy_fraction"])
            yield GaugeMetricFamily(f"{prefix}_mean_denoise_rows", "Mean rows per denoising forward",
                                    value=snapshot["mean_denoise_rows"])
            yield GaugeMetricFamily(f"{prefix}_throughput_requests_per_second", "Finished requests per second",
                                    value=snapshot["throughput_requests_per_s"])

    collector = EngineCollector()
    (registry or REGISTRY).register(collector)
    return collector
