"""Helpers shared by all tests: tiny offline pipelines (cached per config) and comparisons."""

import contextlib
import functools
import threading
import time
from typing import NamedTuple

import torch
from diffusers import DiffusionPipeline

from diffusers_stepbatch.testing import FluxSize, tiny_flux_pipeline

TOLERANCE = 1e-4  # max abs difference against the unwrapped diffusers pipeline, fp32 on CPU

FLUX_CONFIGS = {
    # name: (guidance_embeds, transformer size, vae_blocks)
    "dev-tiny": (True, FluxSize(), 2),
    "schnell-tiny": (False, FluxSize(), 2),
    "dev-wide": (True, FluxSize(num_layers=2, num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                joint_attention_dim=24, pooled_projection_dim=40, in_channels=8), 3),
}


@functools.lru_cache(maxsize=None)
def flux_pipe(name: str = "dev-tiny"):
    guidance_embeds, size, vae_blocks = FLUX_CONFIGS[name]
    return tiny_flux_pipeline(guidance_embeds=guidance_embeds, size=size, vae_blocks=vae_blocks)


def seeded(kwargs: dict) -> dict:
    """Replace an int `seed` entry by a fresh torch.Generator (generators are consumed by a call)."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return kwargs


@contextlib.contextmanager
def ip_adapter_scale(pipe, scale, restore: float):
    """`pipe`'s IP-Adapter scale is `scale` inside, `restore` again after (test pipelines are shared)."""
    pipe.set_ip_adapter_scale(scale)
    try:
        yield
    finally:
        pipe.set_ip_adapter_scale(restore)


