"""PiD early-exit requests pack with ordinary ones in SD3's and Qwen-Image's mixed-resolution calls.

An engine built with a PiD decoder serves ordinary requests too: a call passing `decoder=None` is decoded by the
VAE at its own size. An early-exit request's denoise items are its family's ordinary ones at 1/sr_scale of the requested size, so
requests of several sizes, PiD or not, share packed transformer forwards. Each output must still equal its solo
run: the unwrapped pipeline for an ordinary request, the same early exit alone for a PiD one (whose equality to
the reference PiD decode of the pipeline's x_t is `test_pid_families.py`'s).
"""

from __future__ import annotations

import pytest
import torch

from diffusers_stepbatch import PiDDecoding, SchedulerConfig, StepBatched

from .references import TOLERANCE, in_lockstep, max_diff, seeded
from .test_pid_families import SR, call, pipe_for, tiny_pid

# NOTE: room for every request's CFG rows in one call; cost_aware=False, else the engine may split a group it
# measured to be faster in parts.
PACK_ALWAYS = SchedulerConfig(max_batch_size=16, cost_aware=False)
EXIT_STEP = 2


def requests_for(name):
    """Two PiD requests (64x96 and 128x64 outputs: the main model at 16x24 and 32x16) and two ordinary ones at
    other main-model sizes (32x32, 16x48), with different prompts, seeds, step counts and guidance."""
    qwen = name.startswith("qwen")
    scale = "true_cfg_scale" if qwen else "guidance_scale"
    pid = [call(name, "a red circle", steps=4, height=64, width=96, **{scale: 3.0}),
           call(name, "a blue square on gray", steps=3, height=128, width=64, **{scale: 5.0})]
    plain = [call(name, "a cat", steps=4, height=32, width=32, **{scale: 2.0}),
             call(name, "two birds over a lake", steps=3, height=16, width=48, **{scale: 4.0})]
    for i, kwargs in enumerate(pid + plain):
        kwargs.pop("generator")
        kwargs["seed"] = 10 + i
    return pid, plain


class DenoiserCalls:
    """Per transformer forward: whether its image tokens came packed, and the latent grids it embedded."""

    def __init__(self, transformer, qwen: bool):
        self.calls: list[dict] = []
        self._grids: set[tuple[int, ...]] = set()
        if qwen:  # NOTE: one img_in per forward ([tokens, channels] when packed); RoPE is built for every grid
            self.handles = [transformer.img_in.register_forward_pre_hook(self._qwen_call),
                            transformer.pos_embed.register_forward_pre_hook(self._qwen_grids, with_kwargs=True)]
        else:  # SD3: one patch embedding per part ([B, C, h, w]), one proj_out per forward (2-D when packed)
            self.handles = [transformer.pos_embed.register_forward_pre_hook(self._sd3_grid),
                            transformer.proj_out.register_forward_pre_hook(self._sd3_call)]

    def _qwen_call(self, _module, args):
        self.calls.append({"packed": args[0].dim() == 2, "grids": set()})

    def _qwen_grids(self, _module, args, _kwargs):
        self.calls[-1]["grids"].update(tuple(shape) for shape in args[0][0])

    def _sd3_grid(self, _module, args):
        self._grids.add(tuple(args[0].shape[-2:]))

    def _sd3_call(self, _module, args):
        self.calls.append({"packed": args[0].dim() == 2, "grids": self._grids})
        self._grids = set()

    def remove(self):
        for handle in self.handles:
            handle.remove()


def main_grid(name, pipe, height, width):
    """The latent grid the transformer embeds for a main-model size: (h, w) for SD3, (frames, h, w) for Qwen."""
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    return (1, h // 2, w // 2) if name.startswith("qwen") else (h, w)


@pytest.mark.parametrize("name", ["sd3-tiny", "sd3-patch2", "qwen-normalised"])
def test_pid_and_ordinary_requests_of_different_sizes_share_packed_calls_and_equal_solo(name):
    pipe = pipe_for(name)
    decoding = PiDDecoding(tiny_pid(name, seed=3), "pipeline")
    pid, plain = requests_for(name)
    expected_plain = [pipe(**seeded(kwargs)).images for kwargs in plain]
    with StepBatched(pipe, decoder=decoding, pid_exit_step=EXIT_STEP) as sb:
        expected_pid = [sb(**seeded(kwargs)).images for kwargs in pid]

    # NOTE: one engine serves both: an ordinary request turns its PiD decoding off with decoder=None.
    calls = DenoiserCalls(pipe.transformer, name.startswith("qwen"))
    try:
        sb = StepBatched(pipe, decoder=decoding, pid_exit_step=EXIT_STEP, scheduler=PACK_ALWAYS)
        got = in_lockstep(sb, pid + [dict(kwargs, decoder=None) for kwargs in plain])
        mixed = sb.stats()["mixed"]
        sb.close()
    finally:
        calls.remove()
    for kwargs, image, want in zip(pid + plain, got, expected_pid + expected_plain):
        assert image.shape == want.shape, kwargs
        assert max_diff(image, want) <= TOLERANCE, kwargs
    assert image.shape[-2:] == (16, 48) and got[0].shape[-2:] == (64, 96)
    assert mixed["calls"] > 0 and mixed["sizes_per_call"] >= 2, mixed
    pid_grids = {main_grid(name, pipe, k["height"] // SR, k["width"] // SR) for k in pid}
    plain_grids = {main_grid(name, pipe, k["height"], k["width"]) for k in plain}
    assert len(pid_grids | plain_grids) == 4
    packed = [call["grids"] for call in calls.calls if call["packed"]]
    assert any(grids & pid_grids and grids & plain_grids for grids in packed), (
        f"no packed call held an early-exit request's rows next to an ordinary request's: {packed}")
    assert any(len(grids & pid_grids) == 2 for grids in packed), "the two early-exit sizes never shared a call"


def test_a_call_can_only_turn_pid_off():
    pipe = pipe_for("sd3-tiny")
    decoding = PiDDecoding(tiny_pid("sd3-tiny"), "pipeline")
    with StepBatched(pipe, decoder=decoding, pid_exit_step=EXIT_STEP) as sb:
        for other in ("pid", decoding):
            with pytest.raises(ValueError, match=r"decoder=.* in a call: a call can only turn the engine's PiD"):
                sb.submit(**call("sd3-tiny", decoder=other))
        assert sb.stats()["requests_finished"] == {}  # nothing entered the engine
    kwargs = call("sd3-tiny", height=32, width=32, steps=2)
    want = pipe(**{**kwargs, "generator": torch.Generator().manual_seed(0)}).images
    with StepBatched(pipe) as sb:  # no PiD: decoder=None changes nothing
        got = sb(**kwargs, decoder=None).images
    assert max_diff(got, want) <= TOLERANCE
