"""Helpers for the server tests: a uvicorn server in a thread on a free loopback port, image decoding."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from typing import Self

import numpy as np
from PIL import Image

from .ports import free_port

TOY_CALL = {"num_inference_steps": 20, "guidance_scale": 3.5, "max_sequence_length": 16}


class ServerThread:
    """`with ServerThread(app) as base_url:` serves `app` on 127.0.0.1 at a free port until the block ends."""

    def __init__(self, app, startup_timeout: float = 30.0):
        import uvicorn

        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))  # NOTE: bound here, so no other process can take the port meanwhile
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.startup_timeout = startup_timeout

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self.base_url

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Served:
    """`with Served(pipe, name) as served:` a server over `pipe` (`serve_pipeline`) on a free loopback port, with
    an `openai` client for it (`served.client`); the engine is closed at the end."""

    def __init__(self, pipe, name: str, call_defaults: dict | None = None, **config):
        from diffusers_stepbatch.serve import ServeConfig, create_app, serve_pipeline

        config = ServeConfig(served_model_name=name, **config)
        self.name = name
        self.model = serve_pipeline(pipe, config, call_defaults=call_defaults)
        self.server = ServerThread(create_app(config, model=self.model))

    def __enter__(self) -> Self:
        import openai

        url = self.server.__enter__()
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.__exit__(*exc_info)
        self.model.close()

    def finished(self) -> int:
        """Requests the engine finished so far (a refused request adds none)."""
        return sum(self.model.sb.stats()["requests_finished"].values())


def decode_b64(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02):
    """Poll `condition()` until it returns something truthy; return it (None on timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return None


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


class ServerProcess:
    """`diffusers-stepbatch serve` in a subprocess on a free loopback port: `start()` waits until it is healthy,
    `stop(signal)` ends it (SIGTERM: gracefully; SIGKILL: a crash); `log()` is what it printed."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 120.0,
                 launcher: list[str] | None = None):
        import os
        import sys

        self.port = free_port()
        # NOTE: `launcher`: what runs the module instead of this Python (torchrun's `python -m torch.distributed.run`)
        self.command = [*(launcher or [sys.executable]), "-m", "diffusers_stepbatch.serve", "--port", str(self.port),
                        "--no-access-log", "--log-level", "warning", *args]
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
                        **(env or {}))
        self.startup_timeout = startup_timeout
        self.process = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def start(self) -> Self:
        import subprocess
        import tempfile

        import httpx

        self._log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                        text=True)

        def healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        if not wait_for(healthy, timeout=self.startup_timeout, interval=0.2):
            self.stop()
            raise RuntimeError(f"the server did not become healthy:\n{self.log()}")
        return self

    def stop(self, sig: int | None = None, timeout: float = 60.0) -> int | None:
        import signal

        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM if sig is None else sig)
        try:
            return self.process.wait(timeout)
        except Exception:
            self.process.kill()
            return self.process.wait(10)

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()

    def __enter__(self) -> Self:
        return self if self.process is not None and self.process.poll() is None else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
