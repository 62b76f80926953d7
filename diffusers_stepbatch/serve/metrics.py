"""HTTP metrics for `/metrics`: request counts by route and status, latencies, requests in flight.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streamed responses and hide
client disconnects from the route).
"""

from __future__ import annotations

import time
from typing import Any

ROUTES = frozenset({"/", "/health", "/ready", "/live", "/metrics", "/v1/models", "/v1/images/generations", "/v1/images/edits",
                    "/v1/engine/live", "/v1/videos"})
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class HTTPMetrics:
    """Prometheus counters for one app, in its own `CollectorRegistry` (several apps in one process don't clash)."""

    def __init__(self, registry: Any):
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("stepbatch_http_requests", "HTTP requests by route, method and status",
                                ["method", "route", "status"], registry=registry)
        self.latency = Histogram("stepbatch_http_request_duration_seconds",
                                 "Seconds from request to the end of the response (streams included)",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.in_flight = Gauge("stepbatch_http_requests_in_flight", "HTTP requests being answered",
                               registry=registry)
        self.generations = Gauge("stepbatch_http_generations_in_flight",
                                 "Image requests past validation and not yet answered (queued or running)",
                                 registry=registry)


class MetricsMiddleware:
    def __init__(self, app: Any, metrics: HTTPMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"  # NOTE: bounded label values
        method = scope["method"]
        status = {"code": 500}
        started = time.perf_counter()

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(method, route, str(status["code"])).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - started)


class ReplicaHeaderMiddleware:
    """Names the replica that answered in an `X-StepBatch-Replica` header (load spreading is then visible)."""

    def __init__(self, app: Any, replica: str):
        self.app, self.header = app, (b"x-stepbatch-replica", replica.encode("latin-1", "replace"))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)
