"""The sparse methods' pieces against hand-computable cases: top-mass selection, segmented sorts, PBS importance and
reordering, SpargeAttn's self-similarity, BFLA's block scores, hash and band, S2O's reordering, plans and chunks.
"""

import math

import pytest
import torch

from sparse_compile import SparseConfig
from sparse_compile.extend import BFLAParams, PBSParams, S2OParams
from sparse_compile.methods import build_plan
from sparse_compile.kernels.reference import hash32, segmented_argsort_desc
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.methods.scoring import block_self_similarity, top_mass
from sparse_compile.methods.bfla import RANDOM_SALT, bfla_block_scores
from sparse_compile.methods.pbs import pbs_key_importance, reorder_pbs
from sparse_compile.methods.s2o import reorder_s2o, s2o_segment_tensors
from sparse_compile.plan import (
    VISIBLE_NONE,
    block_visibility,
    causal_plan,
    check_plan,
    plan_density,
    reference_attention,
)

from helpers import dense_reference, random_qkv, rel_error
from method_helpers import _config, sink_inputs


# ---------------------------------------------------------------------------------------------------------------
# pieces against hand-computable cases


def test_top_mass_boundary():
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    cand = torch.ones_like(p, dtype=torch.bool)
    keep = lambda tau, **kw: top_mass(p, cand, tau, **kw)[0].tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False]  # reaching tau exactly: the crossing block is the last kept
    assert keep(0.50001) == [True, True, False]
    assert keep(0.8) == [True, True, False]
    assert keep(0.81) == [True, True, True]
    assert keep(1.0) == [True, True, True]
    assert keep(0.0) == [False, False, False]
    # ties keep the lower index; non-candidates never kept, not counted
    p4 = torch.full((1, 4), 0.25, dtype=torch.float64)
    assert top_mass(p4, torch.ones_like(p4, dtype=torch.bool), 0.5)[0].tolist() == [True, True, False, False]
    c = torch.tensor([[False, True, True, True]])
    assert top_mass(p4, c, 0.5)[0].tolist() == [False, True, True, False]
    # tau >= 1 keeps every candidate even if the float cumsum never reaches the total
    tiny = torch.tensor([[1e-30, 1.0, 1e-30]])
    assert top_mass(tiny, torch.ones_like(tiny, dtype=torch.bool), 1.0).all()


def test_segmented_argsort_keeps_segments():
    s = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0, 6.0, 0.5, 9.0])
    assert segmented_argsort_desc(s, 3, 2).tolist() == [1, 2, 0, 5, 3, 4, 6, 7]  # tail of 2 untouched
    assert segmented_argsort_desc(s, 3, 3).tolist() == [1, 2, 0, 5, 3, 4, 7, 6]  # ragged last segment sorted
    assert segmented_argsort_desc(torch.zeros(5), 2, 2).tolist() == [0, 1, 2, 3, 4]  # ties keep order
    x = torch.randn(3, 100)
    perm = segmented_argsort_desc(x, 16, 100 // 16)
    for seg in range(6):
        part = perm[:, seg * 16:(seg + 1) * 16]
        assert bool((part.sort(-1).values == torch.arange(seg * 16, seg * 16 + 16)).all())
        vals = torch.gather(x, 1, part)
        assert bool((vals[:, :-1] >= vals[:, 1:]).all())
    assert bool((perm[:, 96:] == torch.arange(96, 100)).all())


def test_pbs_importance_matches_brute_force():
    q, k, _ = random_qkv(2, 4, 2, 50, 90, 8, dtype=torch.float64)
    scale = 0.4
    got = pbs_key_importance(q, k, scale, 16)
    ql = q[:, :, -16:]
    kk = k.repeat_interleave(2, dim=1)
    logits = ql @ kk.transpose(-1, -2) * scale
    pos = torch.arange(90 - 16, 90)
    logits = logits.masked_fill(torch.arange(90)[None, :] > pos[:, None], float("-inf"))
    want = logits.softmax(-1).mean(2).view(2, 2, 2, 90).mean(2)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)


