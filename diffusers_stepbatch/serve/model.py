"""`ServingModel`: the engine a server runs, its name, default call arguments, sizes and edit pipelines."""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from .config import TINY_VIDEO_MODELS, TOY_MODEL, ServeConfig
from .presets import DEFAULT_MAX_STEPS, ModelPreset, find_preset, preset_named
from .size_limits import model_sizes
from .sizes import SizeRange

logger = logging.getLogger(__name__)

EDIT_TASKS = ("inpaint", "reference", "img2img")
PAGE_ARGUMENTS = ("negative_prompt", "guidance_scale", "true_cfg_scale", "num_images_per_prompt")


@dataclass
class ServingModel:
    """One `StepBatched` engine behind a server.

    Args:
        sb, name: the engine and the model name clients pass as `model`.
        call_defaults: pipeline arguments every request gets unless it sets them (the toy's size and steps).
        sizes: the sizes the model draws (others are a 400); None: any size the pipeline takes.
        edits: task ("inpaint", "reference", "img2img") -> the sibling engine serving those edits.
        generic_twin: `sb`'s pipeline under the generic program, where generations go while edits run, so that
            they share forwards (the same images either way).
        max_steps: the most `num_inference_steps` a request may ask for; preset: the Hub id of the preset in force.
    """

    sb: Any
    name: str
    call_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = 0
    sizes: SizeRange | None = None
    edits: dict[str, Any] = field(default_factory=dict)
    generic_twin: Any = None
    max_steps: int = DEFAULT_MAX_STEPS
    preset: str | None = None
    lora: Any = None  # `lora_adapters.LoraAdapters`, where the server offers adapters

    def __post_init__(self):
        self.parameters = frozenset(inspect.signature(type(self.sb.pipe).__call__).parameters)
        self._edits_in_flight = 0
        self._lock = threading.Lock()

    @property
    def makes_videos(self) -> bool:
        """A video pipeline: its `__call__` takes `num_frames` and its output has `.frames` (served on /v1/videos)."""
        return "num_frames" in self.parameters

    @property
    def image_to_video(self) -> bool:
        """A video pipeline that starts from an image (`input_reference`)."""
        return self.makes_videos and "image" in self.parameters

    def accepts(self, argument: str, sb: Any = None) -> bool:
        """Whether the wrapped pipeline's (or `sb`'s) `__call__` takes `argument`."""
        if sb is None or sb is self.sb:
            return argument in self.parameters
        return argument in inspect.signature(type(sb.pipe).__call__).parameters

    @property
    def default_size(self) -> tuple[int, int]:
        """(width, height) of a request without `size`."""
        pipe = self.sb.pipe
        fallback = getattr(pipe, "default_sample_size", 64) * getattr(pipe, "vae_scale_factor", 8)
        return self.call_defaults.get("width", fallback), self.call_defaults.get("height", fallback)

    def generation_engine(self) -> Any:
        """Where a generation goes now: the generic twin while edits run (so they share forwards), else `sb`."""
        return self.generic_twin if self.generic_twin is not None and self._edits_in_flight else self.sb

    def edit_started(self) -> None:
        with self._lock:
            self._edits_in_flight += 1

    def edit_finished(self) -> None:
        with self._lock:
            self._edits_in_flight -= 1

    def card(self) -> dict[str, Any]:
        """What `/v1/models` says about an image model beyond OpenAI's fields (a video model's: `video_card`)."""
        width, height = self.default_size
        return {"pipeline": type(self.sb.pipe).__name__, "kind": "image", "default_size": f"{width}x{height}",
                "sizes": None if self.sizes is None else self.sizes.card(),
                "edits": {task: type(sb.pipe).__name__ for task, sb in self.edits.items()},
                "arguments": [name for name in PAGE_ARGUMENTS if self.accepts(name)], **self.defaults_card()}

    def defaults_card(self) -> dict[str, Any]:
        """The call defaults in force, the step cap and the preset they come from (`/v1/models`)."""
        defaults = {k: v for k, v in self.call_defaults.items() if self.accepts(k)}
        return {"call_defaults": defaults, "max_steps": self.max_steps, "preset": self.preset,
                "lora": None if self.lora is None else self.lora.card()}

    def engine_alive(self) -> bool:
        """False once the engine's thread has died (`_thread` is None until the first request)."""
        engine = self.sb.engine
        return getattr(engine, "_thread", None) is None or engine.is_alive

    def close(self) -> None:
        self.sb.close()


