"""PiD early exit through StepBatched: the main model stops at step K, PiD decodes x_t at the requested size."""

from __future__ import annotations

import threading

import numpy as np
import PIL.Image
import pytest
import torch

from diffusers_stepbatch import PiDDecoder, PiDDecoding, SchedulerConfig, StepBatched, register_decoder
from diffusers_stepbatch.decoders.pid import decode
from diffusers_stepbatch.decoders.registry import registered_decoders

from .pid_helpers import perturb_, single_thread
from .references import flux_pipe, max_diff

TOLERANCE = 1e-4
SR = 4
# A tiny PiD for the "dev-tiny" pipeline: 4-channel latents, vae_scale_factor 2, T5 embeddings of width 32.
TINY_PID = dict(
    num_groups=2, hidden_size=32, pixel_hidden_size=8, pixel_attn_hidden_size=16, pixel_num_groups=2, patch_depth=2,
    pixel_depth=1, patch_size=16, txt_embed_dim=32, txt_max_length=16, rope_ref_h=64, rope_ref_w=64,
    lq_latent_channels=4, lq_hidden_dim=16, lq_num_res_blocks=1, sr_scale=SR, latent_spatial_down_factor=2,
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def tiny_pid(seed: int = 0, **overrides) -> PiDDecoder:
    torch.manual_seed(seed)
    return perturb_(PiDDecoder(**{**TINY_PID, **overrides}), seed).eval()


class _FakeCaptionEncoder:
    """A stand-in for Gemma: a fixed embedding per character, counting the prompts it encodes."""

    def __init__(self, dim: int = 32, length: int = 16):
        self.table = torch.randn(256, dim, generator=torch.Generator().manual_seed(7))
        self.length = length
        self.encoded: list[str] = []

    def encode(self, prompts):
        self.encoded += list(prompts)
        codes = [[ord(c) % 256 for c in p[: self.length].ljust(self.length)] for p in prompts]
        return self.table[torch.tensor(codes)]


def call(prompt="a red circle", seed=0, height=64, width=96, steps=5, **kwargs):
    defaults = dict(prompt=prompt, height=height, width=width, num_inference_steps=steps, max_sequence_length=16,
                    output_type="pt", generator=torch.Generator().manual_seed(seed))
    return {**defaults, **kwargs}


def transformer_tokens(pipe):
    """Record the image-token count of every transformer forward."""
    tokens: list[int] = []

    def hook(_module, args, kwargs):
        tokens.append(int(kwargs["hidden_states"].shape[1]))

    return tokens, pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def test_pid_decode_of_several_requests_batched_equals_each_alone():
    pipe = flux_pipe("dev-tiny")
    decoding = PiDDecoding(tiny_pid(), text_encoder="pipeline")
    # NOTE: different prompts, seeds, guidance, images per prompt, step counts and exit steps; all reach their exit
    # at engine step 3, so the PiD rows (at different sigmas) share one decode.
    def calls():
        return [
            call("a red circle", seed=1, steps=5, guidance_scale=3.0),
            call("a blue square on a gray background", seed=2, steps=4, num_images_per_prompt=2),
            call(["a cat", "a dog"], seed=3, steps=6, guidance_scale=5.0),
        ]

    # NOTE: cost_aware=False: the engine may otherwise split a group it measured to be faster in parts.
    with StepBatched(pipe, decoder=decoding, pid_exit_step=3, scheduler=SchedulerConfig(cost_aware=False)) as sb:
        alone = [sb(**kwargs).images for kwargs in calls()]
        assert sb.stats()["rows_histogram"]["pid"] == {1: 1, 2: 2}
        # NOTE: a request at another size holds the engine in its first step's callback; the three are submitted
        # only once the engine is held there, so all of them are admitted in the same engine step (lockstep).
        entered, released = threading.Event(), threading.Event()

        def hold_engine(*_):
            entered.set()
            released.wait(60)
            return {}

        blocker = sb.submit(**call(height=32, width=32, steps=4, callback_on_step_end=hold_engine))
        assert entered.wait(60)
        handles = [sb.submit(**kwargs) for kwargs in calls()]
        released.set()
        together = [h.result().images for h in handles]
        blocker.result()
        histogram = sb.stats()["rows_histogram"]["pid"]
    assert histogram == {1: 2, 2: 2, 5: 1}, f"the three requests' PiD rows were not decoded in one call: {histogram}"
    for a, b in zip(alone, together):
        assert a.shape == b.shape
        assert max_diff(a, b) <= TOLERANCE
    # NOTE: rows really differ, so equality is not trivial.
    assert max_diff(together[1][0], together[1][1]) > 1e-2


def test_early_exit_equals_manual_decode_of_diffusers_x_t():
    """x_t after K steps of the unwrapped pipeline at 1/sr_scale, its sigma and T5 text, decoded by PiD."""
    pipe = flux_pipe("dev-tiny")
    decoder = tiny_pid(seed=1)
    steps, exit_step, height, width = 5, 3, 64, 96
    captured = {}

    def capture(_pipe, i, _t, tensors):
        if i == exit_step - 1:
            captured["latents"] = tensors["latents"].clone()
            captured["sigma"] = float(_pipe.scheduler.sigmas[exit_step])
        return tensors

    generator = torch.Generator().manual_seed(4)
    pipe(**{**call(seed=0, height=height // SR, width=width // SR, steps=steps), "generator": generator},
         callback_on_step_end=capture)
    embeds, _, _ = pipe.encode_prompt("a red circle", prompt_2=None, max_sequence_length=16)
    latent = pipe._unpack_latents(captured["latents"], height // SR, width // SR, pipe.vae_scale_factor)
    image = decode(decoder, latent, captured["sigma"], embeds, generator=[generator], height=height, width=width)
    expected = (image / 2 + 0.5).clamp(0, 1)

    with StepBatched(pipe, decoder=PiDDecoding(decoder, "pipeline"), pid_exit_step=exit_step) as sb:
        got = sb(**call(seed=4, height=height, width=width, steps=steps)).images
    assert 0 < captured["sigma"] < 1
    assert got.shape == (1, 3, height, width)
    assert max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize(
    "exit_step, steps, expected_forwards",
    [(None, 6, 4), (2, 6, 2), (0.5, 6, 3), (6, 6, 6), (1.0, 4, 4), (None, 2, 1)],
)
def test_main_model_runs_only_exit_steps_at_low_resolution(exit_step, steps, expected_forwards):
    pipe = flux_pipe("dev-tiny")
    height, width = 128, 64
    low_tokens = (height // SR // pipe.vae_scale_factor // 2) * (width // SR // pipe.vae_scale_factor // 2)
    tokens, handle = transformer_tokens(pipe)
    try:
        with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(), "pipeline"), pid_exit_step=exit_step) as sb:
            out = sb(**call(height=height, width=width, steps=steps))
            pil = sb(**call(height=height, width=width, steps=steps, output_type="pil")).images[0]
    finally:
        handle.remove()
    assert tokens == [low_tokens] * (2 * expected_forwards)
    assert out.images.shape == (1, 3, height, width)
    assert isinstance(pil, PIL.Image.Image) and pil.size == (width, height)
    assert np.allclose(np.asarray(pil) / 255.0, out.images[0].permute(1, 2, 0).numpy(), atol=1 / 255 + 1e-6)


def test_clean_exit_hands_pid_sigma_zero():
    pipe = flux_pipe("dev-tiny")
    sigmas = []
    decoding = PiDDecoding(tiny_pid(), "pipeline")
    original = decoding.decoder.forward

    def spy(x, t, y, lq_latent=None, degrade_sigma=None):
        sigmas.append(degrade_sigma.clone())
        return original(x, t, y, lq_latent=lq_latent, degrade_sigma=degrade_sigma)

    decoding.decoder.forward = spy
    with StepBatched(pipe, decoder=decoding, pid_exit_step=1.0) as sb:
        sb(**call(steps=3))
    with StepBatched(pipe, decoder=decoding, pid_exit_step=1) as sb:
        sb(**call(steps=3))
    assert len(sigmas) == 8  # 4 PiD steps per request
    assert all(float(s.max()) == 0.0 for s in sigmas[:4])
    assert all(0.0 < float(s.min()) < 1.0 for s in sigmas[4:])


def test_text_encoder_path_is_batched_and_cached():
    pipe = flux_pipe("dev-tiny")
    encoder = _FakeCaptionEncoder()
    with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(), text_encoder=encoder), pid_exit_step=2) as sb:
        first = sb(**call("a red circle", seed=5, steps=3, num_images_per_prompt=2)).images
        handles = [sb.submit(**call(p, seed=6, steps=3)) for p in ("a green cross", "a red circle", "a blue square")]
        [h.result() for h in handles]
        again = sb(**call("a red circle", seed=5, steps=3, num_images_per_prompt=2)).images
    # NOTE: each new caption reaches the text encoder once; repeats are served by the prompt cache.
    assert sorted(encoder.encoded) == ["a blue square", "a green cross", "a red circle"]
    assert first.shape == (2, 3, 64, 96) and max_diff(first, again) <= TOLERANCE


def test_register_decoder_by_name():
    pipe = flux_pipe("dev-tiny")
    seen = []
    decoder = tiny_pid()

    @register_decoder("tiny-test-pid")
    def factory(p):
        seen.append(p)
        return PiDDecoding(decoder, "pipeline")

    assert "tiny-test-pid" in registered_decoders() and {"pid", "toy-pid"} <= set(registered_decoders())
    with StepBatched(pipe, decoder="tiny-test-pid", pid_exit_step=2) as sb:
        by_name = sb(**call(steps=3)).images
    with StepBatched(pipe, decoder=PiDDecoding(decoder, "pipeline"), pid_exit_step=2) as sb:
        by_object = sb(**call(steps=3)).images
    assert seen == [pipe] and max_diff(by_name, by_object) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(height=72), r"height=72 must be divisible by 16"),
        (dict(width=100), r"width=100 must be divisible by 16"),
        (dict(height=40), r"height=40 must be divisible by 16 for PiD"),
        (dict(steps=2), r"pid_exit_step=3 is beyond num_inference_steps=2"),
        (dict(output_type="latent"), r"output_type='latent'"),
    ],
)
def test_bad_calls_raise_in_the_caller(kwargs, match):
    pipe = flux_pipe("dev-tiny")
    steps = kwargs.pop("steps", 5)
    with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(), "pipeline"), pid_exit_step=3) as sb:
        with pytest.raises(ValueError, match=match):
            sb.submit(**call(steps=steps, **kwargs))
        assert sb.stats()["requests_finished"] == {}  # nothing entered the engine


