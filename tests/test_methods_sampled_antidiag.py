"""The sampled-row and antidiagonal selectors against hand-computable cases."""

import math

import pytest
import torch

import sparse_compile.methods.scoring as common
from sparse_compile import SparseConfig
from sparse_compile.methods import build_plan
from sparse_compile.plan import causal_plan, check_plan, plan_density, reference_attention

from helpers import dense_reference, random_qkv, rel_error


# ---------------------------------------------------------------------------------------------------------------
# the sampled-row selector


def test_sampled_rows_end_each_block_and_clip_a_ragged_one():
    from sparse_compile.methods.sampled import sampled_rows

    assert sampled_rows(32, 16, 4).tolist() == [3, 7, 11, 15, 19, 23, 27, 31]
    # ragged last block (rows 32..36): rows past its end become its last row, 36
    assert sampled_rows(37, 16, 4).tolist()[8:] == [35, 36, 36, 36]
    assert sampled_rows(5, 16, 16).tolist() == [4]


@pytest.mark.parametrize("shape", [(2, 4, 2, 75, 75, 8), (1, 2, 1, 40, 90, 16), (1, 2, 1, 250, 330, 8)],
                         ids=["gqa-ragged", "chunked", "far-tiles"])
@pytest.mark.parametrize("local,keep_first", [(1, True), (0, False)])
def test_sampled_tile_mass_is_each_row_over_its_estimated_normaliser(shape, local, keep_first, monkeypatch):
    """A tile's score: the log of the sum over the block's sampled rows of each row's exact exp-scores in the tile
    over its normaliser's estimate: its sum in its forced region (its block's diagonal tiles, ``local`` tiles before
    them, tile 0), plus FAR_STRIDE x its sum in every FAR_STRIDE-th tile before the region, the largest once."""
    from sparse_compile.methods.sampled import FAR_STRIDE, TINY, sampled_rows, sampled_tile_logits

    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, _ = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64)
    block, every = 16, 4
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 500)  # several key chunks
    got = sampled_tile_logits(q, k, 0.3, block, every, local=local, keep_first=keep_first)
    rows = sampled_rows(Nq, block, every)
    kk = k.repeat_interleave(Hq // Hkv, 1)
    z = q[:, :, rows] @ kk.transpose(-1, -2) * 0.3
    keys = torch.arange(Nk)[None, :]
    z = z.masked_fill(keys > (rows + Nk - Nq)[:, None], float("-inf"))
    first_diagonal = ((rows // block) * block + Nk - Nq) // block
    lo = ((first_diagonal - local) * block)[:, None]
    region = (keys >= lo) | ((keys < block) & keep_first)
    sampled_far = ((keys // block) % FAR_STRIDE == FAR_STRIDE - 1) & (keys < lo) & ~region
    level = z.masked_fill(~(region | sampled_far), float("-inf")).amax(-1, keepdim=True)
    e = (z - level).exp()
    far_tiles = torch.nn.functional.pad(e * sampled_far, (0, -Nk % block)).view(*e.shape[:-1], -1, block).sum(-1)
    far_max = far_tiles.amax(-1, keepdim=True)
    normaliser = (e * region).sum(-1, keepdim=True) + far_max + FAR_STRIDE * (far_tiles.sum(-1, keepdim=True) - far_max)
    p = torch.nn.functional.pad(e / normaliser, (0, -Nk % block))
    nqb = -(-Nq // block)
    want = p.view(B, Hq, nqb, block // every, -1, block).sum(-1).sum(3)
    torch.testing.assert_close(got, torch.log(want + TINY), rtol=1e-9, atol=1e-9)


def test_a_row_looking_far_counts_its_far_mass_against_its_forced_mass():
    """Hand-computed: one sampled row reads a far key with 4x its forced region's mass; the others score every key
    alike. Before block 7's region (tiles 6-7, 0) no tile is sampled for the far estimate (tile 7 would be), so
    each row's tile mass is its exp-scores in the tile over their sum in its forced region."""
    from sparse_compile.methods.sampled import sampled_tile_logits

    block, every, n, d = 16, 4, 128, 8
    q = torch.zeros(1, 1, n, d, dtype=torch.float64)
    k = torch.zeros(1, 1, n, d, dtype=torch.float64)
    reader, needle = 16 * 7 + 7, 40  # block 7's sampled rows are 115, 119, 123, 127; key 40 is in tile 2
    k[0, 0, needle, 0] = 1.0
    q[0, 0, reader, 0] = 1.0
    # row r's forced region (local=1): keys 96..r and tile 0's 16 keys; the reader's holds 40, scored 0
    scale = math.log(4 * 40)  # the needle's exp-score: 160 = 4x the reader's forced sum
    mass = sampled_tile_logits(q, k, scale, block, every, local=1)[0, 0, 7].exp()
    others = 16 / 36 + 16 / 44 + 16 / 48  # rows 115, 123, 127: 16 keys of the tile over 36, 44, 48 forced keys
    assert math.isclose(mass[2], (160 + 15) / 40 + others, rel_tol=1e-9)
    assert math.isclose(mass[3], 16 / 40 + others, rel_tol=1e-9)


def test_far_mass_is_estimated_from_every_eighth_far_tile_the_largest_once():
    """Hand-computed, every score equal: a row of block 19 (local=1) has far tiles 1..17, of which 7 and 15 are
    sampled (16 keys each): its normaliser is its forced keys + 16 + 8 x 16."""
    from sparse_compile.methods.sampled import FAR_STRIDE, sampled_tile_logits

    assert FAR_STRIDE == 8
    block, every, n, d = 16, 4, 320, 8
    q = torch.zeros(1, 1, n, d, dtype=torch.float64)
    k = torch.randn(1, 1, n, d, dtype=torch.float64)
    mass = sampled_tile_logits(q, k, 1.0, block, every, local=1)[0, 0, 19].exp()
    # rows 307, 311, 315, 319: 16 sink keys and keys 288..r forced (36, 40, 44, 48)
    want = sum(16 / (forced + 16 + 8 * 16) for forced in (36, 40, 44, 48))
    assert math.isclose(mass[5], want, rel_tol=1e-9) and math.isclose(mass[7], want, rel_tol=1e-9)


def test_sampled_selector_finds_one_row_looking_up_one_key():
    """One query row looks up one far key (a retrieval): the sampled selector keeps that key's tile at a small
    budget on every draw; PBS's mean-pooled selector (without its permutation) at a similar density misses it on
    some."""
    B, H, N, D = 1, 1, 256, 32
    needle, reader = 37, 16 * 13 + 11  # key 37 (tile 2); row 219 of block 13, a sampled row (every 4th)
    sampled = SparseConfig(method="sampled", sampled={"block_size": 16, "sample_every": 4, "budget": 0.15,
                                                      "keep_first_block": False})
    pooled = SparseConfig(method="pbs", reorder="none", pbs={"block_size": 16, "segment_size": 32,
                                                              "threshold": 0.2, "keep_first_block": False})
    kept = {"sampled": 0, "pbs": 0}
    draws = 10
    for seed in range(draws):
        torch.manual_seed(seed)
        q, k, _ = random_qkv(B, H, H, N, N, D)
        k[0, 0, needle] = torch.randn(D) * 2
        q[0, 0, reader] = k[0, 0, needle]
        for name, config in (("sampled", sampled), ("pbs", pooled)):
            plan = build_plan(q, k, None, config)
            listed = plan.tile_offsets[0, 0, 13, :int(plan.tile_counts[0, 0, 13])] // 16
            kept[name] += int(2 in listed.tolist())
    assert kept["sampled"] == draws and kept["pbs"] <= draws - 2, kept


def test_sampled_budget_keeps_forced_tiles_and_a_fixed_share_of_the_others():
    from sparse_compile.methods.tiles import keep_top_budget

    scores = torch.tensor([[0.0, 5.0, 1.0, float("nan"), 3.0, 2.0, 4.0, -1.0]])
    visible = torch.tensor([[True] * 7 + [False]])
    forced = torch.tensor([[True, False, False, False, False, False, True, False]])
    # 7 visible: ceil(0.3 * 7) = 3 others by score (5, 3, 2), the forced two, and the NaN tile
    keep = keep_top_budget(scores, visible, forced, 0.3)
    assert keep.tolist() == [[True, True, False, True, True, True, True, False]]
    # ties: the lower tile first; a tiny budget still keeps one
    keep = keep_top_budget(torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool),
                           0.01)
    assert keep.tolist() == [[True, False, False, False]]


def test_sampled_mass_target_keeps_the_fewest_tiles_that_reach_it():
    from sparse_compile.methods.tiles import keep_top_budget

    # one block's sampled masses: tile 0 forced (0.30); the others 0.25, 0.05, 0.20, 0.10, 0.06, 0.04; tile 7 unseen
    mass = torch.tensor([[0.30, 0.25, 0.05, 0.20, 0.10, 0.06, 0.04, 0.0]])
    scores = torch.log(mass + 1e-30)
    visible = torch.tensor([[True] * 7 + [False]])
    forced = torch.tensor([[True] + [False] * 7])

    def kept(target, budget=0.99, least=0.0):
        return keep_top_budget(scores, visible, forced, budget, target, least)[0].nonzero().flatten().tolist()

    assert kept(0.5) == [0, 1]  # 0.30 + 0.25
    assert kept(0.7) == [0, 1, 3]  # + 0.20 = 0.75
    assert kept(0.9) == [0, 1, 3, 4, 5]  # + 0.10 + 0.06 = 0.91
    assert kept(0.2) == [0, 1]  # the forced tiles reach it: still one ranked tile
    assert kept(0.9, budget=0.3) == [0, 1, 3, 4]  # at most ceil(0.3 x 7) = 3 others
    assert kept(0.5, least=0.5) == [0, 1, 3, 4, 5]  # at least ceil(0.5 x 7) = 4 others
    assert kept(0.5, budget=0.3, least=0.5) == [0, 1, 3, 4]  # the cap wins over the floor
    # NaN scores are kept and take no part in the mass
    nan = scores.clone()
    nan[0, 2] = float("nan")
    assert keep_top_budget(nan, visible, forced, 0.99, 0.7, 0.0)[0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_sampled_mass_target_spends_density_where_attention_is_spread():
    """Head 0 reads one key block, head 1 reads everything evenly: with a mass target head 0 keeps its floor and
    head 1 its cap; the fixed share keeps the same count in both."""
    n, dim, block = 512, 16, 16
    q, k, _ = random_qkv(1, 2, 2, n, n, dim)
    q[:, 1] = 0.0  # uniform attention
    k[:, 0] = 0.0
    k[0, 0, 16 * 5: 16 * 6] = 1.0  # key block 5 ...
    q[0, 0] = 8.0  # ... is where every row of head 0 looks
    common = dict(block_size=block, sample_every=4, local_tiles=0, exact_tail_blocks=0, keep_first_block=False)
    counts = {}
    rules = {"share": dict(budget=0.3, mass_target=0.0), "mass": dict(budget=0.6, mass_target=0.9, min_budget=0.1)}
    for name, extra in rules.items():
        config = SparseConfig(method="sampled", sampled={**common, **extra})
        counts[name] = build_plan(q, k, None, config).tile_counts[0, :, -1].tolist()  # the last block: 32 visible
    assert counts["share"][0] == counts["share"][1]
    assert counts["mass"][0] < counts["share"][0] < counts["mass"][1], counts


# ---------------------------------------------------------------------------------------------------------------
# the antidiagonal selector


@pytest.mark.parametrize("stride,rows,antidiagonals", [(4, 4, 1), (4, 4, 2), (8, 2, 1), (8, 1, 1)])
def test_antidiag_matmul_is_the_explicit_antidiagonal_sums(stride, rows, antidiagonals):
    """One matmul of the reduced rows and keys sums, for every R x S rectangle of QK^T, the entries on its
    antidiagonal(s): row t of the rectangle with key j where (t + j) mod R is R-1 (or R-2)."""
    from sparse_compile.methods.antidiag import reduced_keys, reduced_queries

    q, k, _ = random_qkv(1, 2, 2, 21, 30, 8, dtype=torch.float64)  # ragged at both ends
    got = reduced_queries(q, rows) @ reduced_keys(k, stride, rows, antidiagonals).transpose(-1, -2)
    full = q @ k.transpose(-1, -2)
    want = torch.zeros_like(got)
    for g in range(got.shape[2]):
        for c in range(got.shape[3]):
            for t in range(rows):
                for j in range(stride):
                    r, key = g * rows + t, c * stride + j
                    on = (t + j) % rows == rows - 1 or (antidiagonals == 2 and (t + j) % rows == (rows - 2) % rows)
                    if on and r < 21 and key < 30:
                        want[..., g, c] += full[..., r, key]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if (stride, rows, antidiagonals) == (4, 4, 1):  # XAttention's form: q_{gS+t} . k_{cS+S-1-t}
        assert got[0, 0, 1, 2] == pytest.approx(sum(float(full[0, 0, 4 + t, 11 - t]) for t in range(4)))


@pytest.mark.parametrize("shape", [(2, 4, 2, 75, 75, 8), (1, 2, 1, 40, 90, 16)], ids=["gqa-ragged", "chunked"])
@pytest.mark.parametrize("rows,factor", [(4, 1.0), (2, None)])
def test_antidiag_tile_mass_is_the_reduced_rows_softmax(shape, rows, factor, monkeypatch):
    from sparse_compile.methods.antidiag import TINY, antidiag_tile_logits, slot_mask

    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, _ = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64)
    block, stride = 16, 4
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 300)  # several row chunks
    got = antidiag_tile_logits(q, k, 0.3, block, stride, rows, 1, factor)
    # brute force: full logits, each R x S rectangle summed along its antidiagonal
    nr, ng = -(-Nq // rows), -(-Nk // stride)
    full = q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)
    full = torch.nn.functional.pad(full, (0, ng * stride - Nk, 0, nr * rows - Nq)).view(B, Hq, nr, rows, ng, stride)
    a = torch.einsum("bhgtcj,tj->bhgc", full, slot_mask(stride, rows, 1, torch.float64))
    z = a * 0.3 * (1.0 / stride if factor is None else factor)
    first_position = torch.arange(nr) * rows + (Nk - Nq)
    last_key = torch.arange(ng) * stride + stride - 1
    visible = last_key[None, :] <= first_position[:, None]
    p = torch.softmax(z.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)  # rows that see no group: 0
    nqb, nkt = -(-Nq // block), -(-Nk // block)
    p = torch.nn.functional.pad(p, (0, nkt * block // stride - ng, 0, nqb * block // rows - nr))
    want = p.view(B, Hq, nqb, block // rows, nkt, block // stride).sum((3, 5))
    torch.testing.assert_close(got, torch.log(want + TINY), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("nq,nk", [(150, 150), (70, 150)], ids=["prefill", "chunked"])
def test_antidiag_head_dims_keep_all_and_defaults(dim, nq, nk):
    q, k, v = random_qkv(2, 4, 2, nq, nk, dim)
    small = {"block_size": 16, "score_stride": 8, "row_stride": 4, "local_tiles": 0, "exact_tail_blocks": 0}
    keep = build_plan(q, k, None, SparseConfig(method="antidiag", antidiag={**small, "budget": 1.0}))
    assert rel_error(reference_attention(q, k, v, keep), dense_reference(q, k, v)) < 1e-5
    plan = build_plan(q, k, None, SparseConfig(method="antidiag", antidiag=small))
    check_plan(plan, q, k)
    assert bool(torch.isfinite(reference_attention(q, k, v, plan)).all())
    assert float(plan_density(plan, nq, nk).mean()) < 0.8


def _lookup_prompt(seed, n=512, dim=32, needle=37, reader=16 * 25 + 3):
    """One query row looks up one far key (a retrieval); every row also leans on a sink (tile 0), as real heads do."""
    torch.manual_seed(seed)
    q, k, _ = random_qkv(1, 1, 1, n, n, dim)
    q[..., 0] += 2.0
    k[0, 0, :16, 0] += 4.0
    k[0, 0, needle] = torch.randn(dim) * 2.5
    q[0, 0, reader] = k[0, 0, needle]
    return q, k


def test_antidiag_keeps_a_planted_lookup_that_mean_pooling_loses():
    """Rows scored one by one against groups of 8 keys (``row_stride=1``) keep the needle's tile at budget 0.1 on
    every draw; PBS's mean-pooled selector (without its permutation) at the same density misses it on half."""
    antidiag = SparseConfig(method="antidiag", antidiag={"block_size": 16, "score_stride": 8, "row_stride": 1,
                                                         "budget": 0.1, "local_tiles": 0, "exact_tail_blocks": 0})
    pooled = SparseConfig(method="pbs", reorder="none", pbs={"block_size": 16, "segment_size": 32, "threshold": 0.3})
    kept = {"antidiag": 0, "pbs": 0}
    density = {"antidiag": 0.0, "pbs": 0.0}
    draws = 10
    for seed in range(draws):
        q, k = _lookup_prompt(seed)
        for name, config in (("antidiag", antidiag), ("pbs", pooled)):
            plan = build_plan(q, k, None, config)
            row = 16 * 25 + 3
            listed = plan.tile_offsets[0, 0, row // 16, :int(plan.tile_counts[0, 0, row // 16])] // 16
            kept[name] += int(37 // 16 in listed.tolist())
            density[name] += float(plan_density(plan, 512, 512).mean()) / draws
    assert kept["antidiag"] == draws and kept["pbs"] <= draws - 3, kept
    assert density["antidiag"] <= density["pbs"] + 0.01, density


def test_antidiag_non_finite_inputs_keep_every_tile_of_the_blocks_they_reach():
    config = SparseConfig(method="antidiag", antidiag={"block_size": 16, "score_stride": 4, "row_stride": 2,
                                                       "budget": 0.1})
    q, k, _ = random_qkv(1, 2, 1, 160, 160, 8)
    visible = causal_plan(1, 1, 160, 160, 16, 16).tile_counts[0, 0]
    k_nan = k.clone()
    k_nan[0, 0, 50] = float("nan")  # key group 12 (keys 48-51), tile 3: fully seen from row 52, block 3
    plan = build_plan(q, k_nan, None, config)
    assert torch.equal(plan.tile_counts[0, :, 3:], visible[3:].expand(2, -1))
    assert bool((plan.tile_counts[0, :, :3] == build_plan(q, k, None, config).tile_counts[0, :, :3]).all())
    q_nan = q.clone()
    q_nan[0, 1, 100] = float("inf")  # a row of block 6, head 1
    plan = build_plan(q_nan, k, None, config)
    assert int(plan.tile_counts[0, 1, 6]) == int(visible[6])
    assert torch.equal(plan.tile_counts[0, 0], build_plan(q, k, None, config).tile_counts[0, 0])
