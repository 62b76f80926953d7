"""Fallback step program for any DiffusionPipeline without a family program.

Each request runs the pipeline's own `__call__`, unchanged, in a helper thread, on a per-request view of the
pipeline (shared models, its own scheduler copy and per-call state). On that view the denoisers, text encoders
and VAE are proxies (`intercept.py`): their calls become work items that the engine merges across requests
through the model layer. Control passes between the engine thread and a helper strictly in turn.

A whole pipeline call runs alone when its denoiser can't be found, carries diffusers hooks (their state is
per model, not per request) or is driven by PAG (its attention processors are set for a whole call).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Generator
from typing import Any

import torch
from diffusers import DiffusionPipeline

from ...cache.prompt import PromptCache
from ...engine.batch import WorkItem
from ...engine.ownership import current_owner, run_for
from ...engine.split_reasons import named_key
from ...module_scan import PlannedModel, diffusers_hooks, execution_device, marked_modules, planned_model
from ..options import PlanContext
from ..pid.generic import plan_generic_pid_exit
from ..checks.generic_call import num_steps, parameters_after_self
from ..checks.program import check_program_call
from ..registry import PlannedRequest, register_program, request_pipeline, request_view, unhooked_class
from ...adapters.state import NOT_GIVEN, AdapterState, request_adapters
from ...models import support_for
from .intercept import ATTENTION_KWARGS, HOLDERS, Holder, ModelProxy, RequestTeaCache, log_once, packed_attention_for
from ..request_state import active_view
from ..checks.values import as_list, check_num_images_per_prompt

DENOISER_NAMES = ("transformer", "transformer_2", "unconditional_transformer", "unet", "prior", "decoder")
ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")


@register_program(DiffusionPipeline, features=("adapters", "teacache"))
def plan_generic(pipe: DiffusionPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate what can be validated in the caller's thread and return the fallback step program."""
    pid = plan_generic_pid_exit(pipe, args, context)  # PiD early exit (pid/generic.py); None: VAE decode
    if pid is not None:
        args = pid.call_args  # at 1/sr_scale, stopped after step K, latent output
    check_program_call(pipe, args)
    positional, keywords = _call_arguments(pipe, args)
    steps = num_steps(args)
    prompts = as_list(args["prompt"]) if isinstance(args.get("prompt"), (str, list)) else None
    images = (len(prompts) if prompts else 1) * check_num_images_per_prompt(args.get("num_images_per_prompt"))
    denoisers = _denoiser_names(pipe)
    branches = _guidance_branches(args, [getattr(pipe, name) for name in denoisers])
    reason = _unbatchable_reason(pipe, denoisers, args)
    if reason is None and context.options.teacache is not None:
        models = [getattr(pipe, name) for name in denoisers]
        if not any(support_for(model).teacache_forward for model in models):
            raise ValueError(f"teacache= is not supported for {type(pipe).__name__}: its denoiser "
                             f"({', '.join(type(model).__name__ for model in models)}) has no TeaCache forward")
        if any(getattr(model, "_hf_hook", None) is not None for model in models):
            raise ValueError("TeaCache calls the denoiser's blocks directly, which bypasses its model offload hook; "
                             "call pipe.to(device) instead of enable_model_cpu_offload(), or pass teacache=None")
    if reason is not None:
        for option, given in (("adapters=", context.adapters is not NOT_GIVEN),
                              ("teacache=", context.options.teacache is not None)):
            if given:
                raise ValueError(f"{option} is not supported for {type(pipe).__name__} here: its calls run whole "
                                 f"({reason})")
        log_once(type(pipe).__name__, f"whole calls, unbatched: {reason}")
        program = _whole_call_program(request_pipeline(pipe, context), positional, keywords, reason)
    else:
        per_row = {name: (_denoiser_adapters(getattr(pipe, name), args, context), context.options.teacache,
                          packed_attention_for(getattr(pipe, name), context.options.packed_attention))
                   for name in denoisers}
        view = request_pipeline(pipe, context)
        _fix_view_lookups(view, pipe)
        models = [getattr(pipe, name, None) for name in (*DENOISER_NAMES, *ENCODER_NAMES, "vae")]
        walks = {id(model): planned_model(model) for model in models
                 if isinstance(model, torch.nn.Module)}  # NOTE: from the walks this plan's scans made
        program = generic_program(pipe, view, positional, keywords, per_row, context.options.packed_attention,
                                  context.options.prompt_cache, walks)
    if pid is not None:
        program = pid.decoded(program)
    return PlannedRequest(program=program, num_rows=images * branches, num_steps=steps,
                          tokens_per_row=_latent_tokens(pipe, args))


