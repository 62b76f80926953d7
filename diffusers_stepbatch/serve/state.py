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
    """Where the server is in its life: "loading" -> "ready" (or "failed") -> "stopping"."""

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
    replica: str | None = None  # this server among replicas (Ray Serve's replica name)
    tenants: Any = None  # `tenants.Tenants` from --api-keys / --api-key; None: an open server

    def ready_model(self, requested: str | None) -> ServingModel:
        """The served model, or a 503 (not ready) / 404 (another model's name)."""
        state, config = self.state, self.config
        if state.phase != "ready" or state.model is None:
            reason = {"loading": "the model is still loading", "stopping": "the server is shutting down",
                      "failed": f"the model failed to load ({state.error})"}.get(state.phase, state.phase)
            raise APIError(503, f"{reason}; retry later", type="server_error", code=f"server_{state.phase}",
                           headers={"Retry-After": str(max(1, config.retry_after_s))})
        if requested is not None and requested != state.model.name:
            raise APIError(404, f"model={requested!r} does not exist; this server serves {state.model.name!r}",
                           param="model", code="model_not_found")
        return state.model