def test_pbs_reorder_sorts_inside_segments_only():
    q, k, _ = random_qkv(1, 2, 2, 100, 100, 8, dtype=torch.float64)
    config = _config("pbs", "pbs")
    r = reorder_pbs(q, k, 0.35, config.params_of("pbs"))
    s = pbs_key_importance(q, k, 0.35, 16)
    ki = r.key_index.long()
    assert r.segment_size == 32 and r.key_index.dtype == torch.int32
    for seg in range(3):
        part = ki[..., seg * 32:(seg + 1) * 32]
        assert bool((part.sort(-1).values == torch.arange(seg * 32, seg * 32 + 32)).all())
        vals = torch.gather(s, 2, part)
        assert bool((vals[..., :-1] >= vals[..., 1:]).all())
    assert bool((ki[..., 96:] == torch.arange(96, 100)).all())  # N mod S tail unpermuted


@pytest.mark.parametrize("nq,nk", [(128, 128), (70, 128)])
def test_pbs_always_keeps_on_diagonal_segment_and_first_key(nq, nk):
    q, k, v = random_qkv(1, 2, 1, nq, nk, 8)
    # a tiny threshold: the mass rule alone keeps one block per row, the rest must come from the forced tiles
    config = _config("pbs", "pbs", pbs=PBSParams(block_size=16, segment_size=32, threshold=0.01))
    plan = build_plan(q, k, None, config)
    check_plan(plan, q, k)
    ki = plan.key_index
    vis = block_visibility(nq, nk, 16, 16, key_index=ki)[0, 0]
    first = int((ki[0, 0] == 0).nonzero()) // 16
    for h in range(2):
        for i in range(plan.num_query_blocks):
            tiles = set((plan.tile_offsets[0, h, i, : plan.tile_counts[0, h, i]] // 16).tolist())
            qmin, qmax = nk - nq + i * 16, nk - nq + min((i + 1) * 16, nq) - 1
            diag = {t for t in range(nk // 16) if qmin // 32 <= t * 16 // 32 <= qmax // 32 and vis[i, t] != VISIBLE_NONE}
            assert diag <= tiles, (h, i)
            assert first in tiles
            assert len(tiles - diag - {first}) <= 1


def test_sparge_self_similarity():
    x = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(1, 1, 5, 8)  # identical tokens
    assert torch.allclose(block_self_similarity(x, 5), torch.ones(1, 1, 1, dtype=torch.float64))
    eye = torch.eye(4, dtype=torch.float64)[None, None]  # orthogonal tokens: only the self pairs count
    assert torch.allclose(block_self_similarity(eye, 4), torch.full((1, 1, 1), 0.25, dtype=torch.float64))
    y = torch.randn(2, 3, 21, 8, dtype=torch.float64)
    got = block_self_similarity(y, 8)  # ragged last block of 5
    for b, (s, e) in enumerate([(0, 8), (8, 16), (16, 21)]):
        u = torch.nn.functional.normalize(y[:, :, s:e], dim=-1)
        assert torch.allclose(got[..., b], (u @ u.transpose(-1, -2)).mean((-1, -2)))


def test_sparge_keeps_non_self_similar_rows_and_columns():
    q, k, v = sink_inputs(1, 2, 1, 128)
    k[:, :, 64:80] = 3 * torch.randn(1, 1, 16, 16, dtype=torch.float64)  # key tile 4: not self-similar
    q[:, :, 96:128] = 3 * torch.randn(1, 2, 32, 16, dtype=torch.float64)  # query block 3: not self-similar
    plan = build_plan(q, k, None, _config("none", "sparge"))
    vis = block_visibility(128, 128, 32, 16)[0, 0]
    for h in range(2):
        for i in range(4):
            tiles = set((plan.tile_offsets[0, h, i, : plan.tile_counts[0, h, i]] // 16).tolist())
            visible = {j for j in range(8) if vis[i, j] != VISIBLE_NONE}
            if i == 3:
                assert tiles == visible
            if 4 in visible:
                assert 4 in tiles
            assert 0 in tiles  # the sink
    assert int(plan.tile_counts[0, 0, 1]) < 4  # a self-similar block really is pruned


def test_bfla_block_scores_match_brute_force():
    q, k, _ = random_qkv(1, 2, 1, 40, 40, 3, dtype=torch.float64)
    block, group = 16, 4
    got = bfla_block_scores(q, k, block, group)
    qp = torch.nn.functional.pad(q, (0, 0, 0, 8))[0]
    kp = torch.nn.functional.pad(k, (0, 0, 0, 8))[0, 0]
    for h in range(2):
        for i in range(3):
            for j in range(3):
                best = -math.inf
                for u in range(4):
                    for w in range(4):
                        if i * 16 + u * 4 >= 40 or j * 16 + w * 4 >= 40:
                            continue  # groups of padding only are ignored
                        a = qp[h, i * 16 + u * 4: i * 16 + u * 4 + 4].flatten()
                        b = kp[j * 16 + w * 4: j * 16 + w * 4 + 4].flatten()
                        best = max(best, float(a @ b))
                assert math.isclose(float(got[0, h, i, j]), best, rel_tol=1e-12, abs_tol=1e-12)


def _py_mix(x):
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _py_hash(seed, *parts):
    h = _py_mix(seed & 0xFFFFFFFF)
    for p in parts:
        h = _py_mix(h ^ (p & 0xFFFFFFFF))
    return h


def test_hash32_is_exact_32_bit_arithmetic():
    i = torch.arange(0, 50)[:, None] * 977
    j = torch.tensor([0, 1, 2**31 - 1, 2**32 - 1, 123456789])[None, :]
    got = hash32(2**40 + 7, i, j)
    want = [[_py_hash(2**40 + 7, int(a), int(b)) for b in j[0]] for a in i[:, 0]]
    assert got.tolist() == want
    assert int(got.min()) >= 0 and int(got.max()) < 2**32


def test_bfla_band_sink_and_rescue_positions():
    q, k, _ = random_qkv(1, 2, 1, 160, 160, 8)
    base = dict(coarse_block_size=32, group_size=8, tile_size_q=16, tile_size_kv=16, mass_threshold=0.0,
                local_tiles=1, sink_tiles=1, stride=0, seed=3)

    def kept(**kw):
        plan = build_plan(q, k, None, _config("none", "bfla", bfla=BFLAParams(**{**base, **kw})))
        check_plan(plan, q, k)
        out = []
        for i in range(10):
            out.append(sorted((plan.tile_offsets[0, 0, i, : plan.tile_counts[0, 0, i]] // 16).tolist()))
        return out

    band_sink = [sorted({0} | {j for j in (i - 1, i) if j >= 0}) for i in range(10)]
    assert kept() == band_sink  # gamma = 0: mass keeps nothing, only band and sink remain
    assert kept(local_tiles=0, sink_tiles=0) == [[i] for i in range(10)]
    rescued = kept(stride=3)
    for i in range(10):
        want = set(band_sink[i]) | {j for j in range(i + 1) if _py_hash(3, i, j) % 3 == 0}
        assert rescued[i] == sorted(want)
    lucky = kept(random_rescue=0.3)
    for i in range(10):
        want = set(band_sink[i]) | {j for j in range(i + 1) if _py_hash(3 ^ RANDOM_SALT, 0, i, j) < 0.3 * 2**32}
        assert lucky[i] == sorted(want)
    assert kept(random_rescue=1.0) == [list(range(i + 1)) for i in range(10)]


def test_bfla_chunked_prefill_band_uses_absolute_positions():
    q, k, _ = random_qkv(1, 1, 1, 40, 100, 8)
    config = _config("none", "bfla", bfla=BFLAParams(coarse_block_size=32, group_size=8, tile_size_q=16,
                                                     tile_size_kv=16, mass_threshold=0.0, local_tiles=0,
                                                     sink_tiles=0, stride=0))
    plan = build_plan(q, k, None, config)
    # query tile i holds absolute positions 60 + 16i .. min(75 + 16i, 99): own key tiles 3..4, 4..5, 5..6
    got = [sorted((plan.tile_offsets[0, 0, i, : plan.tile_counts[0, 0, i]] // 16).tolist()) for i in range(3)]
    assert got == [[3, 4], [4, 5], [5, 6]]


def test_bfla_default_alpha_lets_gamma_act_and_keeps_a_dominant_block():
    # Why score_scale=None means alpha = scale / g (1/(g sqrt(C))), not the paper's 1/sqrt(C). Blocks of 32, g = 8,
    # one tile per block; band, sink and rescue off, so the plan is the mass selection (plus the own tile).
    # Every query block's own keys score 1 per token above the rest (locality, as RoPE gives real models);
    # query block 6 reads key block 2 strongly (a needle: 6.25 per token); query block 7 reads blocks 1, 3 and 4
    # about as much as its own block (1, 0.9, 0.8 per token).
    N, D = 256, 16
    gen = torch.Generator().manual_seed(0)
    q = 0.1 * torch.randn(1, 2, N, D, generator=gen, dtype=torch.float64)
    k = 0.1 * torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64)
    e = torch.eye(D, dtype=torch.float64)
    for b in range(8):
        q[0, :, 32 * b: 32 * (b + 1)] += 2 * e[2 + b]
        k[0, 0, 32 * b: 32 * (b + 1)] += 2 * e[2 + b]
    q[0, :, 192:224] += 5 * e[0]
    k[0, 0, 64:96] += 5 * e[0]
    q[0, :, 224:256] += 2 * e[1]
    for b, amp in ((1, 2.0), (3, 1.9), (4, 1.8)):
        k[0, 0, 32 * b: 32 * (b + 1)] += amp * e[1]

    def kept(gamma, **kw):
        params = BFLAParams(coarse_block_size=32, group_size=8, tile_size_q=32, tile_size_kv=32, local_tiles=0,
                            sink_tiles=0, stride=0, mass_threshold=gamma, **kw)
        plan = build_plan(q, k, None, _config("none", "bfla", bfla=params), implementation="reference")
        check_plan(plan, q, k)
        blocks = [sorted((plan.tile_offsets[0, 0, i, : plan.tile_counts[0, 0, i]] // 32).tolist()) for i in range(8)]
        return blocks, float(plan.density(N, N).mean())

    default = {gamma: kept(gamma) for gamma in (0.5, 0.9, 0.99)}
    explicit = {gamma: kept(gamma, score_scale=1 / (8 * math.sqrt(D))) for gamma in (0.5, 0.99)}
    assert all(explicit[gamma] == default[gamma] for gamma in explicit)  # None = scale / g
    # gamma moves the density at the default alpha
    assert default[0.5][1] < default[0.9][1] <= default[0.99][1]
    assert default[0.99][1] - default[0.5][1] > 0.3
    # the dominant block is kept at every gamma, and alone (besides the own block) while its mass reaches gamma
    for gamma, (blocks, _) in default.items():
        assert 2 in blocks[6]
    assert default[0.5][0][6] == default[0.9][0][6] == [2, 6]
    # blocks that share the mass are kept together
    assert {1, 3, 4, 7} <= set(default[0.9][0][7])
    # the paper's alpha (1/sqrt(C)): a flatten-g score sums g token products, so the block softmax is one-hot on
    # the own block: gamma has no effect on query blocks 0-5 and blocks 3 and 4 are dropped for query block 7 at
    # gamma 0.5 (on the retrieval model the plan was then band + sink + stride rescue, whatever gamma)
    paper = {gamma: kept(gamma, score_scale=1 / math.sqrt(D)) for gamma in (0.5, 0.99)}
    assert paper[0.5][0][:6] == paper[0.99][0][:6] == [[i] for i in range(6)]
    assert paper[0.5][0][7] == [1, 7] and paper[0.5][0][6] == [2, 6]
    assert paper[0.99][1] < default[0.99][1]


def test_s2o_reorder_matches_algorithm_1():
    B, Hq, Hkv, N, D, S = 1, 4, 2, 150, 8, 64
    q, k, _ = random_qkv(B, Hq, Hkv, N, N, D, dtype=torch.float64)
    config = _config("s2o", "s2o")
    r = reorder_s2o(q, k, 1.0, config.params_of("s2o"))
    lay = r.extras["layout"]
    assert lay.seg_len == (64, 64, 22) and lay.intra_pad == (64, 64, 32) and lay.prefix_len == (0, 64, 128)
    assert lay.base == (0, 64, 192) and lay.length == 352 == r.key_index.shape[-1]
    base, seg_len, intra_pad = s2o_segment_tensors(torch.arange(3), N, S, 16)
    assert (base.tolist(), seg_len.tolist(), intra_pad.tolist()) == (list(lay.base), list(lay.seg_len),
                                                                      list(lay.intra_pad))
    k_guide = k[:, :, :64].mean(2)
    for h in range(Hq):
        s_q = q[0, h] @ k_guide[0, h // 2]
        for n in range(3):
            rows = r.query_index[0, h, n * 64: n * 64 + lay.seg_len[n]].long()
            assert sorted(rows.tolist()) == list(range(n * 64, n * 64 + lay.seg_len[n]))
            assert bool((s_q[rows][:-1] >= s_q[rows][1:]).all())
    for g in range(Hkv):
        ki = r.key_index[0, g].long()
        for n in range(3):
            own = ki[lay.base[n]: lay.base[n] + lay.intra_pad[n]]
            real = list(range(n * 64, n * 64 + lay.seg_len[n]))
            assert own.tolist() == real + [-1] * (lay.intra_pad[n] - lay.seg_len[n])
            pref = ki[lay.base[n] + lay.intra_pad[n]: lay.base[n] + lay.intra_pad[n] + n * 64]
            assert sorted(pref.tolist()) == list(range(n * 64))
            q_mean = q[0, 2 * g: 2 * g + 2, n * 64: n * 64 + lay.seg_len[n]].mean(1).mean(0)
            score = k[0, g, pref] @ q_mean
            assert bool((score[:-1] >= score[1:]).all())


def test_s2o_plan_is_intra_segment_then_ranked_prefix():
    q, k, v = random_qkv(1, 2, 1, 150, 150, 8, dtype=torch.float64)
    plan = build_plan(q, k, None, _config("s2o", "s2o", s2o=S2OParams(segment_size=64, block_size_q=16,
                                                                       block_size_kv=16, sort_queries=False)))
    check_plan(plan, q, k)
    assert plan.query_index is None
    lay_base, intra = (0, 64, 192), (64, 64, 32)
    for i in range(10):
        n = i * 16 // 64
        own = min((i * 16 + 15) // 16, 149 // 16) - n * 4 + 1  # identity queries: causal prefix of own tiles
        assert int(plan.masked_counts[0, 0, i]) == own
        assert int(plan.tile_counts[0, 0, i]) == own + n * 4
        offs = plan.tile_offsets[0, 0, i, : plan.tile_counts[0, 0, i]].tolist()
        assert offs == [lay_base[n] + 16 * t for t in range(own)] + \
            [lay_base[n] + intra[n] + 16 * t for t in range(n * 4)]


def test_s2o_early_stop_visits_fewer_tiles_on_sinks():
    q, k, v = sink_inputs(1, 2, 1, 256)
    config = _config("s2o", "s2o")
    plan = build_plan(q, k, None, config)
    out, visited = reference_attention(q, k, v, plan, return_visited=True)
    assert int(visited.sum()) < 0.6 * int(expand_heads(plan.tile_counts, 2).sum())
    assert rel_error(out, dense_reference(q, k, v)) < 0.02


def test_plan_density():
    plan = causal_plan(2, 3, 100, 100, 16, 16)
    assert torch.equal(plan_density(plan, 100, 100), torch.ones(2, 3))
    half = plan.with_options(tile_counts=torch.zeros_like(plan.tile_counts))
    assert torch.equal(plan_density(half, 100, 100), torch.zeros(2, 3))
    per_kv = causal_plan(1, 2, 64, 64, 16, 16)
    assert plan_density(per_kv, 64, 64, num_heads=8).shape == (1, 8)


def test_s2o_chunks_ignore_what_unlisted_tile_entries_hold():
    """Regression (CPU, about one seed in six): entries past a block's tile count hold whatever the planner left
    there; shifted into a later chunk's slice of the key list they went negative, and the reference executor, which
    reads entries up to the widest count, gathered them."""
    from sparse_compile.methods import s2o
    from sparse_compile.plan import execute_plan

    config = SparseConfig(method="s2o", s2o=S2OParams(segment_size=64, block_size_q=16, block_size_kv=16,
                                                      early_stop=0.02))
    torch.manual_seed(5)  # inputs whose plans (batch 2) once reached the bug; the fillers below force it too
    q, k, v = random_qkv(2, 2, 1, 200, 200, 16)
    plan = build_plan(q, k, None, config)
    listed = torch.arange(plan.tile_offsets.shape[-1]) < plan.tile_counts[..., None]
    for filler in (None, 0, 2**30):
        padded = plan if filler is None else plan.with_options(tile_offsets=torch.where(listed, plan.tile_offsets,
                                                            torch.full_like(plan.tile_offsets, filler)))
        whole, visits = execute_plan(q, k, v, padded, None, kernel="reference", return_visited=True)
        chunked, chunked_visits = s2o.execute_s2o(q, k, v, padded, None, config.params_of("s2o"), kernel="reference",
                                                  return_visited=True, list_budget=0.5, copy_bytes_floor=0)
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
        assert torch.equal(chunked_visits, visits)


def test_s2o_copies_a_list_in_one_piece_while_it_fits_the_floor(monkeypatch):
    """Chunks cost launches and tails: a list whose K/V copy fits ``COPY_BYTES_FLOOR`` runs in one call; a list
    over both the floor and ``LIST_BUDGET`` x N runs in segment chunks."""
    from sparse_compile.methods import s2o

    q, k, v = random_qkv(1, 2, 1, 200, 200, 16)
    config = SparseConfig(method="s2o", s2o=S2OParams(segment_size=32, block_size_q=16, block_size_kv=16,
                                                      early_stop=0.02))
    plan = build_plan(q, k, None, config)
    assert plan.key_index.shape[-1] > s2o.LIST_BUDGET * 200  # long enough to chunk without the floor
    calls = []
    real = s2o.execute_plan
    monkeypatch.setattr(s2o, "execute_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    whole = s2o.execute_s2o(q, k, v, plan, None, config.params_of("s2o"), kernel="reference")
    assert len(calls) == 1
    row_bytes = 1 * 1 * (16 + 16) * 4  # batch x KV heads x (Dk + Dv) x fp32
    chunked = s2o.execute_s2o(q, k, v, plan, None, config.params_of("s2o"), kernel="reference",
                              copy_bytes_floor=row_bytes * plan.key_index.shape[-1] // 2)
    assert len(calls) > 2
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_s2o_runs_in_segment_chunks_with_the_same_result(kernel):
    """S2O's executor runs its plan chunk of segments by chunk (O(N) extra memory): the same output and visits."""
    from sparse_compile.methods import s2o
    from sparse_compile.plan import execute_plan

    q, k, v = random_qkv(2, 2, 1, 200, 200, 16)  # GQA, a ragged last segment
    config = SparseConfig(method="s2o", s2o=S2OParams(segment_size=64, block_size_q=16, block_size_kv=16,
                                                      early_stop=0.02))
    plan = build_plan(q, k, None, config)
    whole, visits = execute_plan(q, k, v, plan, None, kernel=kernel, return_visited=True)
    chunked, chunked_visits = s2o.execute_s2o(q, k, v, plan, None, config.params_of("s2o"), kernel=kernel, return_visited=True,
                                              list_budget=0.5, copy_bytes_floor=0)  # many chunks
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    if kernel == "triton":  # the kernels run the masked squares as each segment's causal triangle
        window_counts = s2o.window_tables(200, 64, 16, 16, q.device)[1]
        visits = visits - plan.masked_counts.repeat_interleave(2 // plan.masked_counts.shape[1], 1) + window_counts
    assert torch.equal(chunked_visits, visits)
    exact = s2o.execute_s2o(q, k, v, build_plan(q, k, None, config.keep_all()), None, config.params_of("s2o"), kernel=kernel)
    assert rel_error(exact, dense_reference(q, k, v)) < 1e-5
