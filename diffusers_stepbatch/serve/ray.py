"""The same server as a Ray Serve deployment: one `StepBatched` engine per replica (one replica per GPU).

>>> serve.run(build_app({"model": "toy", "num_replicas": 2}), route_prefix="/")   # or examples/ray_serve.yaml

A replica's death fails only its in-flight requests (docs/guides/serving.md). With `context_parallel`
("ulysses=N") a replica spans N GPUs and starts its N - 1 follower ranks itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve

from .app import create_app
from .config import ServeConfig
from .local_ranks import start_local_ranks
from .model import load_model

DEPLOYMENT_NAME = "StepBatchedImages"
_DEPLOYMENT_OPTIONS = ("num_replicas", "max_ongoing_requests", "ray_actor_options", "autoscaling_config")


@serve.deployment(name=DEPLOYMENT_NAME, max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
@serve.ingress()
class ImageServer:
    """One replica: loads the model named by its `ServeConfig` fields and serves the OpenAI-compatible app."""

    def __init__(self, **config: Any):
        import ray

        self.config = ServeConfig(**config)
        self.followers = start_local_ranks(self.config) if self.config.context_parallel else []
        self.model = load_model(self.config)
        context = ray.get_runtime_context()
        self.replica = context.get_actor_name() or context.get_actor_id()  # what ray.get_actor(name) takes

    def engine_stats(self) -> dict:  # NOTE: through a deployment handle
        return self.model.sb.stats()

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.config, model=self.model, close_model=True, replica=self.replica)


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `args` holds `ServeConfig` fields and, optionally, the deployment's own
    options (num_replicas, autoscaling_config, ray_actor_options, max_ongoing_requests)."""
    args = dict(args)
    options = {name: args.pop(name) for name in _DEPLOYMENT_OPTIONS if name in args}
    known = {field.name for field in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown ServeConfig fields {unknown}; known: {sorted(known)}")
    ServeConfig(**args)  # validate in the driver, before any replica starts
    deployment = ImageServer.options(**options) if options else ImageServer
    return deployment.bind(**args)
