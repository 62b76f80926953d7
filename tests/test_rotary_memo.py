"""Rotary embeddings are computed once per ids tensors, not once per step (`models/packing/rotary_memo.py`).

The same ids tensors, or views of them of the same geometry, answer from the memo until they change in place; equal
ids in new tensors are embedded anew (their content is never read back from the device). Packed FLUX.2 forwards stay
exact while they embed a request's positions once.
"""

import pytest
import torch
from diffusers import Flux2Transformer2DModel

from diffusers_stepbatch.models.flux2.packing import flux2_packed_forward
from diffusers_stepbatch.models.packing import rotary_memo
from diffusers_stepbatch.models.packing.rotary_memo import held_bytes, remembered

from .references import max_diff, single_thread  # noqa: F401  (a fixture)
from .test_flux2_packing import flux2_parts

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


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
@pytest.mark.parametrize("tokens, axes", [(1, 4), (12, 3), (40, 4)])
def test_the_same_ids_answer_from_the_memo_until_they_change_in_place(device, dtype, tokens, axes):
    embed = _Embed()

    def compute(ids):
        embed.calls += 1
        return object()

    ids = _ids(tokens, axes, dtype).to(device)
    first = remembered(embed, (ids,), lambda: compute(ids))
    assert remembered(embed, (ids,), lambda: compute(ids)) is first and embed.calls == 1
    ids.add_(1)  # in place: the memo must not answer with the embedding of the old positions
    changed = remembered(embed, (ids,), lambda: compute(ids))
    assert changed is not first and embed.calls == 2
    equal = ids.clone()  # equal content in another tensor: its content is never read, so it is embedded
    remembered(embed, (equal,), lambda: compute(equal))
    other = _Embed()  # another embedding module
    remembered(other, (ids,), lambda: compute(ids))
    assert embed.calls == 4


@pytest.mark.parametrize("batch", [1, 3])
def test_views_of_one_ids_tensor_answer_by_their_geometry(batch):
    """FLUX.2 passes [batch, tokens, 4] ids (an expanded view) and the model reads row 0: a new view each step."""
    embed = _Embed()
    base = _ids(6, 4, torch.int64)
    ids = base.unsqueeze(0).expand(batch, -1, -1)
    first = remembered(embed, (ids[0],), lambda: embed(ids[0]))
    assert remembered(embed, (ids[0],), lambda: embed(ids[0])) is first and embed.calls == 1
    remembered(embed, (ids[0, 1:],), lambda: embed(ids[0, 1:]))  # another view of it: other positions
    assert embed.calls == 2
    base.add_(0)  # NOTE: any in-place write to the tensor the ids view moves the version
    remembered(embed, (ids[0],), lambda: embed(ids[0]))
    assert embed.calls == 3


def test_inference_tensors_are_embedded_every_time():
    embed = _Embed()
    with torch.inference_mode():
        ids = _ids(4, 4, torch.int64)
        remembered(embed, (ids,), lambda: embed(ids))
        remembered(embed, (ids,), lambda: embed(ids))
    assert embed.calls == 2


@pytest.mark.parametrize("entries", [2, 5])
def test_the_memo_keeps_its_byte_budget_and_drops_the_least_recently_used(monkeypatch, entries):
    embed = _Embed()
    entry_bytes = 2 * 10 * 4 * 4  # cos and sin of 10 x 4 float32 ids
    monkeypatch.setattr(rotary_memo, "MAX_BYTES", entries * entry_bytes)
    rotary_memo._drop(*list(rotary_memo._memo))
    kept = [_ids(10, 4, torch.float32, offset) for offset in range(entries + 1)]
    for ids in kept:  # one more than fits: the first goes
        remembered(embed, (ids,), lambda ids=ids: embed(ids))
    assert held_bytes() == entries * entry_bytes and embed.calls == entries + 1
    remembered(embed, (kept[-1],), lambda: embed(kept[-1]))
    assert embed.calls == entries + 1  # the newest is kept
    remembered(embed, (kept[0],), lambda: embed(kept[0]))
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
def test_packed_flux2_forwards_embed_a_requests_positions_once_and_stay_exact(heads, head_dim, axes_dims):
    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=16,
                                    axes_dims_rope=list(axes_dims)).eval()
    shapes = [(2, (4, 4), [], 8), (1, (2, 6), [(3, 3)], 5), (1, (6, 2), [(2, 2), (4, 3)], 12)]
    calls = []
    handle = model.pos_embed.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    try:
        with torch.no_grad():
            parts = flux2_parts(shapes)
            for step in range(3):  # NOTE: the same ids tensors at each step, as the pipelines pass them
                torch.manual_seed(step)
                for part in parts:
                    part.hidden_states = torch.randn_like(part.hidden_states)
                    part.timestep = torch.rand_like(part.timestep)
                packed = flux2_packed_forward(model, parts)
                own = [model(hidden_states=p.hidden_states, encoder_hidden_states=p.encoder_hidden_states,
                             timestep=p.timestep, img_ids=p.img_ids, txt_ids=p.txt_ids, return_dict=False)[0]
                       for p in parts]
                assert max(max_diff(got, want) for got, want in zip(packed, own)) <= 1e-5
    finally:
        handle.remove()
    packed_calls = len(calls) - 3 * 2 * len(shapes)  # the model's own forwards embed text and image ids each time
    assert packed_calls == 2 * len(shapes), calls