def _latent_tokens(pipe, args: dict[str, Any]) -> int:
    """Latent pixels (times latent frames for a video) of one row, as far as the call says; 1 when unknown (the
    pipeline derives its default size itself)."""
    scale = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if not isinstance(scale, int) or not all(isinstance(args.get(name), int) for name in ("height", "width")):
        return 1
    tokens = (args["height"] // scale) * (args["width"] // scale)
    frames, temporal = args.get("num_frames"), getattr(pipe, "vae_scale_factor_temporal", None)
    if isinstance(frames, int) and isinstance(temporal, int) and frames > 0:
        tokens *= (frames - 1) // temporal + 1
    return tokens


def _denoiser_names(pipe) -> list[str]:
    return [name for name in DENOISER_NAMES if isinstance(getattr(pipe, name, None), torch.nn.Module)]


def _fix_view_lookups(view, pipe) -> None:
    """The view answers two of diffusers' lookups as a plain call would find them, without their cost per call:
    `_execution_device` with the device found at submit (diffusers walks every module of every model for it), and
    `_get_signature_keys` from its first answer per class (an `inspect.signature` of `__init__` each time, e.g. for
    `components` at the end of every call)."""
    view.__class__ = _view_class(type(view))
    try:
        view.__dict__[_DEVICE] = execution_device(pipe)
    except Exception:  # NOTE: a pipeline that can't answer at submit: its call asks (and fails) as it would plainly
        pass


_DEVICE = "_stepbatch_execution_device"


@functools.cache
def _view_class(cls: type) -> type:
    def fixed_device(self):
        device = self.__dict__.get(_DEVICE)
        return device if device is not None else super(view_class, self)._execution_device

    def signature_keys(_, obj) -> tuple[list[str], list[str]]:
        owner = obj if isinstance(obj, type) else type(obj)
        expected, optional = _signature_keys(cls, owner, tuple(getattr(cls, "_optional_components", ())))
        return list(expected), list(optional)

    view_class = type(cls.__name__, (cls,), {
        "_execution_device": property(fixed_device, doc="The execution device found at submit."),
        "_get_signature_keys": classmethod(signature_keys),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return view_class


@functools.cache
def _signature_keys(cls: type, owner: type, optional_components: tuple) -> tuple[list[str], list[str]]:
    return cls._get_signature_keys(owner)  # NOTE: `optional_components` is in the cache key: the answer reads it


def _guidance_branches(args: dict[str, Any], denoisers: list) -> int:
    """Rows per image: 2 under classifier-free guidance, as far as the call's arguments tell (an estimate)."""
    def above_one(name: str) -> bool:
        return isinstance(args.get(name), (int, float)) and args[name] > 1

    distilled = any(getattr(getattr(model, "config", None), "guidance_embeds", False) for model in denoisers)
    negative = any(args.get(name) is not None for name in ("negative_prompt", "negative_prompt_embeds"))
    # NOTE: a guidance-distilled model takes guidance_scale as an input, not as a second branch (FLUX.1 dev);
    # true CFG needs a negative prompt (FLUX.1, Qwen-Image)
    return 2 if (above_one("guidance_scale") and not distilled) or (above_one("true_cfg_scale") and negative) else 1


def _call_arguments(pipe, args: dict[str, Any]) -> tuple[list, dict]:
    """The bound call arguments (as the wrapper binds them) back into positional and keyword arguments."""
    positional, keywords = [], {}
    for parameter in parameters_after_self(unhooked_class(pipe).__call__):
        if parameter.name not in args:
            continue
        value = args[parameter.name]
        if parameter.kind == parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif parameter.kind == parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif parameter.kind == parameter.VAR_KEYWORD:
            keywords.update(value)
        else:
            keywords[parameter.name] = value
    return positional, keywords


def _unbatchable_reason(pipe, denoisers: list[str], args: dict[str, Any]) -> str | None:
    if not denoisers:
        return f"no denoiser found among {list(DENOISER_NAMES)}"
    if _uses_pag(pipe, args):
        # NOTE: PAG swaps the shared denoiser's attention processors for the length of one call, and they split
        # the batch into positional chunks (uncond / cond / perturbed): no other call may run meanwhile.
        return "perturbed-attention guidance sets attention processors on the shared denoiser for its whole call"
    for name in denoisers:
        for _, module in marked_modules(getattr(pipe, name)):
            hooks = diffusers_hooks(module)
            if hooks:
                return f"pipe.{name} has diffusers hooks ({list(hooks)}), whose state is not per request"
    return None


def _denoiser_adapters(model, args: dict[str, Any], context: PlanContext) -> AdapterState | None:
    """The request's LoRA for `model` (its `adapters=`, or the active adapters), times its attention kwargs' scale;
    None where the model layer can't apply LoRA per row (calls then run with the model's own adapters)."""
    if not support_for(model).lora_rows:
        if context.adapters is not NOT_GIVEN:
            raise ValueError(f"adapters= is not supported for {type(model).__name__}: per-request LoRA needs rows "
                             "its layers can be mapped to; set the adapters on the pipeline with set_adapters")
        return None
    scale = next((args[name].get("scale") for name in ATTENTION_KWARGS if isinstance(args.get(name), dict)), None)
    return request_adapters(model, context.adapters, lora_scale=scale)


def _uses_pag(pipe, args: dict[str, Any]) -> bool:
    from diffusers.pipelines.pag.pag_utils import PAGMixin

    scale = args.get("pag_scale")
    return isinstance(pipe, PAGMixin) and isinstance(scale, (int, float)) and scale > 0


# ------------------------------------------------------------------------------------------ whole-call fallback
def _whole_call_program(view, positional: list, keywords: dict, reason: str) -> Generator[WorkItem, Any, Any]:
    holder = Holder()
    run = functools.partial(_run_whole_call, view, positional, keywords)
    key = named_key(program="generic.call", **{f"generic program: {reason}": id(holder)})
    yield WorkItem("call", key, {HOLDERS: [holder]}, run, rows=1)
    return holder.output


def _run_whole_call(view, positional, keywords, _holders):
    with active_view(view):  # hooks and callbacks reading `sb.current_timestep` see this request's state
        _holders[0].output = view(*positional, **keywords)
    return torch.zeros(1)


# ------------------------------------------------------------------------------------------ intercepted calls
class _Aborted(BaseException):
    """Raised inside a request's pipeline call to unwind it when the request was aborted or failed."""


class _Turns:
    """The turn-taking between a request's step program (engine thread) and its pipeline call (a helper thread):
    exactly one of them runs at a time.

    NOTE: a thread, not a greenlet of the engine thread: a C++ exception that torch raises and catches inside
    the call (transformers' processors provoke some) walks the C stack for its backtrace, and on a resumed
    greenlet that walk leaves the greenlet's stack and crashes the process.
    """

    def __init__(self, view, positional: list, keywords: dict):
        self._to_call: queue.SimpleQueue = queue.SimpleQueue()
        self._to_program: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=run_for(current_owner(), self._run), args=(view, positional, keywords),
                                        daemon=True, name=f"StepBatched-{type(view).__name__}-request")
        self.waiting = False  # the call waits at a model call for the step program

    def resume(self, value: Any = None) -> tuple[str, Any]:
        """From the step program: run the call until its next model call ("call", item) or its end."""
        if self._thread.ident is None:
            self._thread.start()
        else:
            self._to_call.put(value)
        message = self._to_program.get()
        self.waiting = message[0] == "call"
        if not self.waiting:
            self._thread.join()
        return message

    def submit(self, item: WorkItem) -> None:
        """From the pipeline call: hand `item` to the step program and wait until its result is in its holder."""
        self._to_program.put(("call", item))
        if self._to_call.get() is _Aborted:
            raise _Aborted()

    def _run(self, view, positional, keywords) -> None:
        try:
            message = _run_call(view, positional, keywords)
        except BaseException as exc:  # KeyboardInterrupt / SystemExit from a step callback: the request's error
            message = ("error", exc)
        self._to_program.put(message)


def _install_proxies(pipe, view, handoff: _Turns, denoisers: dict[str, tuple], packed_attention: str | None,
                     prompt_cache: PromptCache | None, walks: dict[int, PlannedModel]) -> None:
    """The request's view calls the engine for its denoisers, text encoders and VAE, and so do the views of the
    pipelines it calls (combined pipelines: prior then decoder). `walks`: each model as the plan found it, by id."""
    for name, sub_pipeline in list(view.__dict__.items()):
        if isinstance(sub_pipeline, DiffusionPipeline):
            sub_view = request_view(sub_pipeline)
            sub_denoisers = {name: (None, None, packed_attention_for(getattr(sub_pipeline, name), packed_attention))
                             for name in _denoiser_names(sub_pipeline)}
            _install_proxies(sub_pipeline, sub_view, handoff, sub_denoisers, packed_attention, prompt_cache, walks)
            view.__dict__[name] = sub_view
    scheduler = getattr(view, "scheduler", None)
    for name, (adapters, teacache, packed) in denoisers.items():
        model = getattr(pipe, name)
        if teacache is not None and support_for(model).teacache_forward is not None:
            teacache = RequestTeaCache(teacache, model, lambda: len(scheduler.timesteps))
        else:
            teacache = None
        view.__dict__[name] = ModelProxy(model, {"__call__": "denoise"}, handoff.submit,
                                         functools.partial(_step_index, scheduler), packed, adapters, teacache,
                                         walk=walks.get(id(model)))
    for name in ENCODER_NAMES:
        if isinstance(getattr(pipe, name, None), torch.nn.Module):
            model = getattr(pipe, name)
            view.__dict__[name] = ModelProxy(model, {"__call__": "encode"}, handoff.submit, cache=prompt_cache,
                                             walk=walks.get(id(model)))
    if isinstance(getattr(pipe, "vae", None), torch.nn.Module):
        view.__dict__["vae"] = ModelProxy(pipe.vae, {"encode": "vae_encode", "decode": "decode"}, handoff.submit,
                                          walk=walks.get(id(pipe.vae)))


def generic_program(pipe, view, positional: list, keywords: dict, denoisers: dict[str, tuple],
                    packed_attention: str | None = "auto", prompt_cache: PromptCache | None = None,
                    walks: dict[int, PlannedModel] | None = None) -> Generator[WorkItem, Any, Any]:
    """`denoisers`: per denoiser name, the request's (LoRA state, TeaCache config, packed attention), each may be
    None; `prompt_cache` answers text-encoder calls identical to earlier ones; `walks`: the models as the plan
    found them (modules, hooks), by model id."""
    turns = _Turns(view, positional, keywords)
    _install_proxies(pipe, view, turns, denoisers, packed_attention, prompt_cache, walks or {})
    try:
        kind, payload = turns.resume()
        while kind == "call":
            yield payload
            kind, payload = turns.resume(None)
        if kind == "error":
            raise payload
        return payload
    finally:
        while turns.waiting:  # closed (aborted, or its batch failed) at a model call: unwind the call
            turns.resume(_Aborted)


def _step_index(scheduler) -> int | None:
    """The step the request's own scheduler is at (for progress and scheduling), if it tracks one."""
    if not hasattr(type(scheduler), "step_index"):
        return None
    return scheduler.step_index or 0  # None until the first scheduler.step: step 0


def _run_call(view, positional, keywords) -> tuple[str, Any]:
    """The request's pipeline call, in its thread: ("done", output), ("error", exception) or ("aborted", None)."""
    try:
        with torch.no_grad(), active_view(view):
            output = view(*positional, **keywords)
    except _Aborted:
        return "aborted", None
    except Exception as exc:  # the pipeline's own error: it becomes the request's error
        return "error", exc
    return "done", output
