"""`diffusers-stepbatch serve` and `python -m diffusers_stepbatch.serve`: run the server under uvicorn.

On SIGTERM / SIGINT the server stops accepting, answers new generation requests with 503, lets in-flight
requests finish for up to `--shutdown-timeout` seconds, closes the engine and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from typing import Any

from .config import API_KEY_ENV, DTYPES, ServeConfig
from .config_file import parse_with_config_file
from .lora_adapters import parse_lora_modules
from .request_id import configure_logging

logger = logging.getLogger(__name__)


def _number(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)


def call_default(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (key, value): VALUE read as JSON (`8`, `3.5`, `true`), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. num_inference_steps=8")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = ServeConfig(api_key="")
    add = parser.add_argument
    add("--model", default=defaults.model, help="'toy' (the shipped toy-shapes model), 'tiny-wan' / 'tiny-wan-i2v' "
        "(tiny random video pipelines, for trying the videos API) or a Hub id / local folder")
    add("--dtype", default=defaults.dtype, choices=DTYPES)
    add("--device", default=defaults.device, help="cpu, cuda, cuda:1, ...")
    add("--host", default=defaults.host)
    add("--port", type=int, default=defaults.port)
    add("--api-key", default=None, help=f"Bearer key for /v1/* (default: ${API_KEY_ENV}; none if unset)")
    add("--served-model-name", default=None, help="the `model` name clients use (default: toy-shapes / the model id)")
    add("--max-batch-size", type=int, default=defaults.max_batch_size, help="rows in one denoising forward")
    add("--policy", default=defaults.policy, choices=("fcfs", "sjf", "priority"))
    add("--max-wait-s", type=float, default=defaults.max_wait_s)
    add("--max-queue", type=int, default=defaults.max_queue, help="waiting requests before 429 (0: unbounded)")
    add("--on-unmeetable-deadline", default=defaults.on_unmeetable_deadline, choices=("reject", "queue"))
    add("--step-time-target-s", type=float, default=None)
    add("--cost-aware", action=argparse.BooleanOptionalAction, default=defaults.cost_aware)
    add("--exact", action="store_true", help="each request's model calls run alone: its solo run's bytes on any path")
    add("--burst-wait-s", type=float, default=defaults.burst_wait_s,
        help="an idle engine waits this long for calls being prepared, to start a burst in one batch (0: never)")
    add("--burst-settle-s", type=float, default=defaults.burst_settle_s,
        help="and until none arrived for this long (callers released together arrive a GIL switch apart)")
    add("--teacache", type=float, default=None, metavar="THRESHOLD", help="TeaCache threshold (e.g. 0.4)")
    add("--decoder", default=None, help="'pid' or another registered decoder name")
    add("--pid-exit-step", type=_number, default=None, help="step index K or a fraction of the steps")
    add("--edits", action=argparse.BooleanOptionalAction, default=defaults.edits,
        help="serve /v1/images/edits with the model's inpainting / img2img / reference-edit pipelines")
    add("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="largest request body (413 beyond)")
    add("--max-prompt-chars", type=int, default=defaults.max_prompt_chars, help="longest prompt")
    add("--max-input-images", type=int, default=defaults.max_input_images, help="most images in one edit")
    add("--max-image-pixels", type=int, default=defaults.max_image_pixels, help="most pixels of an input image")
    add("--allow-remote-images", action="store_true", help="let edits name http(s) image URLs (the server fetches)")
    add("--video-dir", default=None, help="where video jobs keep their files (default: a temporary folder)")
    add("--video-retention-s", type=float, default=defaults.video_retention_s,
        help="seconds a finished video job and its MP4 are kept")
    add("--max-video-jobs", type=int, default=defaults.max_video_jobs, help="video jobs kept at once")
    add("--video-fps", type=int, default=defaults.video_fps, help="frames per second of the MP4s")
    add("--max-video-frames", type=int, default=defaults.max_video_frames, help="most frames in one video")
    add("--video-preview-every", type=int, default=defaults.video_preview_every,
        help="a preview every this many steps on a video job's events (0: about ten per job)")
    presets = parser.add_argument_group("presets, call defaults, limits and logs")
    presets.add_argument("--preset", default=defaults.preset,
                         help="'auto': the model card's call defaults (docs/reference/presets.md), 'none', or a Hub id")
    presets.add_argument("--call-default", action="append", default=[], type=call_default, dest="call_defaults",
                         metavar="KEY=VALUE", help="a pipeline argument every request gets unless it sets it "
                         "(over the preset's; VALUE is JSON, else a string); repeatable")
    presets.add_argument("--max-steps", type=int, default=None, help="the most num_inference_steps a request may "
                         "ask for (default: the preset's, else the scheduler's num_train_timesteps)")
    presets.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH_OR_ID",
                         help="LoRA adapters loaded at startup (a folder, a .safetensors file or a Hub id); "
                         "requests pick them with \"lora\": {NAME: weight}")
    presets.add_argument("--lora-dir", default=None, help="a folder of LoRA adapters (NAME/ or NAME.safetensors), "
                         "each loaded on first use")
    presets.add_argument("--max-loras", type=int, default=defaults.max_loras,
                         help="--lora-dir adapters kept loaded at once (least recently used first out)")
    presets.add_argument("--log-format", default="text", choices=("text", "json"),
                         help="log lines as text or one JSON object each (both name the request id)")
    knobs = parser.add_argument_group("launch knobs")
    knobs.add_argument("--quantize", default=None, choices=("qint8", "qint4", "qfloat8"),
                       help="the transformer's weights with optimum-quanto (as StepBatched(quantize=))")
    knobs.add_argument("--offload", default=None, choices=("model", "sequential", "group"),
                       help="diffusers' model / sequential CPU offload, or group offload by blocks")
    knobs.add_argument("--compile", action="store_true", help="torch.compile the denoiser (dynamic shapes)")
    knobs.add_argument("--compile-backend", default=defaults.compile_backend, help="torch.compile's backend")
    knobs.add_argument("--attention-backend", default=None,
                       help="a diffusers attention dispatcher name: native, flex, flash, sage, ... (CUDA ones "
                       "need --device cuda)")
    knobs.add_argument("--vae-tiling", action="store_true", help="decode (and encode) in VAE tiles")
    knobs.add_argument("--warmup", type=int, default=defaults.warmup, metavar="N",
                       help="requests run at startup to prime the cost model (/health says 'warming' meanwhile)")
    knobs.add_argument("--context-parallel", default=None, metavar="ulysses=N|ring=N",
                       help="split the denoiser over the ranks of `torchrun --nproc-per-node N` (diffusers' "
                       "ContextParallelConfig); rank 0 serves, the others follow its model calls")
    knobs.add_argument("--config", default=None, metavar="FILE",
                       help="a TOML file of these flags (names with - or _); flags on the command line win")
    add("--api-keys", default=None, metavar="FILE", help="a TOML file of keys, each a tenant with its own limits "
        "(requests per minute, concurrency, priority cap, sizes); replaces --api-key")
    add("--fair-share", action=argparse.BooleanOptionalAction, default=defaults.fair_share,
        help="share denoising rows between tenants by their keys' weights (deficit round robin), the --policy "
             "ordering requests within a tenant")
    jobs = parser.add_argument_group("video jobs and replicas")
    jobs.add_argument("--state-dir", default=None, help="where the server keeps its jobs database (SQLite; default: "
                      "--video-dir, else a temporary folder removed at exit)")
    jobs.add_argument("--jobs-db", default=None, metavar="URL", help="a SQLAlchemy database URL for the jobs "
                      "instead (postgresql+psycopg://...: servers on one database share their jobs)")
    jobs.add_argument("--resume", action=argparse.BooleanOptionalAction, default=defaults.resume,
                      help="after a restart, run jobs that were running again from step 0 (--no-resume: fail them)")
    jobs.add_argument("--job-lease-s", type=float, default=defaults.job_lease_s,
                      help="seconds a replica's claim on a job lasts unrenewed; then another replica takes the job")
    jobs.add_argument("--jobs-poll-s", type=float, default=defaults.jobs_poll_s,
                      help="heartbeat: lease renewal, cancels made through other replicas, jobs to take over")
    jobs.add_argument("--replica-name", default=None, help="this server among replicas (default: host:port)")
    add("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s, dest="shutdown_timeout_s")
    add("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add("--access-log", action=argparse.BooleanOptionalAction, default=True)
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    names = {field.name for field in dataclasses.fields(ServeConfig)}
    values = {name: value for name, value in vars(args).items() if name in names}
    values["call_defaults"] = dict(values.get("call_defaults") or ())
    values["lora_modules"] = parse_lora_modules(values.get("lora_modules") or [])
    if values.get("max_queue") == 0:
        values["max_queue"] = None
    return ServeConfig(**values)


def run(config: ServeConfig, *, model: Any = None, log_level: str = "info", access_log: bool = True,
        sockets: list | None = None) -> None:
    """Serve `config` until SIGTERM / SIGINT (blocking), with the CLI's graceful shutdown; `model`: a
    `serve_pipeline(...)` you built (closed at shutdown), else the one `config` names.

    >>> run(config, model=serve_pipeline(pipe, config, call_defaults={"num_inference_steps": 8}))"""
    import uvicorn

    from .app import create_app

    app = create_app(config, model=model, close_model=True if model is not None else None)

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.server_state.begin_shutdown()  # NOTE: before uvicorn stops reading: late requests get 503
            super().handle_exit(sig, frame)

    # NOTE: log_config=None: uvicorn's loggers go through the root handler (request ids, --log-format)
    server = GracefulServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level, access_log=access_log, log_config=None,
        timeout_graceful_shutdown=config.shutdown_timeout_s, lifespan="on"))
    server.run(sockets=sockets)


def serve_main(argv: list[str] | None = None, prog: str = "python -m diffusers_stepbatch.serve") -> None:
    parser = add_serve_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))
    args = parse_with_config_file(parser, argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level, args.log_format)  # NOTE: after the checks: a bad flag changes nothing
    if config.context_parallel is not None:
        config = _on_this_rank(config)
        if config is None:
            return  # a follower rank: rank 0 closed
    run(config, log_level=args.log_level, access_log=args.access_log)


def _on_this_rank(config: ServeConfig) -> ServeConfig | None:
    """Under `--context-parallel`: rank 0 goes on to serve (its config, on its own GPU); the other ranks follow
    its model calls until it closes (None)."""
    import torch.distributed as dist

    from ..parallel.ranks import start_ranks

    start_ranks()
    if dist.get_rank() == 0:
        return _on_rank_device(config)
    follow_rank_0(config)
    return None


def _on_rank_device(config: ServeConfig) -> ServeConfig:
    from ..parallel.ranks import rank_device

    return dataclasses.replace(config, device=str(rank_device())) if config.device.startswith("cuda") else config


def follow_rank_0(config: ServeConfig) -> None:
    """A follower rank: load the model `config` names and make rank 0's model calls until it closes."""
    import torch.distributed as dist

    from ..parallel.ranks import start_ranks
    from .model import load_model

    start_ranks()
    model = load_model(_on_rank_device(config))
    # NOTE: on SIGTERM / Ctrl-C rank 0 finishes its requests first, which needs every follower: they stop
    # when rank 0 closes (or is gone)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: logger.info("rank %d stops when rank 0 closes", dist.get_rank()))
    model.sb.follow()
