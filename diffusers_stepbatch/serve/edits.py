"""Which pipeline serves an edit: inpainting with a mask, reference-image editing, or img2img without one.

`edit_pipelines(sb)` finds them once, at load: the served pipeline itself if it edits (its `__call__` takes
`image`, and `mask_image` for inpainting), else the inpainting and img2img pipelines diffusers' AutoPipelines
build from the same components (`AutoPipelineForInpainting.from_pipe`). Each runs as a sibling of the served
engine (`StepBatched.sibling`), so edits share its forwards.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

_GENERIC_TWINS: dict[type, type] = {}
# Reference-edit pipelines that take several input images as a list (the others read a list as a batch).
MULTI_IMAGE_PIPELINES = ("QwenImageEditPlusPipeline", "Flux2Pipeline", "Flux2KleinPipeline")


def _parameters(pipeline_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(pipeline_class.__call__).parameters)


def edit_task(pipeline_class: type) -> str | None:
    """"inpaint" (takes `mask_image`), "img2img" (`image` and `strength`), "reference" (`image` only) or None."""
    parameters = _parameters(pipeline_class)
    if "image" not in parameters:
        return None
    if "mask_image" in parameters:
        return "inpaint"
    return "img2img" if "strength" in parameters else "reference"


def takes_several_images(pipeline_class: type) -> bool:
    import diffusers

    known = [getattr(diffusers, name) for name in MULTI_IMAGE_PIPELINES if hasattr(diffusers, name)]
    return any(issubclass(pipeline_class, cls) for cls in known)


def edit_pipelines(sb: Any) -> dict[str, Any]:
    """Task -> `StepBatched` for the edits the served pipeline can do (siblings on `sb`'s engine)."""
    from ..toy.pipeline import ToyFluxPipeline

    pipe = sb.pipe
    task = edit_task(type(pipe))
    if task is not None:
        return {task: sb}
    if type(pipe) is ToyFluxPipeline:
        from ..toy.pipeline import ToyFluxImg2ImgPipeline, ToyFluxInpaintPipeline

        made = {"inpaint": ToyFluxInpaintPipeline(**pipe.components),
                "img2img": ToyFluxImg2ImgPipeline(**pipe.components)}
    else:
        made = _auto_pipelines(pipe)
    routes = {}
    for name, edit_pipe in made.items():
        edit_pipe.set_progress_bar_config(disable=True)
        try:
            routes[name] = sb.sibling(edit_pipe)
        except ValueError as exc:  # no step program for it: edits of that kind are not served
            logger.warning("not serving %s edits with %s: %s", name, type(edit_pipe).__name__, exc)
    return routes


def _auto_pipelines(pipe: Any) -> dict[str, Any]:
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    made = {}
    for name, auto in (("inpaint", AutoPipelineForInpainting), ("img2img", AutoPipelineForImage2Image)):
        try:
            made[name] = auto.from_pipe(pipe)
        except (ValueError, KeyError, TypeError) as exc:  # the family has no such pipeline
            logger.info("no %s pipeline for %s: %s", name, type(pipe).__name__, exc)
    return made


def generic_twin(sb: Any) -> Any:
    """`sb`'s pipeline served by the generic step program, as a sibling (None if it already is)."""
    from ..programs import program_for
    from ..programs.generic import plan_generic
    from ..programs.registry import register_program

    pipe = sb.pipe
    if program_for(pipe) is plan_generic:
        return None
    cls = type(pipe)
    if cls not in _GENERIC_TWINS:
        # NOTE: a subclass that keeps `__call__`: the same images, run by the generic program (whose denoiser
        # calls can merge with the edit pipelines', which the family program's can't).
        twin = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__doc__": cls.__doc__})
        register_program(twin)(plan_generic)
        _GENERIC_TWINS[cls] = twin
    twin_pipe = _GENERIC_TWINS[cls](**pipe.components)
    twin_pipe.set_progress_bar_config(disable=True)
    for name in ("default_sample_size",):
        if hasattr(pipe, name):
            setattr(twin_pipe, name, getattr(pipe, name))
    return sb.sibling(twin_pipe)


def check_reference_images(pipe: Any, images: list[Any]) -> None:
    """The pipeline's own check of its input images, where it has one (FLUX.2's `image_processor.check_image_input`:
    sides >= 64 px, aspect ratio <= 8), as a 400 naming the image; its `__call__` runs it only once queued."""
    from .protocol import bad_request

    check = getattr(getattr(pipe, "image_processor", None), "check_image_input", None)
    if check is None:
        return
    for index, image in enumerate(images):
        try:
            check(image)
        except ValueError as exc:
            param = "image" if index == 0 else f"image[{index}]"
            raise bad_request(f"{param}: {exc}", param, code="invalid_image") from None


def pick_edit(edits: dict[str, Any], has_mask: bool, model_name: str) -> tuple[str, Any]:
    """The task and engine for an edit request; a 400 when the served model can't do it."""
    from .protocol import bad_request

    if not edits:
        raise bad_request(f"{model_name} can't edit images: its pipeline takes no input image and no inpainting or "
                          f"img2img pipeline exists for its family; use /v1/images/generations", "image",
                          code="edits_not_supported")
    if has_mask:
        if "inpaint" not in edits:
            raise bad_request(f"mask: {model_name} edits without masks only (it has no inpainting pipeline); "
                              f"leave the mask out", "mask", code="unsupported_parameter")
        return "inpaint", edits["inpaint"]
    for task in ("reference", "img2img", "inpaint"):
        if task in edits:
            return task, edits[task]
    raise AssertionError("unreachable: edits is not empty")
