"""The GPU fast path of the reorder/select stages (the ``fast_*`` stages of sparse_compile.methods) against the PyTorch references.

Agreement rule. The fast stages compute the same quantities with sums in another order, so a decision that sits
on a boundary within float32 rounding may go the other way. Everything else must be identical:

* selection: for every (batch, head, query block) the fast block set must contain every block the reference
  rule keeps *surely* and nothing it drops *surely*, where "surely" is judged on float64 masses with a margin
  (``EPS_P`` on the probability of a block when ordering it, ``EPS_M`` on the cumulative mass against tau);
  blocks in between are ambiguous and may go either way. Most cases are simply identical, and the number of
  ambiguous rows is bounded;
* orders (PBS key permutation, S2O query sort and key ranking): the fast order must be the reference order, or
  differ only by swapping entries whose float64 scores are within ``EPS_ORDER`` (relative);
* everything that does not depend on floating-point sums (visibility, forced tiles, tile order inside the plan,
  S2O's layout, BFLA's tile stage) is compared exactly, and keep-all plans are identical.

CPU tests run the kernels under the Triton interpreter (conftest sets TRITON_INTERPRET=1) at small sizes in
float32/float16. The comparison helpers are in ``selection_helpers.py``; the GPU tests (bf16 at 8K) and the sm_90
compile check in ``test_selection_hopper.py``, the non-finite inputs in ``test_selection_nan.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.state import STATE
from sparse_compile.extend import BFLAParams, S2OParams
from sparse_compile.kernels import bfla as bfla_kernels
from sparse_compile.kernels import common as kernel_common
from sparse_compile.kernels import pooling, sorting
from sparse_compile.kernels.reference import segmented_argsort_desc
from sparse_compile.methods import Reordering, bfla, build_plan, pbs, s2o, sparge, stage_functions
from sparse_compile.methods.fast_path import tile_grid
from sparse_compile.plan import plan_density
from sparse_compile.methods.tiles import visibility
from sparse_compile.methods.scoring import block_mean, block_self_similarity, logical_keys
from sparse_compile.methods.bfla import bfla_block_scores, block_softmax_scale
from sparse_compile.methods.pbs import pbs_key_importance
from sparse_compile.plan import VISIBLE_NONE, check_plan, reference_attention

from selection_helpers import (
    PRESETS,
    SMALL,
    _config,
    _pbs_segments,
    assert_keep_agrees,
    assert_order_agrees,
    assert_plan_layout,
    fast_bfla_coarse,
    keep_table,
    plans_identical,
    reference_bfla_coarse,
    reference_bounds,
    structured_qk,
    stage_params,
)


# ---------------------------------------------------------------------------------------------------------------
# CPU (Triton interpreter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_pbs_reorder_and_select_agree(dtype):
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 16
    q, k = structured_qk(B, Hq, Hkv, N, N, D, 16, seed=1, dtype=dtype)
    cfg = _config("pbs", "pbs")
    scale = 1 / math.sqrt(D)
    r_ref = stage_functions("pbs", "pbs", False)[0](q, k, scale, stage_params(cfg, "pbs"))
    r_fast = pbs.reorder_pbs_fast(q, k, scale, cfg.params_of("pbs"))
    imp = pbs_key_importance(q.double(), k.double(), scale, cfg.params_of("pbs").block_size)
    assert r_fast.key_index.dtype == torch.int32 and r_fast.segment_size == r_ref.segment_size
    assert_order_agrees(r_fast.key_index, r_ref.key_index, imp, _pbs_segments(N, 32), "pbs key order")
    assert torch.equal(r_fast.key_index[..., (N // 32) * 32:], r_ref.key_index[..., (N // 32) * 32:])
    # stage-wise: the same reordering in, the same blocks out
    p_fast = pbs.select_pbs_fast(q, k, scale, r_ref, cfg.params_of("pbs"))
    p_ref = stage_functions("pbs", "pbs", False)[1](q, k, scale, r_ref, cfg.params_of("pbs"))
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    if not plans_identical(p_fast, p_ref):
        sure, maybe = reference_bounds("pbs", q, k, scale, r_ref, cfg)
        assert_keep_agrees(keep_table(p_fast, sure.shape[-1]), sure, maybe, what="pbs")
    # a kept set determines the plan: the masked/unmasked split and the order must match exactly
    nkt = -(-N // 16)
    same = (keep_table(p_fast, nkt) == keep_table(p_ref, nkt)).all(-1)
    assert bool((p_fast.masked_counts == p_ref.masked_counts)[same].all())
    assert bool((p_fast.tile_offsets == p_ref.tile_offsets)[same].all())


@pytest.mark.parametrize("shape", [(2, 4, 1, 201, 201, 16), (1, 2, 2, 77, 150, 8)], ids=["gqa-ragged", "chunked"])
@pytest.mark.parametrize("reorder", ["none", "pbs"])
def test_sparge_select_agrees(reorder, shape):
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k = structured_qk(B, Hq, Hkv, Nq, Nk, D, 16, seed=2)
    cfg = _config(reorder, "sparge")
    scale = 1 / math.sqrt(D)
    r = stage_functions(reorder, "pbs", False)[0](q, k, scale, stage_params(cfg, reorder))
    p_fast = sparge.select_sparge_fast(q, k, scale, r, cfg.params_of("sparge"))
    p_ref = stage_functions(reorder, "sparge", False)[1](q, k, scale, r, cfg.params_of("sparge"))
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    if not plans_identical(p_fast, p_ref):
        sure, maybe = reference_bounds("sparge", q, k, scale, r, cfg)
        assert_keep_agrees(keep_table(p_fast, sure.shape[-1]), sure, maybe, what="sparge")


@pytest.mark.parametrize("score_scale", [None, 1 / 4], ids=["default-alpha", "paper-alpha"])
@pytest.mark.parametrize("reorder", ["none", "pbs"])
def test_bfla_select_agrees(reorder, score_scale):
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 150, 230, 16
    params = dict(SMALL, bfla=BFLAParams(coarse_block_size=32, group_size=8, tile_size_q=16, tile_size_kv=16,
                                         local_tiles=1, stride=4, random_rescue=0.2, score_scale=score_scale))
    cfg = _config(reorder, "bfla", params)
    q, k = structured_qk(B, Hq, Hkv, Nq, Nk, D, 16, seed=3)
    scale = 1 / math.sqrt(D)
    alpha = block_softmax_scale(cfg.params_of("bfla"), scale)  # the block softmax's scale (Eq. 9): None = scale / g
    assert alpha == (score_scale if score_scale is not None else scale / 8)
    r = stage_functions(reorder, "pbs", False)[0](q, k, scale, stage_params(cfg, reorder))
    # coarse mass per query head: agreement up to ambiguous blocks
    coarse_fast = fast_bfla_coarse(q, k, alpha, r, cfg)
    coarse_ref = reference_bfla_coarse(q, k, alpha, r, cfg)
    if not torch.equal(coarse_fast, coarse_ref):
        sure, maybe = reference_bounds("bfla_coarse", q, k, alpha, r, cfg)
        assert_keep_agrees(coarse_fast, sure, maybe, what="bfla coarse")
    # the tile stage exactly, from the reference's coarse mass
    p = cfg.params_of("bfla")
    tpos = (pooling.block_pool(k, 16, key_index=r.key_index, want_mean=False, want_positions=True)
            if r.key_index is not None else None)
    tables = bfla_kernels.bfla_tiles(tile_grid(q.shape, k.shape, q.device, r, 16, 16), coarse_ref.to(torch.int8), coarse=32,
                                     local_tiles=p.local_tiles, sink_tiles=p.sink_tiles, stride=p.stride,
                                     stride_seed=p.seed, random_rescue=p.random_rescue,
                                     random_seed=p.seed ^ bfla.RANDOM_SALT, key_tiles=tpos,
                                     segment=r.segment_size or 0)
    p_ref = stage_functions(reorder, "bfla", False)[1](q, k, scale, r, cfg.params_of("bfla"))
    for name, t in zip(("tile_offsets", "tile_counts", "masked_counts"), tables):
        assert torch.equal(t, getattr(p_ref, name)), name
    # and the whole fast stage
    p_fast = bfla.select_bfla_fast(q, k, scale, r, cfg.params_of("bfla"))
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    if torch.equal(coarse_fast, coarse_ref):
        assert plans_identical(p_fast, p_ref)


@pytest.mark.parametrize("sort_queries", [True, False])
def test_s2o_reorder_and_select_agree(sort_queries):
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 16
    params = dict(SMALL, s2o=S2OParams(segment_size=64, block_size_q=16, block_size_kv=16,
                                       sort_queries=sort_queries))
    cfg = _config("s2o", "s2o", params)
    q, k = structured_qk(B, Hq, Hkv, N, N, D, 16, seed=4)
    scale = 1 / math.sqrt(D)
    r_ref = stage_functions("s2o", "s2o", False)[0](q, k, scale, stage_params(cfg, "s2o"))
    r_fast = s2o.reorder_s2o_fast(q, k, scale, cfg.params_of("s2o"))
    lay = r_ref.extras["layout"]
    assert r_fast.extras["layout"] == lay
    S, g = 64, len(lay.seg_len)
    if sort_queries:
        kg = k[:, :, :S].double().mean(2)
        sq = (q.double().view(B, Hkv, Hq // Hkv, N, D) * kg[:, :, None, None]).sum(-1).view(B, Hq, N)
        assert_order_agrees(r_fast.query_index, r_ref.query_index, sq, [(s * S, min(N, (s + 1) * S)) for s in range(g)],
                            "s2o query order")
    else:
        assert r_fast.query_index is None and r_ref.query_index is None
    # key list: own keys exact, each ranked prefix in descending <q_mean[n], K> order
    qm = block_mean(q.double(), S).view(B, Hkv, Hq // Hkv, g, D).mean(2)
    ki_f, ki_r = r_fast.key_index, r_ref.key_index
    assert ki_f.shape == ki_r.shape and ki_f.dtype == torch.int32
    for n in range(g):
        a = lay.base[n]
        assert torch.equal(ki_f[..., a: a + lay.intra_pad[n]], ki_r[..., a: a + lay.intra_pad[n]])
        if n:
            s_n = (qm[:, :, n, None, :] @ k.double().transpose(-1, -2)[..., : n * S])[..., 0, :]  # (B, Hkv, nS)
            z = a + lay.intra_pad[n]
            assert_order_agrees(ki_f[..., z: z + n * S], ki_r[..., z: z + n * S], s_n, [(0, n * S)],
                                f"s2o prefix {n}")
    p_fast = s2o.select_s2o_fast(q, k, scale, r_ref, cfg.params_of("s2o"))
    p_ref = stage_functions("s2o", "s2o", False)[1](q, k, scale, r_ref, cfg.params_of("s2o"))
    assert_plan_layout(p_fast, p_ref)
    assert plans_identical(p_fast, p_ref)


@pytest.mark.parametrize("ids", ["uint8", "int16", "int32"])
def test_s2o_ranking_is_a_stable_descending_sort_per_segment(monkeypatch, ids):
    """The two-sort ranking equals a stable descending argsort of each segment's prefix scores, exact ties included
    (small-integer keys and means: every score exact in float32), with segment ids of every width."""
    from sparse_compile.kernels import s2o as s2o_kernels

    if ids != "uint8":
        monkeypatch.setattr(s2o_kernels, "UINT8_SEGMENT_IDS", 0)
    if ids == "int32":
        monkeypatch.setattr(s2o_kernels, "INT16_SEGMENT_IDS", 0)
    gen = torch.Generator().manual_seed(11)
    B, Hkv, S, bn, D = 2, 3, 32, 16, 16
    for n in (5 * S, 5 * S - 7):
        g = -(-n // S)
        k = torch.randint(-2, 3, (B, Hkv, n, D), generator=gen).float()
        k[:, :, 40:50] = k[:, :, 10:20]  # repeated keys: equal scores, ranked by position
        qm = torch.randint(-1, 2, (B, Hkv, g, D), generator=gen).float()
        ranking = s2o_kernels.s2o_rank_keys(k, qm, S)
        layout = s2o.s2o_layout(n, S, bn)
        key_index = s2o_kernels.s2o_assemble(ranking, B, Hkv, n, S, bn, layout.length)
        for seg in range(1, g):
            scores = (qm[:, :, seg, None, :] @ k[..., : seg * S, :].transpose(-1, -2))[..., 0, :]
            want = torch.sort(scores, dim=-1, descending=True, stable=True).indices
            z = layout.base[seg] + layout.intra_pad[seg]
            assert torch.equal(key_index[..., z: z + seg * S].long(), want), (n, seg)
            assert torch.equal(key_index[..., layout.base[seg]: z][..., : layout.seg_len[seg]].long(),
                               torch.arange(seg * S, seg * S + layout.seg_len[seg]).expand(B, Hkv, -1))


@pytest.mark.parametrize("method", list(PRESETS))
def test_build_plan_end_to_end(method):
    """build_plan(fast) == build_plan(reference) on structured inputs, else explained by the stage tests above."""
    B, Hq, Hkv, N, D = 1, 4, 2, 192, 16
    q, k = structured_qk(B, Hq, Hkv, N, N, D, 16, seed=5)
    v = torch.randn(B, Hkv, N, D)
    cfg = _config(*PRESETS[method])
    p_fast = build_plan(q, k, None, cfg, implementation="fast")
    p_ref = build_plan(q, k, None, cfg, implementation="reference")
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    d_fast = plan_density(p_fast, N, N, Hq)
    d_ref = plan_density(p_ref, N, N, Hq)
    assert float((d_fast - d_ref).abs().max()) < 0.05
    out_f = reference_attention(q, k, v, p_fast)
    out_r = reference_attention(q, k, v, p_ref)
    assert float((out_f - out_r).norm() / out_r.norm()) < 0.02


@pytest.mark.parametrize("method", list(PRESETS))
def test_keep_all_plans_identical(method):
    q, k = structured_qk(2, 4, 2, 100, 100, 8, 16, seed=6)
    cfg = _config(*PRESETS[method]).keep_all()
    scale = 1 / math.sqrt(8)
    r = stage_functions(*PRESETS[method], False)[0](q, k, scale, stage_params(cfg, PRESETS[method][0]))
    p_fast = stage_functions(*PRESETS[method], True)[1](q, k, scale, r, cfg.params_of(PRESETS[method][1]))
    p_ref = stage_functions(*PRESETS[method], False)[1](q, k, scale, r, cfg.params_of(PRESETS[method][1]))
    assert_plan_layout(p_fast, p_ref)
    assert plans_identical(p_fast, p_ref)


def test_exact_ties_follow_the_stable_order():
    """Identical keys: equal scores everywhere. The stable tie-break (lower index first) must be reproduced."""
    B, Hq, Hkv, N, D = 1, 2, 1, 128, 16
    q = torch.randn(B, Hq, N, D)
    k = torch.randn(1, 1, 1, D).expand(B, Hkv, N, D).contiguous()
    k[:, :, :3] = torch.randn(3, D) * 2  # a few distinct keys in the first tile
    for method in ("pbs", "sparge", "bfla", "sampled", "peak"):
        cfg = _config(*PRESETS[method])
        p_fast = build_plan(q, k, None, cfg, implementation="fast")
        p_ref = build_plan(q, k, None, cfg, implementation="reference")
        assert plans_identical(p_fast, p_ref), method
        if p_ref.key_index is not None:
            assert torch.equal(p_fast.key_index, p_ref.key_index)


def test_pieces_match_reference(monkeypatch):
    """Pooling statistics, visibility inputs, segmented argsort and BFLA scores against the reference functions."""
    q, k = structured_qk(2, 4, 2, 150, 150, 24, 16, seed=7)
    pool = pooling.block_pool(q, 16, want_similarity=True)
    torch.testing.assert_close(pool.mean, block_mean(q, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.similarity, block_self_similarity(q, 16), rtol=1e-5, atol=1e-5)
    perm = torch.stack([torch.randperm(150) for _ in range(4)]).view(2, 2, 150).to(torch.int32)
    perm[0, 1, 140:] = -1  # padding entries
    kp = pooling.block_pool(k, 32, key_index=perm, want_similarity=True, want_positions=True)
    keys, valid = logical_keys(k, perm)
    torch.testing.assert_close(kp.mean, block_mean(keys, 32, valid), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kp.similarity, block_self_similarity(keys, 32, valid), rtol=1e-5, atol=1e-5)
    pos = torch.where(valid, perm.long(), torch.full_like(perm.long(), 2**31 - 1))
    pos = torch.nn.functional.pad(pos, (0, 10), value=2**31 - 1).view(2, 2, 5, 32)
    assert torch.equal(kp.min_position.long(), pos.amin(-1))
    # a row with a NaN: plain means take it in, finite_rows_mean leaves it out (as block_mean(finite_rows=True))
    q_nan = q.clone()
    q_nan[0, 1, 20] = float("nan")
    assert bool(pooling.block_pool(q_nan, 16).mean[0, 1, 1].isnan().all())
    torch.testing.assert_close(pooling.block_pool(q_nan, 16, finite_rows_mean=True).mean,
                               block_mean(q_nan, 16, finite_rows=True), rtol=1e-5, atol=1e-5)
    # long blocks read in several chunks (sums kept per row slot across chunks), as on the GPU
    monkeypatch.setattr(pooling, "interpreting", lambda: False)  # the GPU's chunk budget: 8192 / D rows
    x = torch.randn(1, 2, 2100, 16)
    x[0, 0, 300] = float("inf")
    for kw in (dict(want_similarity=True), dict(finite_rows_mean=True)):
        got = pooling.block_pool(x, 1024, **kw)
        want = block_mean(x, 1024, finite_rows=kw.get("finite_rows_mean", False))
        torch.testing.assert_close(got.mean, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        if "want_similarity" in kw:
            torch.testing.assert_close(got.similarity, block_self_similarity(x, 1024), rtol=1e-5, atol=1e-5,
                                       equal_nan=True)
    guide = torch.randn(1, 1, 16)
    got = pooling.block_pool(x, 1024, guide=guide, sort_guide=True, finite_rows_mean=True)
    torch.testing.assert_close(got.mean, block_mean(x, 1024, finite_rows=True), rtol=1e-5, atol=1e-5)
    scores = (x * guide[:, :, None]).sum(-1)
    scores = torch.where(scores.isfinite(), scores, torch.full_like(scores, float("inf")))
    torch.testing.assert_close(got.guide_score, scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.guide_order, segmented_argsort_desc(got.guide_score, 1024, 3).int())
    monkeypatch.undo()
    # segmented argsort with ties and a ragged last segment
    x = torch.randint(0, 5, (3, 2, 70)).float()
    for seg, nseg in ((16, 4), (16, 5), (32, 2), (64, 1)):
        assert torch.equal(sorting.segmented_argsort_desc(x, seg, nseg), segmented_argsort_desc(x, seg, nseg).int())
    # BFLA flatten-g scores (causal region; the reference fills all)
    s_f = bfla_kernels.bfla_block_scores(q, k, 32, 8)
    s_r = bfla_block_scores(q, k, 32, 8)
    vis = visibility(150, 150, 32, 32, Reordering("none"), 2, 4, "cpu") != VISIBLE_NONE
    torch.testing.assert_close(s_f[vis], s_r[vis], rtol=1e-5, atol=1e-4)


def test_dispatch_and_config_switch(monkeypatch):
    q, k = structured_qk(1, 2, 1, 64, 64, 8, 16)
    calls = []

    def spy(q, k, scale, r, params):
        calls.append("fast")
        return stage_functions("pbs", "pbs", False)[1](q, k, scale, r, params)

    import dataclasses

    from sparse_compile import registry

    pbs_spec = registry.method_spec("pbs")
    monkeypatch.setitem(STATE["registry.methods"], "pbs", dataclasses.replace(pbs_spec, fast_select=spy))
    cfg = _config("pbs", "pbs")
    build_plan(q, k, None, cfg)  # auto on CPU tensors: the reference
    assert calls == []
    build_plan(q, k, None, cfg, implementation="fast")
    assert calls == ["fast"]
    build_plan(q, k, None, SparseConfig(method="pbs", planner="fast", pbs=SMALL["pbs"]))
    assert calls == ["fast", "fast"]
    build_plan(q, k, None, SparseConfig(method="pbs", planner="fast", pbs=SMALL["pbs"]), implementation="reference")
    assert calls == ["fast", "fast"]
    with pytest.raises(ValueError, match="implementation"):
        build_plan(q, k, None, cfg, implementation="gpu")
    with pytest.raises(ValueError, match="planner"):
        SparseConfig(planner="gpu")
    with pytest.raises(ValueError, match="dtype"):
        build_plan(q.double(), k.double(), None, cfg, implementation="fast")
    # no interpreter and no CUDA: "fast" refuses, "auto" runs the reference
    monkeypatch.setattr(kernel_common, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        build_plan(q, k, None, cfg, implementation="fast")
    # a method registered without a fast twin runs its reference stage on the fast path too
    def custom(q, k, scale, r, params):
        raise NotImplementedError

    replaced = dataclasses.replace(pbs_spec, select=custom, fast_select=None)
    monkeypatch.setitem(STATE["registry.methods"], "pbs", replaced)
    assert stage_functions("pbs", "pbs", True)[1] is custom
    assert stage_functions("pbs", "sparge", True)[1] is sparge.select_sparge_fast


def test_density_reaches_runtime_stats():
    """record_density: the per-head density of a fast-path plan reaches runtime_stats (visited tiles for S2O)."""
    from sparse_compile import runtime_stats
    from sparse_compile.report import reset_runtime_stats

    q, k = structured_qk(1, 4, 2, 128, 128, 16, 16, seed=8)
    v = torch.randn(1, 2, 128, 16)
    for method in ("pbs", "s2o"):
        reset_runtime_stats()
        cfg = SparseConfig(method=method, planner="fast", record_density=True, min_seq_len=64, **SMALL)
        sparse_compile.sparse_attention(q, k, v, config=cfg)
        entry = runtime_stats()["sparse_attention"]
        assert entry.last_path == "sparse"
        dens = entry.last_density_per_head
        assert dens is not None and len(dens) == 4
        plan = build_plan(q, k, None, cfg)
        _, visited = reference_attention(q, k, v, plan, return_visited=True)
        from sparse_compile.plan import causal_tile_count
        from sparse_compile.plan import causal_tiles_per_block

        if plan.query_index is None:
            # each query block counts at most its causal tiles (a permuted diagonal segment is a full square)
            causal = causal_tiles_per_block(visited.shape[-1], 128, 128, plan.block_m, plan.block_n)
            kept = torch.minimum(visited.double(), causal.double())
            want = kept.sum(2).mean(0) / causal_tile_count(128, 128, plan.block_m, plan.block_n)
        else:  # reordered queries (S2O): each block against the tiles its own rows reach
            blocks = visited.shape[-1]
            rows = torch.nn.functional.pad(plan.query_index.long(), (0, blocks * plan.block_m - 128), value=-1)
            last = rows.view(*rows.shape[:2], blocks, plan.block_m).amax(-1)
            reach = torch.where(last >= 0, last // plan.block_n + 1, 0).double()
            reach = reach.repeat_interleave(4 // reach.shape[1], dim=1)
            want = (torch.minimum(visited.double(), reach).sum(2) / reach.sum(2)).mean(0)
        assert max(abs(a - float(b)) for a, b in zip(dens, want)) < 1e-9
        assert all(0 < d <= 1 for d in dens)
        if method == "pbs":
            assert all(d <= float(p) + 1e-6 for d, p in zip(dens, plan_density(plan, 128, 128, 4)[0]))


def test_bfla_score_scale_softens_the_block_softmax():
    # the default alpha = 1/(g*sqrt(C)) puts block logits on the token scale: the mass spreads and gamma keeps
    # more blocks than with the paper's alpha = 1/sqrt(C)
    B, Hq, Hkv, N, D = 1, 4, 2, 256, 16
    q, k = structured_qk(B, Hq, Hkv, N, N, D, 16, seed=5)
    bfla = dict(coarse_block_size=32, group_size=8, tile_size_q=16, tile_size_kv=16, local_tiles=0, stride=0,
                mass_threshold=0.9)
    densities = []
    for score_scale in (1 / math.sqrt(D), None):
        cfg = _config("none", "bfla", dict(SMALL, bfla=BFLAParams(score_scale=score_scale, **bfla)))
        plan = build_plan(q, k, 1 / math.sqrt(D), cfg, implementation="reference")
        densities.append(float(plan_density(plan, N, N).mean()))
    assert densities[1] > densities[0], densities
    with pytest.raises(ValueError, match="score_scale"):
        BFLAParams(score_scale=0.0)


@pytest.mark.parametrize("shape,local,keep_first", [((1, 4, 2, 400, 400, 16), 1, True),
                                                    ((2, 2, 1, 150, 420, 32), 2, False)], ids=["gqa", "chunked"])
def test_sampled_mass_kernel_matches_the_reference(shape, local, keep_first):
    """``kernels.sampled`` against ``sampled_tile_logits`` on every visible tile, with far tiles sampled for the
    normaliser (tiles 7, 15, ... before each block's region), rows of several blocks per program."""
    from sparse_compile.kernels.sampled import sampled_mass_logits
    from sparse_compile.methods.sampled import sampled_tile_logits

    b, hq, hkv, nq, nk, d = shape
    torch.manual_seed(0)
    q, k = torch.randn(b, hq, nq, d), torch.randn(b, hkv, nk, d) * 2
    want = sampled_tile_logits(q, k, 0.2, 16, 4, local=local, keep_first=keep_first)
    got = sampled_mass_logits(q, k, 0.2, 16, 16, 4, local=local, keep_first=keep_first)
    seen = visibility(nq, nk, 16, 16, Reordering("none"), b, hq, q.device) != VISIBLE_NONE  # the rest is unwritten
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)


def test_sampled_constants_match_the_kernels():
    """The reference keeps its own copies (it must not import Triton): they are the kernel's."""
    from sparse_compile.kernels import sampled as kernel
    from sparse_compile.methods import sampled as reference

    assert (reference.TINY, reference.LIMIT, reference.FAR_STRIDE) == (kernel.TINY, kernel.LIMIT, kernel.FAR_STRIDE)
