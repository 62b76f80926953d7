"""RFD4 Proteina (`RFD4ProteinaPipeline`) through the generic program and `models/rfd4_proteina.py`.

Partial diffusion encodes each request's input structure with one generator per row; concurrent requests (other
seeds, start times, designs per prompt) run their encodes as one call and their denoiser calls together, and every
output field equals the plain pipeline's.
"""

import functools

import numpy as np
import pytest
import torch
from diffusers import RFD4ProteinaAutoencoder, RFD4ProteinaPipeline, RFD4ProteinaScheduler, RFD4ProteinaTransformer

from diffusers_stepbatch import StepBatched

from .references import TOLERANCE, count_forwards, engine_held, max_diff, single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

RESIDUE_TYPES, TOKEN_TYPES = 147, 7
# name: (tokens, context tokens, token width, layers, recycle depths: one entry per step)
CONFIGS = {"tiny": (12, 2, 16, 2, (2, 1, 1)), "wide": (20, 3, 32, 1, (3, 2, 1, 1))}


@functools.lru_cache(maxsize=None)
def pipe_for(config: str) -> RFD4ProteinaPipeline:
    _, _, token_dim, layers, recycle_depths = CONFIGS[config]
    torch.manual_seed(0)
    transformer = RFD4ProteinaTransformer(
        nlayers=layers, token_dim=token_dim, nheads=2, dim_cond=16, pair_repr_dim=8, latent_dim=4,
        token_type_emb_dim=4, cath_emb_dim=4, t_emb_dim=8, seq_sep_dim=8, xt_pair_dist_dim=6,
        feats_seq=("xt_bb_ca", "xt_local_latents", "token_type", "sequence_probabilities", "cond_a37coors_nm",
                   "rasa_binned", "coord_group_seq", "chain_centroid_xyz"),
        feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents", "recycle_remaining"),
        feats_pair_repr=("xt_bb_ca_pair_dists", "bond_mask", "molecule_idx_pair", "token_bond_path_length",
                         "index_group_pair"),
        feats_pair_cond=("time_emb_bb_ca", "time_emb_local_latents"),
        update_pair_repr_every_n=1, tri_mult_c=8, recycle_conditioning_dim=4).eval()
    rng = np.random.RandomState(0)
    atom37 = rng.rand(RESIDUE_TYPES, 37) > 0.5
    atom37[:, 1] = True  # every residue has its CA
    allowed = np.zeros((TOKEN_TYPES, RESIDUE_TYPES), dtype=bool)
    allowed[0, 1:21] = True
    allowed[1:, 1:] = True
    torch.manual_seed(1)
    vae = RFD4ProteinaAutoencoder(
        atom37_mask=atom37.tolist(), allowed_residue_types=allowed.tolist(), latent_dim=4, nlayers=1, token_dim=16,
        nheads=2, dim_cond=8, pair_repr_dim=8, token_type_emb_dim=4,
        encoder_feats_seq=("token_type", "x1_a37coors_nm", "x1_a37coors_nm_rel", "chain_idx_seq")).eval()
    schedulers = dict(
        bb_ca_scheduler=RFD4ProteinaScheduler(schedule_mode="log", noise_mode="1/t", tsr_k=2.0, tsr_sigma=1.0,
                                              tail_steps=0, t_lim_ode=0.9, t_lim_ode_below=0.05),
        local_latents_scheduler=RFD4ProteinaScheduler(schedule_mode="power", noise_mode="tan", tsr_k=1.5,
                                                      tsr_sigma=1.0, tail_steps=0, t_lim_ode=0.9,
                                                      t_lim_ode_below=0.05))
    pipe = RFD4ProteinaPipeline(transformer=transformer, vae=vae, recycle_depths=list(recycle_depths), **schedulers)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def molecule(config: str) -> dict:
    """One prepared molecule (masks, coordinates, conditioning features) for partial diffusion."""
    tokens, context_tokens = CONFIGS[config][:2]
    rng = np.random.RandomState(0)
    padding = torch.ones(1, tokens, dtype=torch.bool)
    padding[0, -1] = False
    context = torch.zeros(1, tokens, dtype=torch.bool)
    context[0, :context_tokens] = True
    supports = torch.ones(1, tokens, dtype=torch.bool)
    supports[0, context_tokens] = False  # a CA-only token
    atom37_mask = torch.from_numpy(rng.rand(1, tokens, 37) > 0.4)
    atom37_mask[..., 1] = True
    sequence = torch.zeros(1, tokens, dtype=torch.long)
    sequence[0, :3] = torch.from_numpy(rng.randint(1, 21, 3))
    coords = torch.from_numpy(rng.randn(1, tokens, 37, 3).astype(np.float32)) * 0.3
    condition_coords = torch.full((1, tokens, 37, 3), float("nan"))
    condition_coords[0, :context_tokens] = coords[0, :context_tokens] * 10
    groups = torch.full((1, tokens, 37), -1.0)
    groups[0, :context_tokens] = torch.from_numpy(rng.randint(0, 3, (context_tokens, 37)).astype(np.float32))
    chains = torch.tensor([[0] * (tokens // 2) + [1] * (tokens - tokens // 2)])
    features = {
        "condition_sequence_1_residue": sequence, "molecule_iid": chains, "chain_iid": chains.clone(),
        "condition_coordinate_1_atom": condition_coords,
        "condition_rasa-binned_1_atom": torch.from_numpy(rng.randint(0, 3, (1, tokens, 37))).float(),
        "condition_CoordinateGroup_1_atom": groups,
        "condition_ChainCentroid_1_atom": torch.from_numpy(rng.randn(1, tokens, 3).astype(np.float32)),
        "condition_index-group_1_token": torch.from_numpy(rng.randint(0, 3, (1, tokens))),
        "condition_sequence-probability-ALA_1_residue": torch.from_numpy(rng.rand(1, tokens).astype(np.float32)),
        "bond_mask": torch.from_numpy(rng.rand(1, tokens, tokens) > 0.8),
        "token_bond_path_length": torch.from_numpy(rng.randint(0, 10, (1, tokens, tokens))),
    }
    return dict(padding_mask=padding, is_in_context_conditioning=context, supports_local_latent=supports,
                token_type=torch.zeros(1, tokens, dtype=torch.long), atom37_mask=atom37_mask, coords_nm=coords,
                conditioning_features=features, output_type="pt")


# (seeds: one generator per design, partial_t_bb_ca, partial_t_local_latents)
REQUESTS = [((0,), 0.3, 0.4), ((1,), 0.5, 0.2), ((2, 12), 0.3, 0.4), ((3,), 0.2, 0.6)]
BLOCKER = ((7,), 0.3, 0.4)  # holds the engine while the requests are submitted


def request(config: str, seeds: tuple[int, ...], partial_t_bb_ca: float, partial_t_local_latents: float) -> dict:
    return dict(molecule(config), num_designs_per_prompt=len(seeds),
                generator=[torch.Generator().manual_seed(seed) for seed in seeds],
                partial_t_bb_ca=partial_t_bb_ca, partial_t_local_latents=partial_t_local_latents)


def assert_outputs_equal(got, want) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name].is_floating_point():
            assert max_diff(got[name], want[name]) <= TOLERANCE, name
        else:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_partial_diffusion_requests_encode_together_and_equal_their_plain_runs(config):
    pipe = pipe_for(config)
    expected = [pipe(**request(config, *spec)) for spec in REQUESTS]
    encodes, original = [], pipe.vae.encode

    def counting_encode(*args, **kwargs):
        encodes.append(int((args[0] if args else kwargs["coords_nm"]).shape[0]))
        return original(*args, **kwargs)

    pipe.vae.encode = counting_encode
    sizes, hook = count_forwards(pipe.transformer)
    try:
        with StepBatched(pipe) as sb:
            with engine_held(sb, request(config, *BLOCKER)):  # NOTE: all start together however slow the machine
                futures = [sb.submit(**request(config, *spec)) for spec in REQUESTS]
            results = [future.result(timeout=300) for future in futures]
            stats = sb.stats()
    finally:
        del pipe.vae.encode
        hook.remove()
    for got, want in zip(results, expected):
        assert_outputs_equal(got, want)
    # NOTE: the blocker's encode, then one merged encode of every request's rows, and no separate check calls: the
    # autoencoder is trusted
    assert encodes == [len(BLOCKER[0]), sum(len(seeds) for seeds, _, _ in REQUESTS)], encodes
    assert not any(reason.startswith("vae_encode") for reason in stats["splits"]), stats["splits"]
    assert max(sizes) > 2, sizes  # the denoiser ran calls holding several requests' rows
