"""`ServeConfig`: what the server loads and how its engine admits requests (the CLI's flags, one field each)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "DIFFUSERS_STEPBATCH_API_KEY"
TOY_MODEL = "toy"
TOY_SERVED_NAME = "toy-shapes"
TINY_VIDEO_MODELS = {"tiny-wan": False, "tiny-wan-i2v": True}  # offline random Wan 2.1: name -> image-to-video
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class ServeConfig:
    """Settings of one server (one engine); every field is a `diffusers-stepbatch serve` flag.

    Args:
        model: "toy" (the shipped toy model, offline) or a Hub id / local folder (`DiffusionPipeline`).
        dtype, device, host, port: where the pipeline runs ("bfloat16", "cuda:1") and uvicorn listens.
        api_key: Bearer key required on `/v1/*`; None reads `DIFFUSERS_STEPBATCH_API_KEY`, "" disables it.
        served_model_name: the `model` clients name (default: "toy-shapes" or the model id).
        max_batch_size, policy, max_wait_s, max_queue, on_unmeetable_deadline, step_time_target_s,
            cost_aware, burst_wait_s, burst_settle_s, exact: the engine's `SchedulerConfig`.
        teacache: a TeaCache threshold (None: exact steps).
        decoder, pid_exit_step: decode with PiD (`StepBatched(decoder=..., pid_exit_step=...)`).
        shutdown_timeout_s, retry_after_s: seconds in-flight requests get after SIGTERM; a 429's `Retry-After`.
        edits: serve `/v1/images/edits`; allow_remote_images: let edits name http(s) URLs (fetched).
        max_body_bytes, max_prompt_chars, max_input_images, max_image_pixels: request limits (413 / 400).
        video_dir, video_retention_s, max_video_jobs: where video jobs keep their files (None: a temporary
            folder), how long a finished one is kept, how many are kept; video_fps, max_video_frames: the MP4s'
            frame rate (`seconds * fps + 1` frames) and longest video; video_preview_every: steps between previews.
        preset, call_defaults, max_steps: docs/reference/presets.md ("auto", "none" or a Hub id), over it
            (`--call-default`), the step cap (None: the preset's, else the scheduler's `num_train_timesteps`).
        lora_modules, lora_dir, max_loras: LoRA adapters by name (`serve/lora_adapters.py`).
        quantize, offload, compile, compile_backend, attention_backend, vae_tiling, warmup: `launch_knobs.py`.
        context_parallel: "ulysses=N", "ring=N" or both ("ulysses=2,ring=2"): the denoiser split over the ranks
            `torchrun --nproc-per-node` started (rank 0 serves; docs/guides/gpu.md).
        api_keys, fair_share: a TOML file of tenant keys (`serve.tenants`); share rows by their weights.
        state_dir, jobs_db, resume, job_lease_s, jobs_poll_s, replica_name: the video jobs' database (SQLite in
            `state_dir`, or a URL), restarts and replicas (docs/reference/server.md).
    """

    model: str = TOY_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_batch_size: int = 8
    policy: str = "fcfs"
    max_wait_s: float = 30.0
    max_queue: int | None = 256
    on_unmeetable_deadline: str = "reject"
    step_time_target_s: float | None = None
    cost_aware: bool = True
    exact: bool = False
    burst_wait_s: float = 0.05
    burst_settle_s: float = 0.005
    teacache: float | None = None
    decoder: str | None = None
    pid_exit_step: float | None = None
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    edits: bool = True
    max_body_bytes: int = 64 * 2**20
    max_prompt_chars: int = 32_000
    max_input_images: int = 16
    max_image_pixels: int = 4096 * 4096
    allow_remote_images: bool = False
    video_dir: str | None = None
    video_retention_s: float = 3600.0
    max_video_jobs: int = 256
    video_fps: int = 16
    max_video_frames: int = 257
    video_preview_every: int = 0
    preset: str = "auto"
    call_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_steps: int | None = None
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    lora_dir: str | None = None
    max_loras: int = 8
    quantize: str | None = None
    offload: str | None = None
    compile: bool = False
    compile_backend: str = "inductor"
    attention_backend: str | None = None
    vae_tiling: bool = False
    warmup: int = 0
    context_parallel: str | None = None
    # tenants (docs/guides/serving.md, "Tenants and keys")
    api_keys: str | None = None
    fair_share: bool = True
    # durable jobs and replicas (docs/guides/serving.md, "Jobs, storage and replicas")
    state_dir: str | None = None
    jobs_db: str | None = None
    resume: bool = True
    job_lease_s: float = 30.0
    jobs_poll_s: float = 0.5
    replica_name: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in 0..65535")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s} must be >= 0")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s={self.retry_after_s} must be >= 0")
        if self.video_retention_s <= 0:
            raise ValueError(f"video_retention_s={self.video_retention_s} must be > 0")
        if self.video_preview_every < 0:
            raise ValueError(f"video_preview_every={self.video_preview_every} must be >= 0 (0: automatic)")
        for name in ("max_loras", "max_body_bytes", "max_prompt_chars", "max_input_images", "max_image_pixels", "max_video_jobs",
                     "video_fps", "max_video_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.offload not in (None, "model", "sequential", "group"):
            raise ValueError(f"offload={self.offload!r} is not one of 'model', 'sequential', 'group'")
        if self.quantize not in (None, "qint8", "qint4", "qfloat8"):
            raise ValueError(f"quantize={self.quantize!r} is not one of 'qint8', 'qint4', 'qfloat8'")
        if self.context_parallel is not None:
            parse_context_parallel(self.context_parallel)
            # NOTE: the followers see only a call's inputs, not a request's adapters or TeaCache state
            for name in ("teacache", "lora_dir", "offload"):
                if getattr(self, name):
                    raise ValueError(f"{name}={getattr(self, name)!r} can't run under context_parallel (rank 0 "
                                     "alone would know a request's state); leave one of them out")
            if self.lora_modules:
                raise ValueError("lora_modules can't run under context_parallel (rank 0 alone would know a "
                                 "request's adapters); fuse the adapter into the weights before launch")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1")
        if self.state_dir is None and self.video_dir is not None and "://" not in self.video_dir:
            self.state_dir = self.video_dir  # NOTE: the jobs database sits beside the videos it describes
        if self.jobs_db is not None and self.video_dir is None and self.state_dir is None:
            raise ValueError(f"jobs_db={self.jobs_db!r} needs a video_dir (or state_dir) every server using that "
                             f"database reads: the videos of its jobs live there")
        if not 0 < self.jobs_poll_s < self.job_lease_s:
            raise ValueError(f"jobs_poll_s={self.jobs_poll_s} must be > 0 and below job_lease_s={self.job_lease_s} "
                             f"(leases are renewed every poll)")
        if self.api_keys is not None:
            from .tenants import load_api_keys

            try:
                load_api_keys(self.api_keys)  # NOTE: a bad file fails the launch, not the first request
            except OSError as exc:
                raise ValueError(f"api_keys={self.api_keys!r}: {exc.strerror or exc}") from None
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        elif self.api_key == "":
            self.api_key = None
        self.scheduler_config()  # validates the scheduler fields now, with SchedulerConfig's own messages

    @property
    def tenant_weights(self) -> dict[str, float] | None:
        """Each tenant's weight from `api_keys` (the engine's fair share)."""
        if self.api_keys is None:
            return None
        from .tenants import Tenants, load_api_keys

        return Tenants(load_api_keys(self.api_keys)).weights()

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return TOY_SERVED_NAME if self.model == TOY_MODEL else self.model

    def scheduler_config(self):
        from ..engine.scheduler import SchedulerConfig

        fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        return SchedulerConfig(**{name: getattr(self, name) for name in fields if hasattr(self, name)})


def parse_context_parallel(text: str) -> dict[str, int]:
    """`--context-parallel` as `ContextParallelConfig` degrees: "ulysses=2,ring=2" -> {"ulysses_degree": 2, ...}."""
    degrees = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in ("ulysses", "ring") or not value.isdigit() or int(value) < 1 or f"{name}_degree" in degrees:
            raise ValueError(f"context_parallel={text!r}: expected ulysses=N, ring=N or both, comma-separated "
                             "(e.g. 'ulysses=2')")
        degrees[f"{name}_degree"] = int(value)
    if all(degree == 1 for degree in degrees.values()):
        raise ValueError(f"context_parallel={text!r} splits over one rank: give ulysses or ring a degree above 1")
    return degrees