def max_diff(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def count_forwards(module: torch.nn.Module):
    """Record the batch size of every forward of `module` (rows of its latents: a tensor's dim 0, or a list's
    entries for models that take one entry per image); returns (list, hook handle)."""
    sizes: list[int] = []

    def hook(_module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else kwargs.get("sample", kwargs.get("x")))
        sizes.append(len(hidden) if isinstance(hidden, list) else int(hidden.shape[0]))

    return sizes, module.register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------------------------
# Other families (SD3, Qwen-Image, SDXL, SD 1.5, and PixArt-Sigma through the generic program).
from diffusers_stepbatch.testing import (  # noqa: E402
    tiny_pixart_or_sana_pipeline,
    tiny_qwenimage_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
)

FAMILY_CONFIGS = {
    # name: (builder, builder kwargs, (height, width))
    "sd3-tiny": (tiny_sd3_pipeline, {}, (32, 32)),
    "sd3-patch2": (tiny_sd3_pipeline, dict(patch_size=2, num_layers=3, attention_head_dim=4, num_attention_heads=4,
                                           in_channels=8, vae_blocks=3), (32, 48)),
    "qwen-tiny": (tiny_qwenimage_pipeline, {}, (32, 32)),
    "qwen-wide": (tiny_qwenimage_pipeline, dict(num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                                text_hidden=24), (48, 32)),
    "sdxl-euler": (tiny_sdxl_pipeline, dict(scheduler="euler"), (32, 32)),
    "sdxl-dpm": (tiny_sdxl_pipeline, dict(scheduler="dpm"), (32, 40)),
    "sd-euler": (tiny_sd_pipeline, dict(scheduler="euler"), (40, 32)),
    "sd-dpm": (tiny_sd_pipeline, dict(scheduler="dpm"), (32, 32)),
    "pixart-tiny": (tiny_pixart_or_sana_pipeline, {}, (32, 32)),
    "pixart-wide": (tiny_pixart_or_sana_pipeline, dict(num_layers=2, attention_head_dim=4, num_attention_heads=4),
                    (24, 40)),
}


@functools.lru_cache(maxsize=None)
def family_pipe(name: str):
    builder, kwargs, _ = FAMILY_CONFIGS[name]
    return builder(**kwargs)


def family_size(name: str) -> tuple[int, int]:
    return FAMILY_CONFIGS[name][2]


def submit_all(sb, requests: list[dict]) -> list:
    """Submit every request at once (seeded) and return their results in order."""
    futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
    return [future.result(timeout=300) for future in futures]


def output_images(output):
    """The images of a pipeline output, whether `return_dict` was True or False."""
    return output[0] if isinstance(output, tuple) else output.images


class PlainAndWrapped(NamedTuple):
    plain: list  # each request's output, run plainly one after another
    wrapped: list  # the same requests submitted at once to StepBatched
    plain_rows: list[int]  # the denoiser's rows per forward in the plain runs
    wrapped_rows: list[int]  # and in the wrapped ones
    stats: dict  # the wrapped engine's stats()


def plain_and_wrapped(pipe, requests: list[dict], denoiser: torch.nn.Module | None = None,
                      **options) -> PlainAndWrapped:
    """The requests (seeded) run plainly, then submitted at once to `StepBatched(pipe, **options)`, with the rows
    of each forward of `denoiser` (the pipeline's transformer by default) on both sides."""
    from diffusers_stepbatch import StepBatched

    rows, hook = count_forwards(pipe.transformer if denoiser is None else denoiser)
    try:
        plain = [pipe(**seeded(kwargs)) for kwargs in requests]
        plain_rows = list(rows)
        rows.clear()
        with StepBatched(pipe, **options) as sb:
            wrapped = submit_all(sb, requests)
            stats = sb.stats()
    finally:
        hook.remove()
    return PlainAndWrapped(plain, wrapped, plain_rows, rows, stats)


def assert_batched_equals_solo(pipe, denoiser: torch.nn.Module, requests: list[dict], max_batch_size: int) -> None:
    """Submitted together, each request equals its solo unwrapped run, and batches > 1 really ran."""
    from diffusers_stepbatch import StepBatched

    expected = [output_images(pipe(**seeded(kwargs))) for kwargs in requests]
    sizes, hook = count_forwards(denoiser)
    try:
        with StepBatched(pipe, max_batch_size=max_batch_size) as sb:
            results = submit_all(sb, requests)
    finally:
        hook.remove()
    for kwargs, got, want in zip(requests, results, expected):
        assert max_diff(output_images(got), want) <= TOLERANCE, kwargs
    assert max(sizes) > 1, "the denoiser never ran a batch larger than one"
    assert max(sizes) <= max_batch_size


def held_out_changes(pipe, prompt: str, signal=None, runs: int = 4, **call) -> tuple[list[float], list[float]]:
    """The change pairs of `runs` seeded runs (seeds 0, 1, ...) on `prompt`, pooled: pairs a polynomial was not
    fitted on, the same whatever ran before (no draw from the global generator), and not left to one run's noise."""
    from diffusers_stepbatch.cache.teacache_fit import sampled_change_pairs

    return sampled_change_pairs(pipe, [prompt] * runs, 0, signal, **call)


def assert_polynomial_beats_a_constant(coefficients, xs: list[float], ys: list[float]) -> None:
    """A TeaCache rescale polynomial predicts the output changes `ys` from the signal changes `xs` (pairs it was
    not fitted on, `held_out_changes`) better than their mean does."""
    import numpy as np

    fitted = sum(abs(np.polyval(coefficients, x) - y) for x, y in zip(xs, ys))
    constant = sum(abs(sum(ys) / len(ys) - y) for y in ys)
    assert fitted < constant


def assert_teacache_shared_equals_alone(pipe, requests: list[dict], teacache, blocker: dict, plain=None) -> dict:
    """Under `teacache`, each request submitted with all of them (in lockstep behind `blocker`) equals it alone;
    a request with `teacache=None` equals its plain run (`plain(kwargs)`: its images; by default the pipeline's
    call) and every other one skipped steps. Returns the shared engine's `stats()`."""
    from diffusers_stepbatch import StepBatched

    plain = plain or (lambda kwargs: pipe(**seeded(kwargs)).images)
    exact = [plain({k: v for k, v in kwargs.items() if k != "teacache"}) for kwargs in requests]
    with StepBatched(pipe, teacache=teacache) as sb:
        solo = [sb(**seeded(kwargs)).images for kwargs in requests]
    with StepBatched(pipe, teacache=teacache, max_batch_size=16) as sb:
        with engine_held(sb, blocker):
            futures = [sb.submit(**seeded(kwargs)) for kwargs in requests]
        shared = [future.result(300).images for future in futures]
        stats = sb.stats()
    assert max(max_diff(got, want) for got, want in zip(shared, solo)) <= TOLERANCE
    computing = [i for i, kwargs in enumerate(requests) if "teacache" in kwargs and kwargs["teacache"] is None]
    assert all(max_diff(solo[i], exact[i]) <= TOLERANCE for i in computing)  # every step computed
    skipping = [i for i in range(len(requests)) if i not in computing]
    assert min(max_diff(solo[i], exact[i]) for i in skipping) > 10 * TOLERANCE, "TeaCache skipped no step"
    return stats


class BlockTokenPasses:
    """Per transformer forward (plain or packed): image tokens into `embedder`, and image tokens into `query` (the
    first block's image query projection, which the plain and the packed forwards both call)."""

    def __init__(self, embedder: torch.nn.Module, query: torch.nn.Module):
        self.forwards: list[list[int]] = []
        self._handles = [
            embedder.register_forward_pre_hook(
                lambda m, a: self.forwards.append([a[0].shape[:-1].numel(), 0, a[0].ndim == 2])),
            query.register_forward_pre_hook(self._entered),
        ]

    def _entered(self, module, args):
        self.forwards[-1][1] += args[0].shape[:-1].numel()

    @property
    def skipped(self) -> int:
        return sum(tokens - entered for tokens, entered, _ in self.forwards)

    @property
    def packed_with_skips(self) -> int:
        """Packed forwards in which some rows skipped the blocks and others ran them."""
        return sum(packed and 0 < entered < tokens for tokens, entered, packed in self.forwards)

    def remove(self):
        for handle in self._handles:
            handle.remove()


def call_with_delays(sb, calls: list[dict], delays_ms: list[int]) -> list:
    """Each call from its own thread after its delay (arrivals in random order); returns the images in order."""
    results = [None] * len(calls)

    def call(i):
        time.sleep(delays_ms[i] / 1000)
        results[i] = sb(**seeded(calls[i])).images

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def in_lockstep(sb, calls):
    """Plan every call before the engine runs a step, then drive the engine here: the batches are deterministic.

    `sb` must be fresh (its engine thread never started by a call).
    """
    assert not sb.engine.is_alive
    requests = [sb._make_request((), seeded(kwargs), 0, None) for kwargs in calls]
    for request in requests:
        sb.engine.scheduler.add(request)
    with torch.no_grad():
        while sb.engine.scheduler.has_work():
            sb.engine.step()
    return [output_images(request.handle.result()) for request in requests]


import pytest  # noqa: E402


@pytest.fixture
def single_thread():
    """Run a test's tiny models on one intra-op thread: on a shared 2-core CPU, waking a second thread for a
    32-wide matmul costs a scheduler quantum (~15 ms) while the matmul itself takes ~0.05 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


import contextlib  # noqa: E402


@contextlib.contextmanager
def engine_held(sb, blocker_kwargs: dict):
    """Hold the engine on a blocker request's step callback while the body submits, so every request submitted
    inside starts together, in lockstep; the blocker (`blocker_kwargs`, seeded) finishes on exit. A pipeline
    without step callbacks (HunyuanVideo 1.5) is held in the blocker's text-encoder call instead."""
    import inspect

    entered, released = threading.Event(), threading.Event()

    def hold_engine_once(step_pipe, i, t, tensors):
        entered.set()
        released.wait(60)
        return {}

    if "callback_on_step_end" in inspect.signature(type(sb.pipe).__call__).parameters:
        blocker = sb.submit(**seeded(dict(blocker_kwargs, callback_on_step_end=hold_engine_once)))
    else:
        encoder = sb.pipe.text_encoder

        def hold_encoder_once(*args, **kwargs):  # NOTE: the engine thread runs the merged encoder call
            del encoder.forward
            hold_engine_once(None, 0, None, {})
            return encoder.forward(*args, **kwargs)

        encoder.forward = hold_encoder_once
        blocker = sb.submit(**seeded(blocker_kwargs))
    assert entered.wait(60), "the blocker request never reached its step callback"
    try:
        yield
    finally:
        released.set()
        blocker.result(300)
        if "callback_on_step_end" not in inspect.signature(type(sb.pipe).__call__).parameters:
            vars(sb.pipe.text_encoder).pop("forward", None)  # NOTE: where the blocker never reached it


class ToyLoopPipeline(DiffusionPipeline):
    """A tiny denoising loop around any `unet(x, t)` for the generic program's tests; a model may also return
    (rows, a scalar), which the loop folds in."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, batch_size: int = 1, num_inference_steps: int = 3, generator=None):
        self.scheduler.set_timesteps(num_inference_steps)
        x = torch.randn(batch_size, 4, generator=generator)
        for t in self.scheduler.timesteps:
            out = self.unet(x, t.float().expand(batch_size) / 1000)
            out, extra = out if isinstance(out, tuple) else (out, 0.0)
            x = x - 0.1 * out + 0.01 * extra
        return x


# Per-row adapter sets for model-level LoRA tests ({}: the base model), and the plain reference for one row.
ROW_ADAPTERS = [{"a": 1.0}, {"b": 0.5}, {}, {"c": 0.6}, {"a": 0.3, "c": 1.0}]


def with_adapters(model: torch.nn.Module, adapters: dict, run, *args, **kwargs):
    """`run(*args, **kwargs)` with `adapters` ({name: weight}; {}: none) set on `model` by `set_adapters`, as a
    plain call."""
    if adapters:
        model.enable_lora()
        model.set_adapters(list(adapters), list(adapters.values()))
    else:
        model.disable_lora()
    try:
        return run(*args, **kwargs)
    finally:
        model.enable_lora()


def call_row(call: dict, row: int, rows: int) -> dict:
    """A model call's arguments for one of its `rows` rows: every tensor with the rows on dim 0 sliced."""
    return {name: value[row:row + 1] if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == rows
            else value for name, value in call.items()}


def add_lora_everywhere(model: torch.nn.Module, name: str = "all", rank: int = 2, seed: int = 1) -> None:
    """A random peft LoRA adapter `name` on every Linear and Conv layer of `model` (those already adapted too)."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    layer_types = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    targets, adapted = [], []
    for module_name, module in model.named_modules():
        if any(module_name.startswith(prefix + ".") for prefix in adapted):
            continue  # NOTE: a LoRA layer's own base layer and A/B matrices
        if isinstance(module, LoraLayer):
            adapted.append(module_name)
            targets.append(module_name)
        elif isinstance(module, layer_types):
            targets.append(module_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False),
                          adapter_name=name)
