"""One private local Ray instance with Serve's HTTP proxy, shared by the Ray test modules: starting one and
shutting it down take ~20 s here, so each module deploys (and deletes) its own application on the same
instance. A module that uses it sets `USES_LOCAL_RAY = True`; conftest stops the instance after the last such
module's tests, so that its idle processes don't run beside the rest of the suite."""

from __future__ import annotations

import os
from pathlib import Path

from .ports import free_port

ROOT = Path(__file__).resolve().parents[1]
_url: str | None = None


def local_ray_serve() -> str:
    """The proxy's base URL, starting the instance if none runs."""
    global _url
    if _url is not None:
        return _url
    import ray
    from ray import serve

    from diffusers_stepbatch.serve.ray_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "TOKENIZERS_PARALLELISM": "false"}
    # NOTE: a private local instance: 127.0.0.1 only, no dashboard, no usage stats
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # before the local instance starts: its proxy reads it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
             _node_ip_address="127.0.0.1")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:
        ray.shutdown()
        raise
    _url = f"http://127.0.0.1:{port}"
    return _url


def stop_local_ray_serve() -> None:
    global _url
    if _url is None:
        return
    import ray
    from ray import serve

    _url = None
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
