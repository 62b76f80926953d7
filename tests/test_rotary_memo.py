"""Rotary embeddings are computed once per positions, not once per step (`models/packing/rotary_memo.py`).

On the CPU equal ids answer from the memo even as new tensors (the FLUX.2 edit pipelines build them anew at each
step); on other devices only the same, unchanged tensors do. Packed FLUX.2 forwards stay exact while they embed
equal positions once.
"""

import pytest
import torch
from diffusers import Flux2Transformer2DModel

from diffusers_stepbatch.models.flux2.packing import flux2_packed_forward
from diffusers_stepbatch.models.packing import rotary_memo
from diffusers_stepbatch.models.packing.rotary_memo import held_bytes, remembered

from .references import max_diff, single_thread  # noqa: F401  (a fixture)
from .test_flux2_packing import _token_shapes

pytestmark = pytest.mark.usefixtures("single_thread")


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, ids):
        self.calls += 1
        return ids.float().cos(), ids.float().sin()


def _ids(tokens: int, axes: int, dtype, offset: int = 0) -> torch.Tensor:
    return (torch.arange(tokens * axes).view(tokens, axes) + offset).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, axes", [(1, 4), (12, 3), (40, 4)])
def test_equal_ids_in_new_cpu_tensors_answer_from_the_memo(dtype, tokens, axes):
    embed = _Embed()
    first = remembered(embed, (_ids(tokens, axes, dtype),), lambda: embed(_ids(tokens, axes, dtype)))
    again = remembered(embed, (_ids(tokens, axes, dtype),), lambda: embed(_ids(tokens, axes, dtype)))
    assert embed.calls == 1 and again is first
    # other positions, another shape or another embedding module: computed
    shifted = _ids(tokens, axes, dtype, offset=1)
    assert remembered(embed, (shifted,), lambda: embed(shifted)) is not first
    reshaped = _ids(tokens, axes, dtype).reshape(axes, tokens)
    remembered(embed, (reshaped,), lambda: embed(reshaped))
    other = _Embed()
    remembered(other, (_ids(tokens, axes, dtype),), lambda: other(_ids(tokens, axes, dtype)))
    assert embed.calls == 3 and other.calls == 1


def test_off_the_cpu_only_the_same_unchanged_tensors_answer_from_the_memo():
    embed = _Embed()
    ids = torch.zeros(8, 4, device="meta")

    def compute(tensor):
        embed.calls += 1
        return object()

    first = remembered(embed, (ids,), lambda: compute(ids))
    assert remembered(embed, (ids,), lambda: compute(ids)) is first and embed.calls == 1
    ids.add_(1)  # in place: the memo must not answer with the embedding of the old positions
    assert remembered(embed, (ids,), lambda: compute(ids)) is not first and embed.calls == 2
    equal = torch.zeros(8, 4, device="meta")  # its content can't be read without the device: not the same key
    remembered(embed, (equal,), lambda: compute(equal))
    assert embed.calls == 3


@pytest.mark.parametrize("entries", [2, 5])
def test_the_memo_keeps_its_byte_budget_and_drops_the_least_recently_used(monkeypatch, entries):
    embed = _Embed()
    entry_bytes = 2 * 10 * 4 * 4  # cos and sin of 10 x 4 float32 ids
    monkeypatch.setattr(rotary_memo, "MAX_BYTES", entries * entry_bytes)
    rotary_memo._drop(*list(rotary_memo._memo))
    for offset in range(entries + 1):  # one more than fits: the first goes
        remembered(embed, (_ids(10, 4, torch.float32, offset),), lambda o=offset: embed(_ids(10, 4, torch.float32, o)))
    assert held_bytes() == entries * entry_bytes and embed.calls == entries + 1
    last = _ids(10, 4, torch.float32, entries)
    remembered(embed, (last,), lambda: embed(last))
    assert embed.calls == entries + 1  # the newest is kept
    first = _ids(10, 4, torch.float32, 0)
    remembered(embed, (first,), lambda: embed(first))
    assert embed.calls == entries + 2  # the oldest was dropped


def test_an_embedding_is_not_kept_after_its_ids_tensors_are_collected():
    import gc

    embed = _Embed()
    rotary_memo._drop(*list(rotary_memo._memo))
    ids = torch.zeros(64, 4, device="meta")
    remembered(embed, (ids,), lambda: (torch.zeros(64, 8), torch.zeros(64, 8)))
    assert held_bytes() == 2 * 64 * 8 * 4
    del ids
    gc.collect()
    other = torch.zeros(1, 4, device="meta")
    remembered(embed, (other,), lambda: ())
    assert held_bytes() == 0


@pytest.mark.parametrize("heads, head_dim, axes_dims", [(2, 16, (4, 4, 4, 4)), (4, 8, (2, 2, 2, 2))])
def test_packed_flux2_forwards_embed_equal_positions_once_and_stay_exact(heads, head_dim, axes_dims):
    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=16,
                                    axes_dims_rope=list(axes_dims)).eval()
    shapes = [(2, (4, 4), [], 8), (1, (2, 6), [(3, 3)], 5), (1, (6, 2), [(2, 2), (4, 3)], 12)]
    calls = []
    handle = model.pos_embed.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    try:
        with torch.no_grad():
            for step in range(3):  # NOTE: new id tensors at each step, as an edit pipeline passes them
                torch.manual_seed(step)
                parts = _token_shapes(shapes)
                packed = flux2_packed_forward(model, parts)
                own = [model(hidden_states=p.hidden_states, encoder_hidden_states=p.encoder_hidden_states,
                             timestep=p.timestep, img_ids=p.img_ids, txt_ids=p.txt_ids, return_dict=False)[0]
                       for p in parts]
                assert max(max_diff(got, want) for got, want in zip(packed, own)) <= 1e-5
    finally:
        handle.remove()
    packed_calls = len(calls) - 3 * 2 * len(shapes)  # the model's own forwards embed text and image ids each time
    assert packed_calls == 2 * len(shapes), calls