def test_exit_fraction_rounding_to_step_zero_raises():
    pipe = flux_pipe("dev-tiny")
    with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(), "pipeline"), pid_exit_step=0.1) as sb:
        with pytest.raises(ValueError, match=r"pid_exit_step=0.1 of num_inference_steps=4 rounds to step 0"):
            sb.submit(**call(steps=4))


def test_gemma_path_needs_the_caption():
    pipe = flux_pipe("dev-tiny")
    embeds, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
    with StepBatched(pipe, decoder=PiDDecoding(tiny_pid(), _FakeCaptionEncoder()), pid_exit_step=2) as sb:
        with pytest.raises(ValueError, match="needs the caption"):
            sb.submit(**call(prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled, steps=3))


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(pid_exit_step=0), r"pid_exit_step=0 must be >= 1"),
        (dict(pid_exit_step=-2), r"pid_exit_step=-2 must be >= 1"),
        (dict(pid_exit_step=1.5), r"pid_exit_step=1.5 as a fraction"),
        (dict(pid_exit_step="last"), r"pid_exit_step='last' must be"),
        (dict(decoder=None, pid_exit_step=3), r"pid_exit_step=3 needs a PiD decoder"),
        (dict(decoder="no-such-decoder"), r"decoder='no-such-decoder' is not registered"),
        (dict(decoder=object()), r"must be a PiDDecoder, a PiDDecoding"),
        (dict(decoder=dict(lq_latent_channels=16)), r"reads 16-channel latents"),
        (dict(decoder=dict(latent_spatial_down_factor=8)), r"latent_spatial_down_factor=8 differs"),
        (dict(decoder=dict(txt_embed_dim=24)), r"expects txt_embed_dim=24"),
    ],
)
def test_bad_engine_options_raise(options, match):
    pipe = flux_pipe("dev-tiny")
    decoder = options.pop("decoder", PiDDecoding(tiny_pid(), "pipeline"))
    if isinstance(decoder, dict):
        decoder = PiDDecoding(tiny_pid(**decoder), "pipeline")
    with pytest.raises(ValueError, match=match):
        StepBatched(pipe, decoder=decoder, **options)
