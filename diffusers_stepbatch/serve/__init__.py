"""An OpenAI-compatible image server around one `StepBatched` engine (FastAPI + uvicorn, `pip install ".[serve]"`).

>>> from diffusers_stepbatch.serve import ServeConfig, create_app
>>> app = create_app(ServeConfig())            # the shipped toy model, loaded in the background at startup
>>> # uvicorn.run(app, host="127.0.0.1", port=8000), or: `diffusers-stepbatch serve`

Endpoints: `POST /v1/images/generations` and `POST /v1/images/edits` (b64_json, OpenAI's streaming events with
partial images), `GET /v1/models` (with the sizes the model draws and its edit pipelines), `GET /v1/engine/live`,
`GET /health`, `GET /metrics` (Prometheus) and a web page at `/`. `serve.ray` runs the same
app as a Ray Serve deployment (one engine per replica). Nothing below this package imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .config import ServeConfig
    from .model import ServingModel, load_model, serve_pipeline

__all__ = ["ServeConfig", "ServingModel", "create_app", "load_model", "serve_pipeline"]

_LAZY = {"create_app": "app", "ServeConfig": "config", "ServingModel": "model", "load_model": "model",
         "serve_pipeline": "model"}


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so that `import diffusers_stepbatch.serve.config` (the CLI's flag parsing) needs no FastAPI.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
