"""StepBatched: wrap a diffusers pipeline so that concurrent calls share batched denoising steps."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .adapters.state import NOT_GIVEN
from .buffers import LatentBuffers
from .cache.prompt import PromptCache
from .cache.teacache import TeaCacheConfig
from .decoders.registry import resolve_decoder
from .engine.core import EngineCore
from .engine.metrics import CallRecord
from .engine.request import Request, RequestHandle, next_request_id, start_in_caller
from .engine.scheduler import SchedulerConfig
from .module_scan import scan_scope
from .parallel import start_context_parallel
from .models.packing.attention import check_packed_attention
from .programs import program_for, registered_pipelines
from .programs.checks import check_call_inputs
from .programs.cfg import CFGPolicy
from .programs.generic import plan_generic
from .programs.options import PiDExitOptions, PlanContext, ProgramOptions
from .programs.pid.exit import check_pid_pipeline
from .programs.registry import check_feature, unhooked_class
from .programs.request_state import active_view_of, is_call_state
from .signature import ENGINE_DEFAULT, signed, wrapper_signature
from .streaming import stream_call

_OWN_ATTRIBUTES = frozenset({"pipe", "engine", "options", "pid", "parallel", "_plan", "_signature", "_finalizer",
                             "_calls", "_owner"})
_DEFAULT = ENGINE_DEFAULT  # "not given": a fresh PromptCache() for the engine, the engine's teacache for a call
# NOTE: the exit-time finalizer waits this long for the engine thread at most (it is a daemon thread).
_FINALIZER_JOIN_S = 2.0


class StepBatched:
    """A diffusers pipeline whose concurrent calls are merged into shared batches between denoising steps.

    Calls take the wrapped pipeline's own arguments and return its own output type; a request's output
    does not depend on which other requests shared its batches. Other attributes fall through to the
    wrapped pipeline.

    >>> from diffusers import FluxPipeline
    >>> from diffusers_stepbatch import StepBatched
    >>> pipe = StepBatched(FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev"), max_batch_size=8)
    >>> image = pipe("a cat", num_inference_steps=28).images[0]

    Args:
        pipe: the diffusers pipeline to serve.
        max_batch_size: the most rows (images x CFG branches) in one denoising forward (default 8).
        scheduler: admission policy, queue bound, deadlines and cost-aware batching (`SchedulerConfig`);
            `max_batch_size`, when given, replaces its `max_batch_size`.
        prompt_cache: a `PromptCache` (may be shared); by default a private one of 256 MiB; None encodes all.
        teacache: a `TeaCacheConfig` to skip steps whose blocks barely change the output; a call may pass its
            own `teacache=` (a config, or None for exact steps).
        cfg_policy: a `CFGPolicy` deciding whether CFG branches share one forward; by default by free memory.
        latent_buffers: reuse pre-allocated buffers in the denoising loop (bit-identical output).
        quantize: "qint8", "qint4" or "qfloat8": quantize the transformer's weights in place with optimum-quanto.
        decoder: decode with PiD instead of the VAE: a `PiDDecoder`, a `PiDDecoding` or a registered name ("pid");
            the main model then runs at 1/sr_scale of the requested size (docs/guides/pid.md).
        pid_exit_step: with `decoder`, the main-model steps before PiD takes over: K in [1, N], a fraction of the N
            steps, or None for N - 2. A call may pass `decoder=None` for a VAE decode at its full size.
        mixed_resolution: let requests of different sizes share one packed call (Flux, SD3, Qwen-Image) where
            measured to pay; False runs one call per size.
        packed_attention: attention inside a packed call: "auto", "recover_scatter", "flex" or "varlen" (CUDA);
            same outputs (docs/guides/mixed-resolutions.md).
        exact: replaces the scheduler config's `exact` (every request's model calls its own; docs/conformance.md).
        parallel: a diffusers `ContextParallelConfig`: inside `torchrun`, the denoiser runs split over the ranks;
            rank 0 runs the engine, the others call `follow()` (docs/guides/gpu.md).
    """

    def __init__(
        self,
        pipe: Any,
        *,
        max_batch_size: int | None = None,
        scheduler: SchedulerConfig | None = None,
        prompt_cache: PromptCache | None = _DEFAULT,
        teacache: TeaCacheConfig | None = None,
        cfg_policy: CFGPolicy | None = None,
        latent_buffers: bool = True,
        quantize: str | None = None,
        decoder: Any = None,
        pid_exit_step: int | float | None = None,
        mixed_resolution: bool = True,
        packed_attention: str = "auto",
        exact: bool | None = None,
        parallel: Any = None,
        _owner: StepBatched | None = None,
    ):
        plan = program_for(pipe)
        if plan is None:
            supported = ", ".join(cls.__name__ for cls in registered_pipelines())
            raise ValueError(f"StepBatched has no step program for {type(pipe).__name__}; supported: {supported}")
        _check_option("prompt_cache", prompt_cache, PromptCache, _DEFAULT)
        _check_option("teacache", teacache, TeaCacheConfig)
        if teacache is not None:
            check_feature(pipe, "teacache", "teacache=")
        _check_option("cfg_policy", cfg_policy, CFGPolicy)
        if quantize is not None:
            from .quantize import quantize_transformer

            quantize_transformer(pipe, weights=quantize)
        self.pid = _pid_options(pipe, decoder, pid_exit_step)
        self.parallel = _owner.parallel if _owner is not None else None
        if parallel is not None:
            if teacache is not None:
                raise ValueError("teacache= can't run under context parallelism: its forward drives the model's "
                                 "blocks past the hooks that split the sequence over the ranks")
            self.parallel = start_context_parallel(pipe, parallel)
        self.pipe = pipe
        self._plan = plan
        self._signature = inspect.signature(unhooked_class(pipe).__call__)
        self._calls = threading.local()  # per calling thread: the view of its last call (per-call state)
        # NOTE: a per-pipeline-class subclass whose __call__/submit show the pipeline's own signature.
        object.__setattr__(self, "__class__", _signed_class(unhooked_class(pipe)))
        self.options = ProgramOptions(
            prompt_cache=PromptCache() if prompt_cache is _DEFAULT else prompt_cache,
            teacache=teacache,
            cfg_policy=cfg_policy or CFGPolicy(),
            buffers=LatentBuffers() if latent_buffers else None,
            packed_attention=check_packed_attention(packed_attention),
        )
        self._owner = _owner
        if _owner is not None:
            self.engine, self._finalizer = _owner.engine, None
            return
        config = scheduler or SchedulerConfig()
        if max_batch_size is not None:
            config = dataclasses.replace(config, max_batch_size=max_batch_size)
        if exact is not None:
            config = dataclasses.replace(config, exact=exact)
        if not isinstance(mixed_resolution, bool):
            raise ValueError(f"mixed_resolution={mixed_resolution!r} must be True or False")
        self.engine = EngineCore(config, mixed_shapes=mixed_resolution, on_idle=_freeing_models_of(pipe))
        if self.parallel is not None and mixed_resolution:
            self.engine.packing_refusal = self.parallel.packing_refusal()
        # NOTE: the engine thread holds the engine, not this wrapper; when the wrapper is collected, stop it.
        self._finalizer = weakref.finalize(self, self.engine.close, True, _FINALIZER_JOIN_S)

    def sibling(self, pipe: Any) -> StepBatched:
        """A `StepBatched` for another pipeline over the same models, on this engine and prompt cache (VAE decode,
        exact steps); closing either closes the engine. `inpaint = sb.sibling(FluxInpaintPipeline(**sb.components))`
        """
        if self._owner is not None:
            return self._owner.sibling(pipe)
        return StepBatched(pipe, prompt_cache=self.options.prompt_cache, cfg_policy=self.options.cfg_policy,
                           latent_buffers=self.options.buffers is not None,
                           packed_attention=self.options.packed_attention, _owner=self)

    # ------------------------------------------------------------------------------------- calls
    def __call__(self, *args: Any, priority: int = 0, deadline: float | None = None, **kwargs: Any) -> Any:
        """Run one call, batched with whatever else is in flight; blocks until its output is ready."""
        handle = self.submit(*args, priority=priority, deadline=deadline, **kwargs)
        try:
            return handle.result()
        except BaseException:  # KeyboardInterrupt or an outer timeout: don't leave the request running
            handle.abort()
            raise
        finally:  # as after a plain call, this thread reads the call's state (`sb.num_timesteps`, ...)
            self._calls.view = handle.pipeline_view

    def submit(self, *args: Any, priority: int = 0, deadline: float | None = None, tenant: str | None = None,
               **kwargs: Any) -> RequestHandle:
        """Validate a call (bad input raises here) and queue it; returns a `concurrent.futures.Future` with `abort()`.

        `priority` (higher first), `deadline` (seconds from now), `tenant` (fair share), `adapters=` ({name: w}).
        """
        _check_request_options(priority, deadline)
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant={tenant!r} must be a str (a tenant's name) or None")
        if self.engine.in_engine_thread():
            raise RuntimeError("StepBatched cannot be called from its own engine thread (e.g. from a step callback)")
        if self.parallel is not None and self.parallel.rank != 0:
            raise RuntimeError(f"rank {self.parallel.rank} follows rank 0's model calls: call sb.follow() here and "
                               "make the calls on rank 0")
        with self.engine.preparing():  # NOTE: an idle engine waits for this call to start it with the others
            with scan_scope():  # NOTE: planning and the prologue read what each model looks like in one walk
                request = self._make_request(args, kwargs, priority, deadline)
                request.tenant = tenant
                if request.starts_in_caller:
                    start_in_caller(request)
            try:
                self.engine.submit(request)
            except BaseException:  # closed or full: the started program holds nothing the engine must release
                request.program.close()
                raise
        return request.handle

    def _make_request(self, args: tuple, kwargs: dict, priority: int, deadline: float | None) -> Request:
        """Bind and plan a call (in the caller's thread) into a `Request` the engine can run."""
        options = self.options
        teacache = kwargs.pop("teacache", _DEFAULT)
        if self.parallel is not None and not (teacache is _DEFAULT or teacache is None):
            raise ValueError("teacache= can't run under context parallelism (see StepBatched's parallel=)")
        if teacache is not _DEFAULT:
            _check_option("teacache", teacache, TeaCacheConfig)
            if teacache is not None:
                check_feature(self.pipe, "teacache", "teacache=")
            options = dataclasses.replace(options, teacache=teacache)
        adapters = kwargs.pop("adapters", NOT_GIVEN)
        if adapters is not NOT_GIVEN:
            check_feature(self.pipe, "adapters", "adapters=")
            if self.parallel is not None and adapters:
                raise ValueError("adapters= (per-request LoRA) can't run under context parallelism: the followers "
                                 "don't see a request's adapters; fuse or set them on every rank before launch")
        pid = self.pid
        decoder = kwargs.pop("decoder", _DEFAULT)
        if decoder is not _DEFAULT:
            if decoder is not None:
                shown = repr(decoder) if isinstance(decoder, str) else f"<{type(decoder).__name__}>"
                raise ValueError(
                    f"decoder={shown} in a call: a call can only turn the engine's PiD decoding off "
                    "(decoder=None: the VAE decodes at the requested size); for another decoder build another "
                    "StepBatched(pipe, decoder=...)"
                )
            pid = None
        call_args = self._bind(args, kwargs)
        check_call_inputs(self.pipe, call_args, self.engine.config.max_pixels,
                          family_program=self._plan is not plan_generic)
        context = PlanContext(options=options, pid=pid, adapters=adapters)
        planned = self._plan(self.pipe, call_args, context)
        views = context.views
        request_id = next_request_id()
        handle = RequestHandle(request_id, wake_engine=self.engine.wake)
        handle.pipeline_view = views[0] if views else None
        return Request(
            request_id=request_id,
            program=planned.program,
            handle=handle,
            num_rows=planned.num_rows,
            num_steps=planned.num_steps,
            tokens_per_row=planned.tokens_per_row,
            priority=priority,
            deadline=None if deadline is None else time.time() + deadline,
            starts_in_caller=planned.starts_in_caller,
        )

    async def agenerate(self, *args: Any, priority: int = 0, deadline: float | None = None, **kwargs: Any) -> Any:
        """`await sb.agenerate(...)`; cancelling the awaiting task aborts the request."""
        return await asyncio.wrap_future(self.submit(*args, priority=priority, deadline=deadline, **kwargs))

    def stream(self, *args: Any, preview_every: int = 4, priority: int = 0, deadline: float | None = None,
               tenant: str | None = None, **kwargs: Any) -> Iterator[Any]:
        """Yield a `StreamPreview` every `preview_every` steps, then the pipeline's output.

        A preview is the predicted clean latent shown through a linear latent-to-RGB map (`.images`).
        Stopping the iteration early aborts the request.

        >>> for item in sb.stream("a cat", num_inference_steps=28, preview_every=7):
        ...     show(item.images[0])
        """
        return stream_call(self, args, kwargs, preview_every, priority=priority, deadline=deadline, tenant=tenant)

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            bound = self._signature.bind(self.pipe, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(self.pipe).__name__}.__call__: {exc}") from None
        bound.apply_defaults()
        call_args = dict(bound.arguments)
        call_args.pop(next(iter(self._signature.parameters)))  # self
        return call_args

    # --------------------------------------------------------------------------------- lifecycle
    def reset_stats(self) -> None:
        """Zero the counters `stats()` reports (e.g. after a warm-up); what the engine has learned stays."""
        self.engine.metrics.reset()

    def stats(self) -> dict:
        """Engine statistics: batch-size histograms per work kind, finished requests, recent request timings."""
        snapshot = self.engine.metrics.snapshot()
        if self.options.prompt_cache is not None:
            snapshot["prompt_cache"] = dataclasses.asdict(self.options.prompt_cache.stats())
        snapshot.update(self.queue_lengths())
        if self.parallel is not None:
            snapshot["parallel"] = self.parallel.describe()
        return snapshot

    def queue_lengths(self) -> dict[str, int]:
        """Requests in the engine now: `{"running": admitted, "waiting": queued}` (all its pipelines together)."""
        scheduler = self.engine.scheduler
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting)}

    def recent_calls(self, seconds: float, kind: str | None = None) -> list[CallRecord]:
        """The engine's batched calls of the last `seconds`, oldest first: `sb.recent_calls(10.0, "denoise")`."""
        return self.engine.metrics.recent_calls(time.time() - seconds, kind)

    def register_prometheus(self, registry: Any = None) -> Any:
        """Expose engine metrics to Prometheus (needs `prometheus-client`); returns the collector."""
        from .engine.prometheus import register_collector

        return register_collector(self.engine.metrics, registry)

    def follow(self) -> int:
        """Under context parallelism, on a rank > 0: make rank 0's model calls until it closes (returns the count)."""
        if self.parallel is None:
            raise RuntimeError("follow() is for the ranks of StepBatched(pipe, parallel=ContextParallelConfig(...))")
        return self.parallel.follow()

    @property
    def rank(self) -> int:
        """This process's rank under context parallelism (0 runs the engine); 0 without it."""
        return 0 if self.parallel is None else self.parallel.rank

    def close(self, cancel_pending: bool = False) -> None:
        """Stop the engine thread; in-flight requests finish first unless `cancel_pending` cancels them. Under
        context parallelism rank 0's close also ends the followers' `follow()`."""
        self.engine.close(cancel_pending=cancel_pending)
        if self.parallel is not None and self._owner is None:
            self.parallel.close()

    def __enter__(self) -> StepBatched:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def to(self, *args: Any, **kwargs: Any) -> StepBatched:
        """Move the wrapped pipeline (as `DiffusionPipeline.to`) and return this wrapper."""
        self.pipe.to(*args, **kwargs)
        return self

    # ------------------------------------------------------------------------ attribute fall-through
    def __getattr__(self, name: str) -> Any:
        if name in _OWN_ATTRIBUTES:  # not set yet (during __init__): don't recurse into the pipe
            raise AttributeError(name)
        pipe = self.__dict__["pipe"]
        # NOTE: per-call state (guidance_scale, num_timesteps, current_timestep, ...) is the request's: inside
        # its callback or hooked forward, or, in the calling thread, that of the thread's last call.
        view = active_view_of(pipe)
        if view is None and "_calls" in self.__dict__:
            view = getattr(self.__dict__["_calls"], "view", None)
        if view is not None and is_call_state(pipe, view, name):
            return getattr(view, name)
        return getattr(pipe, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:  # e.g. `sb.scheduler = ...`: requests submitted afterwards copy the new scheduler
            setattr(self.pipe, name, value)

    def __repr__(self) -> str:
        return f"StepBatched({type(self.pipe).__name__}, {self.engine.config})"


def _check_request_options(priority: Any, deadline: Any) -> None:
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"priority={priority!r} must be an int (higher runs first under policy='priority')")
    if deadline is None:
        return
    if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real):
        raise TypeError(f"deadline={deadline!r} must be a number of seconds from now, or None")
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"deadline={deadline} must be a positive, finite number of seconds from now (or None)")


