"""Fallback step program for any DiffusionPipeline without a family program.

Each request runs the pipeline's own `__call__`, unchanged, in a helper thread, on a per-request view of the
pipeline (shared models, its own scheduler copy and per-call state). On that view the denoiser (`transformer`,
`unet`, ...) is a proxy: every call of it becomes a work item that the request's step program hands to the
engine, and the result goes back to the helper. The engine merges calls of several requests whose
non-batch shapes and other arguments match (rows concatenated along dim 0, outputs cut back per request).
Control passes between the engine thread and a helper strictly in turn, so only one of them runs at a time.

What can't be merged safely runs alone: a call whose output isn't row-wise, or a whole pipeline call when its
denoiser can't be found or carries diffusers hooks (their cache state is per model, not per request).
"""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import threading
from collections.abc import Generator
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from ..engine.batch import WorkItem
from ..engine.split_reasons import named_key
from ..engine.ownership import current_owner, run_for
from ..models.calls import (
    DenoiserCall, NotRowWise, cut, describe_call, max_difference, probe_tolerance, run_call, slice_rows,
)
from ..module_scan import diffusers_hooks, marked_modules
from .options import PlanContext
from .registry import PlannedRequest, register_program, request_pipeline, unhooked_class
from .request_state import active_view
from .validation import as_list, check_generator, check_num_images_per_prompt, check_num_inference_steps

logger = logging.getLogger(__name__)

DENOISER_NAMES = ("transformer", "transformer_2", "unet", "prior")
_HOLDERS = "_holders"  # the input that carries each row's result holder through make_batch
_logged: set[tuple[str, str]] = set()
_not_rowwise: set[Any] = set()  # (model, call structure) pairs whose rows were not independent: they run alone
_verified: set[Any] = set()  # (model, call structure) pairs whose merged outputs matched separate calls


