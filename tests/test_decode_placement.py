"""The decode reads the VAE as each family's pipeline does. Flux, SD3 and Qwen-Image hand their latents to
`vae.decode` as they are, so a wrapped request asks `vae.device` and `vae.dtype` (in diffusers each one a walk
over every VAE module, looking for offloading and casting hooks) no more often than the plain call does,
however many requests share the round and however their decodes are split."""

from collections import Counter

import pytest

from diffusers_stepbatch import StepBatched

from .dropin_helpers import call_kwargs, pipe_for, run
from .references import TOLERANCE, max_diff, output_images, seeded, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a red circle", "a blue square", "a green cat", "a yellow star"]


def count_placement_reads(vae, monkeypatch) -> Counter:
    """Count reads of `vae.device` and `vae.dtype` (diffusers' ModelMixin properties) on this VAE only."""
    reads: Counter = Counter()
    cls = type(vae)
    for name in ("device", "dtype"):
        inherited = getattr(cls, name)

        def read(self, _name=name, _inherited=inherited):
            if self is vae:
                reads[_name] += 1
            return _inherited.fget(self)

        monkeypatch.setattr(cls, name, property(read))
    return reads


@pytest.mark.parametrize("concurrent", [1, 4])
@pytest.mark.parametrize("name", ["flux", "sd3-tiny", "qwen-tiny"])
def test_a_wrapped_decode_reads_the_vae_placement_no_more_than_the_plain_call(name, concurrent, monkeypatch):
    pipe = pipe_for(name)
    calls = [call_kwargs(name, prompt=prompt, seed=i) for i, prompt in enumerate(PROMPTS[:concurrent])]
    reads = count_placement_reads(pipe.vae, monkeypatch)
    expected = [run(pipe, kwargs) for kwargs in calls]
    plain_reads = Counter(reads)

    reads.clear()
    sb = StepBatched(pipe)
    handles = [sb.submit(**seeded(kwargs)) for kwargs in calls]
    outputs = [output_images(handle.result()) for handle in handles]
    assert sb.engine.wait_idle(timeout=30)
    sb.close()

    decodes = [call for call in sb.engine.metrics.calls if call.kind == "decode"]
    assert sum(call.rows for call in decodes) == concurrent
    for field in ("device", "dtype"):
        assert reads[field] <= plain_reads[field], (field, dict(reads), dict(plain_reads), len(decodes))
    for output, reference in zip(outputs, expected):
        assert max_diff(output, reference) < TOLERANCE