@functools.cache
def _signed_class(pipeline_class: type) -> type:
    """A StepBatched subclass whose entry points carry `pipeline_class.__call__`'s signature (see signature.py)."""
    base = StepBatched
    call_signature = wrapper_signature(pipeline_class.__call__)
    stream_signature = wrapper_signature(pipeline_class.__call__, stream=True)

    def __call__(self, *args, **kwargs):
        return base.__call__(self, *args, **kwargs)

    def submit(self, *args, **kwargs):
        return base.submit(self, *args, **kwargs)

    async def agenerate(self, *args, **kwargs):
        return await base.agenerate(self, *args, **kwargs)

    def stream(self, *args, **kwargs):
        return base.stream(self, *args, **kwargs)

    namespace = {
        "__call__": signed(__call__, call_signature, base.__call__.__doc__),
        "submit": signed(submit, call_signature, base.submit.__doc__),
        "agenerate": signed(agenerate, call_signature, base.agenerate.__doc__),
        "stream": signed(stream, stream_signature, base.stream.__doc__),
        "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
    }
    return type(base.__name__, (base,), namespace)


def _freeing_models_of(pipe: Any) -> Callable[[], None]:
    """What the engine runs once its work runs out: the pipeline's `maybe_free_model_hooks`, as at the end of a
    plain call (offloaded models back to the CPU, stateful diffusers hooks reset).

    NOTE: through a weak reference: the engine thread must not keep the pipeline alive (in hook mode the pipeline
    holds this wrapper, whose collection closes the engine).
    """
    pipeline = weakref.ref(pipe)

    def free_models() -> None:
        pipe = pipeline()
        if pipe is not None:
            pipe.maybe_free_model_hooks()

    return free_models


def _check_option(name: str, value: Any, expected: type, *allowed: Any) -> None:
    if value is None or isinstance(value, expected) or any(value is a for a in allowed):
        return
    raise ValueError(f"{name}={value!r} must be a {expected.__name__} or None")


def _pid_options(pipe: Any, decoder: Any, pid_exit_step: int | float | None) -> PiDExitOptions | None:
    if decoder is None:
        if pid_exit_step is not None:
            raise ValueError(f"pid_exit_step={pid_exit_step!r} needs a PiD decoder: pass decoder=... too")
        return None
    decoding = resolve_decoder(decoder, pipe)
    check_pid_pipeline(pipe, decoding)
    return PiDExitOptions(decoding, pid_exit_step)