@register_program(DiffusionPipeline)
def plan_generic(pipe: DiffusionPipeline, args: dict[str, Any], context: PlanContext) -> PlannedRequest:
    """Validate what can be validated in the caller's thread and return the fallback step program."""
    _check_call(pipe, args)
    positional, keywords = _call_arguments(pipe, args)
    steps = _num_steps(args)
    prompts = as_list(args["prompt"]) if isinstance(args.get("prompt"), (str, list)) else None
    images = (len(prompts) if prompts else 1) * check_num_images_per_prompt(args.get("num_images_per_prompt"))
    branches = 2 if any(isinstance(args.get(name), (int, float)) and args[name] > 1
                        for name in ("guidance_scale", "true_cfg_scale")) else 1
    denoisers = [name for name in DENOISER_NAMES if isinstance(getattr(pipe, name, None), torch.nn.Module)]
    reason = _unbatchable_reason(pipe, denoisers, args)
    if reason is not None:
        _log_once(type(pipe).__name__, reason)
        program = _whole_call_program(request_pipeline(pipe, context), positional, keywords, reason)
    else:
        program = generic_program(pipe, request_pipeline(pipe, context), positional, keywords, denoisers)
    scale = getattr(pipe, "vae_scale_factor", None)
    tokens = 1  # unknown: the pipeline derives its default size itself
    if isinstance(scale, int) and all(isinstance(args.get(name), int) for name in ("height", "width")):
        tokens = (args["height"] // scale) * (args["width"] // scale)
    return PlannedRequest(program=program, num_rows=images * branches, num_steps=steps, tokens_per_row=tokens)


def _check_call(pipe, args: dict[str, Any]) -> None:
    """The shared checks, and the pipeline's own `check_inputs` where its arguments are plain call arguments."""
    if isinstance(args.get("callback_on_step_end"), (PipelineCallback, MultiPipelineCallbacks)):
        args = {**args, "callback_on_step_end_tensor_inputs": args["callback_on_step_end"].tensor_inputs}
    _num_steps(args)
    per_prompt = check_num_images_per_prompt(args.get("num_images_per_prompt"))
    if isinstance(args.get("prompt"), (str, list)):
        check_generator(args.get("generator"), len(as_list(args["prompt"])) * per_prompt)
    check = getattr(pipe, "check_inputs", None)
    if check is None or args.get("use_resolution_binning"):  # binning changes height and width before the check
        return
    values = {}
    for name, parameter in inspect.signature(check).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name in ("height", "width") and args.get(name) is None:
            return  # the pipeline derives a default size first; it checks again itself
        if name in args:
            values[name] = args[name]
        elif parameter.default is parameter.empty:
            return  # an argument __call__ computes: leave the check to the pipeline
    try:
        check(**values)
    except ValueError:
        raise
    except Exception as exc:  # our mapping doesn't fit this pipeline; its own __call__ still checks
        logger.debug("skipped %s.check_inputs in the caller: %r", type(pipe).__name__, exc)


def _num_steps(args: dict[str, Any]) -> int:
    for name in ("timesteps", "sigmas"):
        if args.get(name) is not None:
            return check_num_inference_steps(None, args[name])
    if args.get("num_inference_steps") is None:
        return 1
    return check_num_inference_steps(args["num_inference_steps"])


def _call_arguments(pipe, args: dict[str, Any]) -> tuple[list, dict]:
    """The bound call arguments (as the wrapper binds them) back into positional and keyword arguments."""
    positional, keywords = [], {}
    parameters = list(inspect.signature(unhooked_class(pipe).__call__).parameters.values())[1:]
    for parameter in parameters:
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


def _uses_pag(pipe, args: dict[str, Any]) -> bool:
    from diffusers.pipelines.pag.pag_utils import PAGMixin

    scale = args.get("pag_scale")
    return isinstance(pipe, PAGMixin) and isinstance(scale, (int, float)) and scale > 0


def _log_once(pipeline: str, reason: str) -> None:
    if (pipeline, reason) not in _logged:
        _logged.add((pipeline, reason))
        logger.info("StepBatched runs %s calls one at a time, unbatched: %s", pipeline, reason)


# ------------------------------------------------------------------------------------------ whole-call fallback
class _Holder:
    """Where a work item's real result waits for its request (outputs need not be row-wise tensors)."""

    __slots__ = ("output",)

    def __init__(self):
        self.output = None


def _whole_call_program(view, positional: list, keywords: dict, reason: str) -> Generator[WorkItem, Any, Any]:
    holder = _Holder()
    run = functools.partial(_run_whole_call, view, positional, keywords)
    key = named_key(program="generic.call", **{f"generic program: {reason}": id(holder)})
    yield WorkItem("call", key, {_HOLDERS: [holder]}, run, rows=1)
    return holder.output


def _run_whole_call(view, positional, keywords, _holders):
    with active_view(view):  # hooks and callbacks reading `sb.current_timestep` see this request's state
        _holders[0].output = view(*positional, **keywords)
    return torch.zeros(1)


# ----------------------------------------------------------------------------------------- batched denoiser
class _Aborted(BaseException):
    """Raised inside a helper thread to unwind the pipeline call of a request that was aborted or failed."""


class _Handoff:
    """The turn-taking between a request's step program (engine thread) and its helper thread."""

    def __init__(self):
        self.to_engine: queue.Queue = queue.Queue(maxsize=1)
        self.to_helper: queue.Queue = queue.Queue(maxsize=1)


class _DenoiserProxy:
    """Stands in for a denoiser on a request's view: calls go to the engine, attributes to the model."""

    def __init__(self, module: torch.nn.Module, handoff: _Handoff, scheduler: Any):
        self.__dict__["_module"] = module
        self.__dict__["_handoff"] = handoff
        self.__dict__["_scheduler"] = scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:  # as without the proxy: the shared model changes
        setattr(self._module, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        item, holder = denoiser_item(self._module, args, kwargs)
        item.step = _step_index(self._scheduler)
        self._handoff.to_engine.put(("call", item))
        if self._handoff.to_helper.get() is _Aborted:
            raise _Aborted()
        return holder.output


def generic_program(pipe, view, positional: list, keywords: dict,
                    denoisers: list[str]) -> Generator[WorkItem, Any, Any]:
    handoff = _Handoff()
    for name in denoisers:
        view.__dict__[name] = _DenoiserProxy(getattr(pipe, name), handoff, getattr(view, "scheduler", None))
    # NOTE: the helper works for this engine: a synchronous call of the same StepBatched from a callback raises.
    helper = threading.Thread(target=run_for(current_owner(), _run_in_helper), args=(view, positional, keywords,
                                                                                      handoff), daemon=True,
                              name=f"StepBatched-{type(pipe).__name__}-request")
    helper.start()
    kind = None
    try:
        while True:
            kind, payload = handoff.to_engine.get()
            if kind == "call":
                yield payload
                handoff.to_helper.put(None)
            elif kind == "done":
                return payload
            else:
                raise payload
    finally:
        if kind == "call":  # closed (aborted, or its batch failed) while the helper waits: unwind its call
            handoff.to_helper.put(_Aborted)
            while handoff.to_engine.get()[0] == "call":
                handoff.to_helper.put(_Aborted)
        helper.join()


def _step_index(scheduler) -> int | None:
    """The step the request's own scheduler is at (for progress and scheduling), if it tracks one."""
    if not hasattr(type(scheduler), "step_index"):
        return None
    return scheduler.step_index or 0  # None until the first scheduler.step: step 0


def _run_in_helper(view, positional, keywords, handoff: _Handoff) -> None:
    try:
        with torch.no_grad(), active_view(view):
            output = view(*positional, **keywords)
    except _Aborted:
        handoff.to_engine.put(("aborted", None))
    except BaseException as exc:  # the pipeline's own error: it becomes the request's error
        handoff.to_engine.put(("error", exc))
    else:
        handoff.to_engine.put(("done", output))


def denoiser_item(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[WorkItem, _Holder]:
    """One denoiser call as a work item; its key holds everything but the rows, so equal keys can merge.

    Which arguments are rows, and what must match, is the model layer's answer (`models/calls.py`).
    """
    holder = _Holder()
    call = describe_call(module, args, kwargs)
    # NOTE: one key field per argument, so stats()["splits"] names the argument that kept calls apart
    key = named_key(program="generic.denoise", model=id(module),
                    **{f"argument {name}": part for name, part in call.signature})
    reason = call.refusal
    if reason is None and call.rows is None:
        reason = "the denoiser's inputs have no batch rows"
    if reason is None and (id(module), call.structure) in _not_rowwise:
        reason = "merged outputs of these calls were not row-wise"
    rows = call.rows or 1
    if reason is not None:
        key = named_key(program="generic.alone", **{f"generic program: {reason}": id(holder)})
    inputs = {f"row{i}": value for i, value in enumerate(call.row_inputs)}
    inputs[_HOLDERS] = [holder] * rows
    run = functools.partial(_merged_call, module, call, key)
    return WorkItem("denoise", key, inputs, run, rows=rows), holder


def _merged_call(module, call: DenoiserCall, key, **inputs):
    holders = inputs.pop(_HOLDERS)
    total = len(holders)
    bounds, start = [], 0
    for i in range(1, total + 1):
        if i == total or holders[i] is not holders[start]:
            bounds.append((start, i))
            start = i
    output = run_call(module, call, inputs)
    if len(bounds) == 1:  # one request: its output as the model returned it
        holders[0].output = output
        return torch.zeros(total)
    lists_are_rows = call.support.output_lists_are_rows
    try:
        parts = [cut(output, begin, end, total, lists_are_rows) for begin, end in bounds]
    except NotRowWise as exc:
        parts = _apart(module, call, key, inputs, bounds, f"its output is not row-wise ({exc})")
    else:
        if not call.support.trusted and (id(module), call.structure) not in _verified:
            parts = _checked(module, call, key, inputs, bounds, parts)
    for (begin, _), part in zip(bounds, parts):
        holders[begin].output = part
    return torch.zeros(total)


def _checked(module, call: DenoiserCall, key, inputs, bounds, parts) -> list:
    """The first merged call of a signature on a model without proven row rules, checked against the same calls
    run apart: where the rows were not independent, the separate outputs stand and such calls run alone."""
    alone = [run_call(module, call, slice_rows(inputs, begin, end)) for begin, end in bounds]
    difference = max(max_difference(part, own) for part, own in zip(parts, alone))
    if difference > probe_tolerance(alone[0]):
        _not_rowwise.add((id(module), call.structure))
        _log_once(type(module).__name__, f"merged outputs differed from separate calls by {difference:.2e}; "
                                         "these calls run alone")
        return alone
    _verified.add((id(module), call.structure))
    return parts


def _apart(module, call: DenoiserCall, key, inputs, bounds, reason: str) -> list:
    _not_rowwise.add((id(module), call.structure))
    _log_once(type(module).__name__, f"{reason}; these calls run alone")
    return [run_call(module, call, slice_rows(inputs, begin, end)) for begin, end in bounds]
