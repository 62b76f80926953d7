"""What the routes share: the server's phase, its model, config and metrics (`app.state.server`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import ServeConfig
from .live import LiveRequests
from .metrics import HTTPMetrics
from .model import ServingModel
from .protocol import APIError


class ServerState:
    """Where the server is in its life: "loading" -> ("warming" ->) "ready" (or "failed") -> "stopping"."""

    def __init__(self):
        self.phase = "loading"
        self.model: ServingModel | None = None
        self.error: str | None = None

    def begin_shutdown(self) -> None:
        """New generation requests get 503 from now on; in-flight ones finish."""
        self.phase = "stopping"


@dataclass
class ServerContext:
    """One app's server: the routes reach it as `request.app.state.server`."""

    config: ServeConfig
    state: ServerState
    registry: Any
    http_metrics: HTTPMetrics
    live: LiveRequests = field(default_factory=LiveRequests)
    videos: Any = None  # the video jobs (`video_jobs.VideoJobs`), made by the first videos request
    request_metrics: Any = None  # `request_metrics.RequestMetrics`: per-request histograms
    replica: str | None = None  # this server among replicas (Ray Serve's replica name)
    tenants: Any = None  # `tenants.Tenants` from --api-keys / --api-key; None: an open server

    def condition(self) -> tuple[str, bool, bool]:
        """(status, live, ready): "ok" once loaded and the engine thread runs; "engine_dead" once it died."""
        state = self.state
        if state.phase == "ready" and state.model is not None and not state.model.engine_alive():
            return "engine_dead", False, False
        return ("ok" if state.phase == "ready" else state.phase), state.phase != "failed", state.phase == "ready"

    def ready_model(self, requested: str | None) -> ServingModel:
        """The served model, or a 503 (not ready) / 404 (another model's name). A LoRA adapter's name (as vLLM
        lists adapters) is the served model with that adapter."""
        state, config = self.state, self.config
        status, _, ready = self.condition()
        if not ready or state.model is None:
            reason = {"loading": "the model is still loading", "stopping": "the server is shutting down",
                      "failed": f"the model failed to load ({state.error})",
                      "engine_dead": "the engine stopped", "warming": "the server is warming up"}.get(status, status)
            raise APIError(503, f"{reason}; retry later", type="server_error", code=f"server_{status}",
                           headers={"Retry-After": str(max(1, config.retry_after_s))})
        adapters = state.model.lora.names() if state.model.lora is not None else ()
        if requested is not None and requested != state.model.name and requested not in adapters:
            raise APIError(404, f"model={requested!r} does not exist; this server serves {state.model.name!r}",
                           param="model", code="model_not_found")
        return state.model