def load_model(config: ServeConfig) -> ServingModel:
    """Load the pipeline `config.model` names and wrap it in a `StepBatched` engine (with its edit pipelines).

    >>> model = load_model(ServeConfig())   # the toy model: offline, ~0.2 s
    """
    import torch

    dtype = getattr(torch, config.dtype)
    if config.model == TOY_MODEL:
        from ..toy import DEFAULT_GUIDANCE, DEFAULT_STEPS, MAX_SEQUENCE_LENGTH, NATIVE_SIZE, load_pipeline
        from ..toy.build import MAX_ASPECT, MAX_SIDE, MIN_SIDE, SIZE_MULTIPLE

        pipe = load_pipeline(device=config.device, dtype=dtype)
        # NOTE: the toy model was trained on 16 text tokens; FluxPipeline's default of 512 pads far beyond that.
        defaults = {"height": NATIVE_SIZE, "width": NATIVE_SIZE, "num_inference_steps": DEFAULT_STEPS,
                    "guidance_scale": DEFAULT_GUIDANCE, "max_sequence_length": MAX_SEQUENCE_LENGTH}
        return serve_pipeline(pipe, config, call_defaults=defaults,
                              sizes=SizeRange(MIN_SIDE, MAX_SIDE, SIZE_MULTIPLE, MAX_ASPECT))
    if config.model in TINY_VIDEO_MODELS:
        from ..toy.video import tiny_wan_pipeline

        pipe = tiny_wan_pipeline(image_to_video=TINY_VIDEO_MODELS[config.model])
        if config.device != "cpu" or dtype != torch.float32:  # NOTE: built in fp32 on the CPU; `.to` warns for Wan
            pipe = pipe.to(config.device, dtype)
        return serve_pipeline(pipe, config,
                              call_defaults={"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 4})
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(config.model, dtype=dtype)
    if config.offload is None:  # NOTE: offloading places the models itself
        pipe = pipe.to(config.device)
    return serve_pipeline(pipe, config, preset=preset_of(config, pipe))


def preset_of(config: ServeConfig, pipe: Any) -> ModelPreset | None:
    """`config.preset`: "auto" (found by the model id or folder), "none", or a known Hub id."""
    if config.preset == "none":
        return None
    return find_preset(config.model, pipe) if config.preset == "auto" else preset_named(config.preset)


def serve_pipeline(pipe: Any, config: ServeConfig, *, call_defaults: dict[str, Any] | None = None,
                   sizes: SizeRange | None = None, preset: ModelPreset | None = None) -> ServingModel:
    """A pipeline already built as a server's model (its engine as `config` says, with its edit pipelines).

    Call defaults, lowest first: `preset`'s, `call_defaults`, `config.call_defaults`, a request's own. Without
    `sizes`: those `preset` and the model's position embeddings allow.

    >>> app = create_app(config, model=serve_pipeline(pipe, config, call_defaults={"num_inference_steps": 8}))"""
    import time

    defaults = {**(preset.call_defaults if preset else {}), **(call_defaults or {}), **config.call_defaults}

    from ..cache.teacache import TeaCacheConfig
    from ..wrapper import StepBatched
    from .edits import edit_pipelines, generic_twin
    from .launch_knobs import apply_knobs

    pipe.set_progress_bar_config(disable=True)
    apply_knobs(pipe, config)
    sb = StepBatched(
        pipe,
        scheduler=config.scheduler_config(),
        teacache=None if config.teacache is None else TeaCacheConfig(threshold=config.teacache),
        decoder=config.decoder,
        pid_exit_step=config.pid_exit_step,
        parallel=_context_parallel(config),
    )
    lora = None
    if config.lora_modules or config.lora_dir:
        from .lora_adapters import LoraAdapters

        lora = LoraAdapters(sb, config.lora_modules, config.lora_dir, config.max_loras)
    # NOTE: an image-to-video pipeline takes `image` too, but it is served on /v1/videos, never as an image edit
    video = "num_frames" in inspect.signature(type(pipe).__call__).parameters
    edits = edit_pipelines(sb) if config.edits and not video else {}
    twin = generic_twin(sb) if edits and config.teacache is None and config.decoder is None else None
    if sizes is None and not video:
        fallback = getattr(pipe, "default_sample_size", 64) * getattr(pipe, "vae_scale_factor", 8)
        default = (defaults.get("width", fallback), defaults.get("height", fallback))
        sizes = model_sizes(pipe, default, **({} if preset is None else {
            "min_side": preset.min_side, "max_side": preset.max_side, "max_aspect": preset.max_aspect}))
        if not sizes.accepts(*default):  # NOTE: a preset's size beyond a smaller local model: its closest
            defaults["width"], defaults["height"] = sizes.nearest(*default)
    # NOTE: without a preset, the scheduler's training timesteps: more steps than those repeat timesteps
    trained = getattr(getattr(pipe, "scheduler", None), "config", {}).get("num_train_timesteps") or DEFAULT_MAX_STEPS
    max_steps = config.max_steps or (preset.max_steps if preset else int(trained))
    logger.info("serving %s as %r: %r; edits: %s; preset: %s; call defaults: %s", type(pipe).__name__,
                config.model_name, sb, sorted(edits) or "none", preset.hub_id if preset else "none", defaults)
    return ServingModel(sb=sb, name=config.model_name, call_defaults=defaults, created=int(time.time()),
                        sizes=sizes, edits=edits, generic_twin=twin, max_steps=max_steps,
                        preset=preset.hub_id if preset else None, lora=lora)


def _context_parallel(config: ServeConfig) -> Any:
    if config.context_parallel is None:
        return None
    from diffusers import ContextParallelConfig

    from .config import parse_context_parallel

    return ContextParallelConfig(**parse_context_parallel(config.context_parallel))
