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
float32/float16; GPU tests (``@pytest.mark.gpu``) run bf16 at 8K.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_compile
from sparse_compile import BFLAParams, PBSParams, S2OParams, SampledParams, SparseConfig, SpargeParams
from sparse_compile.kernels import bfla as bfla_kernels
from sparse_compile.kernels import common as kernel_common
from sparse_compile.kernels import pooling, sorting
from sparse_compile.kernels.reference import segmented_argsort_desc
from sparse_compile.kernels.mass import MassRule, mass_select
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.methods import Reordering, bfla, build_plan, pbs, s2o, sparge, stage_functions
from sparse_compile.methods.fast_path import tile_grid
from sparse_compile.plan import plan_density
from sparse_compile.methods.tiles import diagonal_tiles, first_key_tile, local_tiles, visibility
from sparse_compile.methods.scoring import (
    block_mean,
    block_self_similarity,
    group_scores,
    logical_keys,
    masked_softmax,
    top_mass,
)
from sparse_compile.methods.bfla import bfla_block_scores, block_softmax_scale
from sparse_compile.methods.pbs import pbs_key_importance
from sparse_compile.methods.peak import PeakParams, peak_tile_scores, scores_in_fp8
from sparse_compile.methods.sampled import sampled_tile_logits
from sparse_compile.plan import VISIBLE_NONE, block_visibility, check_plan, execute_plan, reference_attention

EPS_P = 2e-4  # relative margin on a block probability when ordering blocks
EPS_M = 5e-5  # absolute margin on a cumulative mass against tau * total
EPS_ORDER = 1e-5  # relative margin on a score when ordering keys or queries
EPS_SIM = 1e-4  # margin on SpargeAttn's self-similarity against theta

SMALL = dict(
    pbs=PBSParams(block_size=16, segment_size=32),
    sparge=SpargeParams(block_size_q=32, block_size_kv=16),
    bfla=BFLAParams(coarse_block_size=32, group_size=8, tile_size_q=16, tile_size_kv=16, local_tiles=1, stride=4),
    s2o=S2OParams(segment_size=64, block_size_q=16, block_size_kv=16),
    # tiny prompts: local tiles and the exact tail would cover most of them (tests of their own below)
    sampled=SampledParams(block_size=16, sample_every=4, budget=0.3, local_tiles=0, exact_tail_blocks=0),
    peak=PeakParams(block_size=16, sample_every=4, budget=0.3, local_tiles=0, exact_tail_blocks=0),
)
PRESETS = {"pbs": ("pbs", "pbs"), "sparge": ("none", "sparge"), "bfla": ("none", "bfla"), "s2o": ("s2o", "s2o"),
           "sampled": ("none", "sampled"), "peak": ("none", "peak")}


def _config(reorder, select, params=SMALL, **kw):
    return SparseConfig(method="pbs", reorder=reorder, select=select, **params, **kw)


def structured_qk(batch, heads_q, heads_kv, n_q, n_k, dim, block, *, seed=0, dtype=torch.float32, device="cpu"):
    """Inputs with the structure selection reacts to (random inputs make every block look alike).

    Key blocks of ``block`` rows share a direction with per-block noise (some self-similar, some not), a few key
    blocks are strong sinks, and each query block leans toward a few random key blocks' directions.
    """
    g = torch.Generator().manual_seed(seed)
    nb = -(-n_k // block)
    dirs = torch.randn(batch, heads_kv, nb, dim, generator=g, dtype=torch.float64)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True) * 3
    noise = torch.rand(batch, heads_kv, nb, 1, generator=g, dtype=torch.float64) * 2
    k = dirs.repeat_interleave(block, 2)[:, :, :n_k]
    k = k + noise.repeat_interleave(block, 2)[:, :, :n_k] * torch.randn(batch, heads_kv, n_k, dim, generator=g,
                                                                          dtype=torch.float64) * 3 / math.sqrt(dim)
    sink = torch.randn(dim, generator=g, dtype=torch.float64)
    sink = sink / sink.norm() * 4
    k[:, :, : max(1, block // 2)] += sink
    m = heads_q // heads_kv
    pick = torch.randint(0, nb, (batch, heads_q, -(-n_q // block), 3), generator=g)
    kd = dirs.repeat_interleave(m, 1)
    lean = torch.gather(kd[:, :, None].expand(-1, -1, pick.shape[2], -1, -1), 3,
                        pick[..., None].expand(-1, -1, -1, -1, dim)).sum(3)
    q = lean.repeat_interleave(block, 2)[:, :, :n_q] * 0.7 + 0.5 * sink
    q = q + torch.randn(batch, heads_q, n_q, dim, generator=g, dtype=torch.float64)
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------
# comparison helpers


def keep_table(plan, num_tiles: int) -> torch.Tensor:
    """bool (B, H, nqb, num_tiles): the tiles each query block lists."""
    offs = plan.tile_offsets.long() // plan.block_n
    live = torch.arange(offs.shape[-1], device=offs.device) < plan.tile_counts[..., None].long()
    out = torch.zeros(*offs.shape[:3], num_tiles + 1, dtype=torch.bool, device=offs.device)
    out.scatter_(-1, torch.where(live, offs, torch.full_like(offs, num_tiles)), True)
    return out[..., :num_tiles]


def assert_plan_layout(fast_plan, ref_plan):
    """Same block sizes, options, shapes and indices."""
    assert (fast_plan.block_m, fast_plan.block_n) == (ref_plan.block_m, ref_plan.block_n)
    assert fast_plan.early_stop == ref_plan.early_stop and fast_plan.pv_skip == ref_plan.pv_skip
    for name in ("tile_offsets", "tile_counts", "masked_counts"):
        a, b = getattr(fast_plan, name), getattr(ref_plan, name)
        assert a.dtype == torch.int32 and a.shape == b.shape, (name, a.shape, b.shape)


def plans_identical(a, b) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("tile_offsets", "tile_counts", "masked_counts"))


def mass_bounds(p, cand, tau, head, total):
    """(surely kept, possibly kept) candidates under the top_mass rule, float64, with the EPS margins."""
    p = torch.where(cand, p, torch.zeros((), dtype=p.dtype, device=p.device))
    T = tau * total
    srt, _ = torch.sort(p, dim=-1)  # ascending
    csum = torch.cumsum(srt.flip(-1), -1).flip(-1)  # csum[r] = mass of the sorted entries >= srt[r]
    csum = torch.cat([csum, torch.zeros_like(csum[..., :1])], -1)
    tol = EPS_P * p + 1e-12
    # mass of everything that might come before j (p_i >= p_j - tol, i != j) and that surely does (p_i > p_j + tol)
    lo_idx = torch.searchsorted(srt.contiguous(), (p - tol).contiguous(), right=False)
    hi_idx = torch.searchsorted(srt.contiguous(), (p + tol).contiguous(), right=True)
    maybe_before = torch.gather(csum, -1, lo_idx) - p
    sure_before = torch.gather(csum, -1, hi_idx)
    sure = cand & (head + maybe_before < T - EPS_M)
    maybe = cand & (head + sure_before < T + EPS_M)
    return sure, maybe


def assert_keep_agrees(fast_keep, sure, maybe, *, max_ambiguous_rows=0.2, what=""):
    """sure <= fast_keep <= maybe everywhere; returns the number of rows with ambiguous blocks."""
    missing = sure & ~fast_keep
    extra = fast_keep & ~maybe
    assert not bool(missing.any()), f"{what}: {int(missing.sum())} surely-kept blocks dropped at {missing.nonzero()[:5].tolist()}"
    assert not bool(extra.any()), f"{what}: {int(extra.sum())} surely-dropped blocks kept at {extra.nonzero()[:5].tolist()}"
    amb_rows = int((maybe & ~sure).any(-1).sum())
    rows = fast_keep[..., 0].numel()
    assert amb_rows <= max_ambiguous_rows * rows, f"{what}: {amb_rows}/{rows} rows ambiguous (margins too wide?)"
    return amb_rows


def reference_bounds(select, q, k, scale, r, config):
    """Float64 masses of the reference selector for (sure, maybe) keep bounds at its block level.

    Returns (sure, maybe) bool (B, H, nqb, nkt) including the forced tiles, restricted to visible tiles.
    """
    qd, kd = q.double(), k.double()
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if select == "pbs":
        p = config.params_of("pbs")
        bs = p.block_size
        vis = visibility(Nq, Nk, bs, bs, r, B, Hq, q.device)
        visible = vis != VISIBLE_NONE
        keys, valid = logical_keys(kd, r.key_index)
        diag = diagonal_tiles(vis, r, Nq, Nk, bs, bs)
        cand = visible & ~diag if r.segment_size is not None else visible
        prob = masked_softmax(group_scores(block_mean(qd, bs), block_mean(keys, bs, valid)) * scale, cand)
        forced = diag | (first_key_tile(r, Nk, bs, B, Hq, q.device) if p.keep_first_block else False)
        total = prob.sum(-1, keepdim=True)
        sure, maybe = mass_bounds(prob, cand, p.threshold, 0.0, total)
    elif select == "sparge":
        p = config.params_of("sparge")
        bm, bn = p.block_size_q, p.block_size_kv
        vis = visibility(Nq, Nk, bm, bn, r, B, Hq, q.device)
        visible = vis != VISIBLE_NONE
        keys, valid = logical_keys(kd, r.key_index)
        sq = block_self_similarity(qd, bm)
        sk = block_self_similarity(keys, bn, valid)
        q_odd = sq < p.similarity_threshold
        k_odd = expand_heads(sk < p.similarity_threshold, Hq)
        cand = visible & ~k_odd[:, :, None, :]
        prob = masked_softmax(group_scores(block_mean(qd, bm), block_mean(keys, bn, valid)) * scale, cand)
        diag = diagonal_tiles(vis, r, Nq, Nk, bm, bn)
        forced = q_odd[..., None] | k_odd[:, :, None, :] | diag
        sure, maybe = mass_bounds(prob, cand, p.cdf_threshold, 0.0, prob.sum(-1, keepdim=True))
        # a judgement within EPS_SIM of theta may go either way: its row (query) or its head's rows (key tile,
        # which changes every row's softmax) keep only the diagonal surely
        amb_q = (sq - p.similarity_threshold).abs() < EPS_SIM
        amb_k = expand_heads((sk - p.similarity_threshold).abs() < EPS_SIM, Hq).any(-1)
        rows_amb = (amb_q | amb_k[..., None])[..., None]
        sure = torch.where(rows_amb, diag, sure | forced)
        maybe = torch.where(rows_amb, visible, maybe | forced)
        return sure & visible, maybe & visible
    elif select in ("sampled", "peak"):  # a fixed share per block: a tile's rank is known up to near-equal scores
        p = config.params_of(SampledParams if select == "sampled" else PeakParams)
        bs = p.block_size
        vis = visibility(Nq, Nk, bs, bs, r, B, Hq, q.device)
        visible = vis != VISIBLE_NONE
        if select == "sampled":
            mass = torch.where(visible, sampled_tile_logits(qd, kd, scale, bs, p.sample_every).exp(), -1.0)
            tol = EPS_P * mass.clamp_min(0) + 1e-12
        else:  # peaks are differences of logits: an absolute margin (FP8 products summed in another order: wider)
            fp8 = scores_in_fp8(p, q)
            mass = peak_tile_scores(qd, kd, scale, bs, p.sample_every, p.keep_first_block, fp8).double()
            mass = torch.where(visible, mass, mass.new_full((), float("-inf")))
            tol = (2e-3 if fp8 else EPS_ORDER * 10) * (mass.abs().nan_to_num(0.0, 0.0, 0.0) + 1)
        forced = diagonal_tiles(vis, r, Nq, Nk, bs, bs)
        if p.keep_first_block:
            forced = forced | first_key_tile(r, Nk, bs, B, Hq, q.device)
        if p.local_tiles:
            forced = forced | local_tiles(vis, Nq, Nk, bs, bs, p.local_tiles)
        forced = forced & visible
        allowed = torch.clamp(torch.ceil(p.budget * visible.sum(-1, keepdim=True) - 1e-9), min=1)
        others = (visible & ~forced)[..., None, :]
        above_sure = ((mass[..., None, :] > mass[..., :, None] + tol[..., :, None]) & others).sum(-1)
        above_maybe = ((mass[..., None, :] >= mass[..., :, None] - tol[..., :, None]) & others).sum(-1) - 1
        sure = visible & (above_maybe < allowed)
        maybe = visible & (above_sure < allowed)
    elif select == "bfla_coarse":
        p = config.params_of("bfla")
        b = p.coarse_block_size
        visible = visibility(Nq, Nk, b, b, r, B, Hq, q.device) != VISIBLE_NONE
        score = bfla_block_scores(qd, kd, b, p.group_size, r.key_index) * scale
        prob = masked_softmax(score, visible)
        forced = torch.zeros_like(visible)
        sure, maybe = mass_bounds(prob, visible, p.mass_threshold, 0.0, prob.sum(-1, keepdim=True))
    else:
        raise ValueError(select)
    return (sure | forced) & visible, (maybe | forced) & visible


def fast_bfla_coarse(q, k, scale, r, config):
    """The fast path's coarse BFLA mass (B, Hq, LQ, LK) bool (the internals of select_bfla_fast)."""
    p = config.params_of("bfla")
    b = p.coarse_block_size
    permuted = r.key_index is not None
    cpos = pooling.block_pool(k, b, key_index=r.key_index, want_mean=False, want_positions=True) if permuted else None
    score = bfla_kernels.bfla_block_scores(q, k, b, p.group_size, r.key_index, r.segment_size if permuted else 1)
    rule = MassRule(threshold=p.mass_threshold, scale=scale, segment=r.segment_size or 0)
    keep = mass_select(tile_grid(q, k, r, b, b), rule, score, key_tiles=cpos, keep_table=True)
    return keep != 0


def reference_bfla_coarse(q, k, scale, r, config):
    p = config.params_of("bfla")
    b = p.coarse_block_size
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    cvis = visibility(Nq, Nk, b, b, r, B, Hq, q.device) != VISIBLE_NONE
    score = bfla_block_scores(q, k, b, p.group_size, r.key_index) * scale
    return top_mass(masked_softmax(score, cvis), cvis, p.mass_threshold)


def assert_order_agrees(fast_idx, ref_idx, scores, segments, what=""):
    """Orders identical, or differing only by swaps of entries whose scores are within EPS_ORDER (relative).

    ``segments``: list of (start, stop) ranges of the index rows that are sorted by descending ``scores``
    (``scores`` gives the score of each *physical* index, per row; shape (..., n) broadcast against the rows).
    """
    if torch.equal(fast_idx, ref_idx):
        return 0
    fi, ri = fast_idx.long(), ref_idx.long()
    lead = fi.shape[:-1]
    sc = scores.expand(*lead, scores.shape[-1]) if scores.dim() == fi.dim() else scores
    differ = 0
    for a, z in segments:
        f, rr = fi[..., a:z], ri[..., a:z]
        if torch.equal(f, rr):
            continue
        assert torch.equal(f.sort(-1).values, rr.sort(-1).values), f"{what}: segment [{a}, {z}) holds other entries"
        sf = torch.gather(sc, -1, f.clamp_min(0))
        tol = EPS_ORDER * sc.abs().amax(-1, keepdim=True) + 1e-30
        assert bool((sf[..., 1:] <= sf[..., :-1] + tol).all()), f"{what}: segment [{a}, {z}) not descending"
        # same position, same score up to the margin: the only freedom is among near-equal scores
        sr = torch.gather(sc, -1, rr.clamp_min(0))
        assert bool(((sf - sr).abs() <= tol).all()), f"{what}: segment [{a}, {z}) ranks differ beyond ties"
        differ += int((f != rr).sum())
    return differ


# ---------------------------------------------------------------------------------------------------------------
# CPU (Triton interpreter)


def _pbs_segments(n, seg):
    return [(s * seg, (s + 1) * seg) for s in range(n // seg)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_pbs_reorder_and_select_agree(dtype):
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 16
    q, k = structured_qk(B, Hq, Hkv, N, N, D, 16, seed=1, dtype=dtype)
    cfg = _config("pbs", "pbs")
    scale = 1 / math.sqrt(D)
    r_ref = stage_functions("pbs", "pbs", False)[0](q, k, scale, cfg)
    r_fast = pbs.reorder_pbs_fast(q, k, scale, cfg)
    imp = pbs_key_importance(q.double(), k.double(), scale, cfg.params_of("pbs").block_size)
    assert r_fast.key_index.dtype == torch.int32 and r_fast.segment_size == r_ref.segment_size
    assert_order_agrees(r_fast.key_index, r_ref.key_index, imp, _pbs_segments(N, 32), "pbs key order")
    assert torch.equal(r_fast.key_index[..., (N // 32) * 32:], r_ref.key_index[..., (N // 32) * 32:])
    # stage-wise: the same reordering in, the same blocks out
    p_fast = pbs.select_pbs_fast(q, k, scale, r_ref, cfg)
    p_ref = stage_functions("pbs", "pbs", False)[1](q, k, scale, r_ref, cfg)
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
    r = stage_functions(reorder, "pbs", False)[0](q, k, scale, cfg)
    p_fast = sparge.select_sparge_fast(q, k, scale, r, cfg)
    p_ref = stage_functions(reorder, "sparge", False)[1](q, k, scale, r, cfg)
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
    r = stage_functions(reorder, "pbs", False)[0](q, k, scale, cfg)
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
    tables = bfla_kernels.bfla_tiles(tile_grid(q, k, r, 16, 16), coarse_ref.to(torch.int8), coarse=32,
                                     local_tiles=p.local_tiles, sink_tiles=p.sink_tiles, stride=p.stride,
                                     stride_seed=p.seed, random_rescue=p.random_rescue,
                                     random_seed=p.seed ^ bfla.RANDOM_SALT, key_tiles=tpos,
                                     segment=r.segment_size or 0)
    p_ref = stage_functions(reorder, "bfla", False)[1](q, k, scale, r, cfg)
    for name, t in zip(("tile_offsets", "tile_counts", "masked_counts"), tables):
        assert torch.equal(t, getattr(p_ref, name)), name
    # and the whole fast stage
    p_fast = bfla.select_bfla_fast(q, k, scale, r, cfg)
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
    r_ref = stage_functions("s2o", "s2o", False)[0](q, k, scale, cfg)
    r_fast = s2o.reorder_s2o_fast(q, k, scale, cfg)
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
    p_fast = s2o.select_s2o_fast(q, k, scale, r_ref, cfg)
    p_ref = stage_functions("s2o", "s2o", False)[1](q, k, scale, r_ref, cfg)
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
    r = stage_functions(*PRESETS[method], False)[0](q, k, scale, cfg)
    p_fast = stage_functions(*PRESETS[method], True)[1](q, k, scale, r, cfg)
    p_ref = stage_functions(*PRESETS[method], False)[1](q, k, scale, r, cfg)
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

    def spy(q, k, scale, r, config):
        calls.append("fast")
        return stage_functions("pbs", "pbs", False)[1](q, k, scale, r, config)

    import dataclasses

    from sparse_compile import registry

    pbs_spec = registry.method_spec("pbs")
    monkeypatch.setitem(registry._METHODS, "pbs", dataclasses.replace(pbs_spec, fast_select=spy))
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
    def custom(q, k, scale, r, config):
        raise NotImplementedError

    monkeypatch.setitem(registry._METHODS, "pbs", dataclasses.replace(pbs_spec, select=custom, fast_select=None))
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
        from sparse_compile.report import causal_tiles_per_block

        # each query block counts at most its causal tiles (a permuted diagonal segment is a full square)
        causal = causal_tiles_per_block(visited.shape[-1], 128, 128, plan.block_m, plan.block_n)
        kept = torch.minimum(visited.double(), causal.double())
        want = kept.sum(2).mean(0) / causal_tile_count(128, 128, plan.block_m, plan.block_n)
        assert max(abs(a - float(b)) for a, b in zip(dens, want)) < 1e-9
        assert all(0 < d <= 1 for d in dens)
        if method == "pbs":
            assert all(d <= float(p) + 1e-6 for d, p in zip(dens, plan_density(plan, 128, 128, 4)[0]))


# ---------------------------------------------------------------------------------------------------------------
# compiles for Hopper (the interpreter accepts code the compiler rejects)

_COMPILE_SELECTION_FOR_SM90 = r"""
import sys, triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from sparse_compile.kernels import pooling, mass, sorting, pbs, bfla, s2o, sampled, permute, peak, budget, fp8

def compile_kernel(fn, pointers, floats, const, warps=4):
    sig = {}
    for name in fn.arg_names:
        if name in const: sig[name] = "constexpr"
        elif name in pointers: sig[name] = "*" + pointers[name]
        elif name in floats: sig[name] = "fp32"
        else: sig[name] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    assert k.metadata.shared <= 232448, (fn.__name__, const, k.metadata.shared)  # an H100's 227 KiB

for nbp, chunk, hasidx, mean, sim, pos, guide, sort, finite in [(1, 64, False, True, True, False, False, False, False),
        (4, 64, True, True, True, True, False, False, False), (1, 128, False, True, False, False, True, True, True)]:
    compile_kernel(pooling._pool_kernel,
        dict(x_ptr="bf16", idx_ptr="i32", guide_ptr="fp32", mean_ptr="fp32", sim_ptr="fp32", kmin_ptr="i32",
             kmax_ptr="i32", kpad_ptr="i32", gdot_ptr="fp32", order_ptr="i32"), set(),
        dict(BLOCK=2048 if sort else 64, BLOCKS_PER_PROGRAM=nbp, CHUNK=chunk, D=128, D_PAD=128, HAS_INDEX=hasidx,
             WANT_MEAN=mean, WANT_SIM=sim, WANT_POS=pos, WANT_GUIDE=guide, SORT_GUIDE=sort, FINITE_ROWS_MEAN=finite,
             ROW_SLOTS=chunk if sort else 1))
compile_kernel(pooling._pooled_logits_kernel, dict(qm_ptr="fp32", km_ptr="fp32", out_ptr="fp32"), set(),
               dict(BLOCK_M=128, BLOCK_N=128, D=128, D_PAD=128, R=64, C=64, PREC="tf32x3"))
for judge, perm, keep_all, plan in [(False, True, False, True), (True, False, False, True), (False, False, False, False),
                                   (False, False, True, True)]:
    compile_kernel(mass._mass_select_kernel,
        dict(logit_ptr="fp32", kmin_ptr="i32", kmax_ptr="i32", kpad_ptr="i32", ksim_ptr="fp32", qsim_ptr="fp32",
             offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32", keep_ptr="i8"), {"scale", "tau", "theta"},
        dict(BLOCK_M=128, BLOCK_N=128, SEGMENT=256 if perm else 0, W=256, ROWS=4, HAS_POSITIONS=perm,
             DIAGONAL_IN_SOFTMAX=not perm, KEEP_DIAGONAL=True, KEEP_FIRST_KEY=True, JUDGE=judge, KEEP_ALL=keep_all,
             WRITE_PLAN=plan), warps=1)
compile_kernel(sorting._segmented_argsort_kernel, dict(x_ptr="fp32", out_ptr="i32"), set(),
               dict(SEGMENT=256, SEGMENT_PAD=256, SEGMENTS_PER_PROGRAM=8), warps=8)
compile_kernel(pbs._pbs_lse_kernel, dict(q_ptr="bf16", k_ptr="bf16", m_ptr="fp32", s_ptr="fp32"), {"qk_scale"},
               dict(CHUNK=4096, BLOCK_N=64, ROWS_PAD=128, D=128, D_PAD=128, PREC="none"), warps=8)
for sort in (True, False):
    compile_kernel(pbs._pbs_importance_kernel, dict(q_ptr="bf16", k_ptr="bf16", m_ptr="fp32", s_ptr="fp32",
                   imp_ptr="fp32", perm_ptr="i32"), {"qk_scale", "count"},
                   dict(BLOCK_N=256, ROWS_PAD=128, ROW_BLOCK=64, NUM_CHUNKS_PAD=16, D=128, D_PAD=128, PREC="none",
                        WRITE_IMPORTANCE=not sort, SORT=sort), warps=8)
for idx in (False, True):
    compile_kernel(bfla._bfla_scores_kernel, dict(q_ptr="bf16", k_ptr="bf16", idx_ptr="i32", out_ptr="fp32"), set(),
                   dict(COARSE=256, G=64, NG=4, QB=32, KB=32, R=128, C=128, D=128, D_PAD=128, HAS_INDEX=idx,
                        PREC="none"), warps=8)
for pos, keep_all in ((False, False), (True, False), (False, True)):
    compile_kernel(bfla._bfla_tiles_kernel, dict(mass_ptr="i8", kmin_ptr="i32", kmax_ptr="i32", kpad_ptr="i32",
                   offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32"), set(),
                   dict(TILE_Q=128, TILE_K=64, COARSE=256, W=512, ROWS=2, HAS_POSITIONS=pos, STRIDE_ON=True,
                        RANDOM_ON=True, KEEP_ALL=keep_all), warps=1)
for every, blocks, heads in ((8, 4, 4), (4, 4, 2), (16, 32, 1)):
    compile_kernel(sampled._sampled_mass_kernel, dict(q_ptr="bf16", k_ptr="bf16", out_ptr="fp32"), {"qk_scale", "tiny"},
                   dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks, HEADS=heads, D=128,
                        D_PAD=128, PREC="none"), warps=8)
for every, blocks, heads, first in ((8, 4, 4, True), (16, 32, 1, False), (4, 2, 4, True)):
    compile_kernel(peak._peak_kernel, dict(q_ptr="bf16", k_ptr="bf16", k_scale_ptr="fp32", out_ptr="fp32"), {"scale"},
                   dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks, HEADS=heads,
                        KEEP_FIRST=first, D=128, D_PAD=128, PREC="none", FP8=False), warps=8)
for every, blocks, heads, d in ((8, 2, 4, 128), (16, 16, 1, 64)):
    compile_kernel(peak._peak_kernel, dict(q_ptr="bf16", k_ptr="fp8e4nv", k_scale_ptr="fp32", out_ptr="fp32"),
                   {"scale"}, dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks, HEADS=heads,
                   KEEP_FIRST=True, D=d, D_PAD=d, PREC="none", FP8=True), warps=4)
compile_kernel(fp8._amax_kernel, dict(x_ptr="bf16", amax_ptr="fp32"), set(), dict(D=128, D_PAD=128, BLOCK=64))
compile_kernel(fp8._quantize_kernel, dict(x_ptr="bf16", amax_ptr="fp32", out_ptr="fp8e4nv", scale_ptr="fp32"), set(),
               dict(D=96, D_PAD=128, BLOCK=64, MAX=448.0))
for keep_all in (False, True):
    compile_kernel(budget._budget_select_kernel, dict(score_ptr="fp32", offs_ptr="i32", cnt_ptr="i32",
                   msk_ptr="i32"), {"budget"}, dict(BLOCK_M=128, BLOCK_N=128, W=1024, ROWS=1, KEEP_FIRST_KEY=True,
                   KEEP_ALL=keep_all), warps=1)
compile_kernel(s2o._s2o_rank_keys_kernel, dict(k_ptr="bf16", qm_ptr="fp32", out_ptr="i32"), set(),
               dict(BLOCK_T=64, G_PAD=64, D=128, D_PAD=128, PREC="tf32x3"))
compile_kernel(s2o._s2o_segment_of_kernel, dict(slot_ptr="i64", out_ptr="i16"), set(), dict(BLOCK=1024))
compile_kernel(s2o._s2o_assemble_kernel, dict(by_score_ptr="i64", by_segment_ptr="i64", out_ptr="i32"), set(),
               dict(BLOCK=256))
for qidx in (True, False):
    compile_kernel(s2o._s2o_select_kernel, dict(qidx_ptr="i32", offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32"),
                   set(), dict(BLOCK_M=128, BLOCK_N=128, W=1024, ROWS=4, HAS_QUERY_INDEX=qidx))
compile_kernel(permute._permute_rows_kernel, dict(K="bf16", V="bf16", KP="bf16", VP="bf16", KeyIndex="i32"),
               set(), dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK=64))
print("ALL OK")
"""


def test_selection_kernels_compile_for_hopper():
    """Every selection kernel, in its main variants, compiles for sm_90 on the CPU and fits shared memory."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE_SELECTION_FOR_SM90], capture_output=True, text=True,
                         env=env, timeout=600)
    if "NO_BACKEND" in run.stdout:
        pytest.skip("this Triton has no CUDA compiler backend")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 at 8K and 16K, the methods' paper defaults


GPU_SHAPES = [(1, 8, 2, 8192, 128), (2, 4, 2, 16384, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-N{s[3]}-D{s[4]}")
@pytest.mark.parametrize("method", list(PRESETS))
def test_gpu_bf16_agreement(method, shape):
    B, Hq, Hkv, N, D = shape
    dev = "cuda"
    reorder, select = PRESETS[method]
    block = {"pbs": 128, "sparge": 64, "bfla": 64, "s2o": 128, "sampled": 128, "peak": 128}[method]
    q, k = structured_qk(B, Hq, Hkv, N, N, D, block, seed=9, dtype=torch.bfloat16, device=dev)
    cfg = SparseConfig(method=method)
    scale = 1 / math.sqrt(D)
    r_ref = stage_functions(reorder, "pbs", False)[0](q, k, scale, cfg)
    r_fast = stage_functions(reorder, "pbs", True)[0](q, k, scale, cfg)
    if reorder == "pbs":
        imp = pbs_key_importance(q.double(), k.double(), scale, cfg.params_of("pbs").block_size)
        segments = _pbs_segments(N, cfg.params_of("pbs").segment_size)
        assert_order_agrees(r_fast.key_index, r_ref.key_index, imp, segments, "pbs")
    if reorder == "s2o":
        lay = r_ref.extras["layout"]
        S, g = cfg.params_of("s2o").segment_size, len(lay.seg_len)
        kg = k[:, :, :S].double().mean(2)
        sq = (q.double().view(B, Hkv, Hq // Hkv, N, D) * kg[:, :, None, None]).sum(-1).view(B, Hq, N)
        assert_order_agrees(r_fast.query_index, r_ref.query_index, sq, [(s * S, (s + 1) * S) for s in range(g)], "q")
        qm = block_mean(q.double(), S).view(B, Hkv, Hq // Hkv, g, D).mean(2)
        for n in range(1, g):
            z = lay.base[n] + lay.intra_pad[n]
            s_n = (qm[:, :, n, None, :] @ k.double().transpose(-1, -2)[..., : n * S])[..., 0, :]
            assert_order_agrees(r_fast.key_index[..., z: z + n * S], r_ref.key_index[..., z: z + n * S], s_n,
                                [(0, n * S)], f"s2o prefix {n}")
    p_ref = stage_functions(reorder, select, False)[1](q, k, scale, r_ref, cfg)
    p_fast = stage_functions(reorder, select, True)[1](q, k, scale, r_ref, cfg)
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    if method in ("pbs", "sparge", "sampled", "peak") and not plans_identical(p_fast, p_ref):
        sure, maybe = reference_bounds(select, q, k, scale, r_ref, cfg)
        assert_keep_agrees(keep_table(p_fast, sure.shape[-1]), sure, maybe, what=method, max_ambiguous_rows=0.25)
    if method == "bfla":
        alpha = block_softmax_scale(cfg.params_of("bfla"), scale)  # the block softmax's scale (Eq. 9)
        coarse_fast = fast_bfla_coarse(q, k, alpha, r_ref, cfg)
        coarse_ref = reference_bfla_coarse(q, k, alpha, r_ref, cfg)
        if torch.equal(coarse_fast, coarse_ref):
            assert plans_identical(p_fast, p_ref)
        else:
            sure, maybe = reference_bounds("bfla_coarse", q, k, alpha, r_ref, cfg)
            assert_keep_agrees(coarse_fast, sure, maybe, what="bfla coarse", max_ambiguous_rows=0.25)
    if method == "s2o":
        assert plans_identical(p_fast, p_ref)
    # and through build_plan (auto picks the fast path on CUDA): a plan the kernel runs, close to the reference
    p_auto = build_plan(q, k, None, cfg)
    d_auto = plan_density(p_auto, N, N, Hq)
    d_ref = plan_density(build_plan(q, k, None, cfg, implementation="reference"), N, N, Hq)
    assert float((d_auto - d_ref).abs().max()) < 0.01


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


# ---------------------------------------------------------------------------------------------------------------
# non-finite inputs stay confined, as in dense attention (reference planner and executor; fast planner with the
# Triton kernel, under the interpreter on the CPU)

NAN_N, NAN_D = 128, 16


def _nan_inputs():
    seed = int(torch.randint(2**31 - 1, ()))  # fresh per test (conftest seeds torch per test)
    q, k = structured_qk(2, 4, 2, NAN_N, NAN_N, NAN_D, 16, seed=seed)
    return q, k, torch.randn(2, 2, NAN_N, NAN_D)


def _plan_and_output(q, k, v, cfg, planner):
    plan = build_plan(q, k, None, cfg, implementation=planner)
    check_plan(plan, q, k)
    kernel = "triton" if planner == "fast" else "reference"
    return plan, execute_plan(q, k, v, plan, kernel=kernel)


def _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row):
    """(q with the NaN, plan, output) of a NaN in query row (batch, head, row): that row NaN, every other finite."""
    bad = q.clone()
    bad[batch, head, row] = float("nan")
    plan, out = _plan_and_output(bad, k, v, cfg, planner)
    assert bool(out[batch, head, row].isnan().all())
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[batch, head, row] = False
    assert bool(torch.isfinite(out[others]).all())
    return bad, plan, out


def _confinement(method, cfg, batch, head, row, heads_q, heads_kv):
    """bool (B, Hq, N): the output rows a NaN in query row (batch, head, row) may change (module docstrings)."""
    region = torch.zeros(2, heads_q, NAN_N, dtype=torch.bool)
    group = heads_q // heads_kv
    group_heads = slice(head // group * group, head // group * group + group)
    if method in ("pbs", "sampled", "peak"):  # its query block, in its head
        size = cfg.params_of("pbs").block_size if method == "pbs" else cfg.params_of(method).block_size
        region[batch, head, row // size * size: row // size * size + size] = True
    elif method == "sparge":
        size = cfg.params_of("sparge").block_size_q
        region[batch, head, row // size * size: row // size * size + size] = True
    elif method == "bfla":  # its coarse query block, in every head of its KV group (the tile mask is shared)
        size = cfg.params_of("bfla").coarse_block_size
        region[batch, group_heads, row // size * size: row // size * size + size] = True
    else:  # s2o: its segment, in every head of its KV group (query order and the group's key ranking)
        size = cfg.params_of("s2o").segment_size
        region[batch, group_heads, row // size * size: row // size * size + size] = True
    return region


@pytest.mark.parametrize("planner", ["reference", "fast"])
@pytest.mark.parametrize("method", list(PRESETS))
def test_nan_query_row_stays_confined(method, planner):
    """A NaN in one query row: that row is NaN, every other row finite, and rows outside the row's query block
    (as each method defines it) equal the NaN-free run. Before: the pooled mean of the block went NaN and its
    selection arbitrary (and a NaN in PBS's last block reordered the whole head)."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS[method])
    _, clean = _plan_and_output(q, k, v, cfg, planner)
    batch, head = int(torch.randint(2, ())), int(torch.randint(4, ()))
    last_block = NAN_N - cfg.params_of("pbs").block_size  # PBS's importance rows (tested below)
    row = int(torch.randint(last_block if method == "pbs" else NAN_N, ()))
    _, plan, out = _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row)
    outside = ~_confinement(method, cfg, batch, head, row, 4, 2)
    torch.testing.assert_close(out[outside], clean[outside], rtol=1e-5, atol=1e-6)
    # the selectors: a query block with non-finite pooled statistics keeps every visible tile (the sampled
    # selector: when the row is one it scores; an unsampled NaN row leaves the plan as it was)
    sampled = cfg.params_of(method if method in ("sampled", "peak") else "sampled")
    sampled_row = (row % sampled.block_size) % sampled.sample_every == sampled.sample_every - 1
    if method != "s2o" and (method not in ("sampled", "peak") or sampled_row):
        vis = block_visibility(NAN_N, NAN_N, plan.block_m, plan.block_n, key_index=plan.key_index, batch=2,
                               heads=plan.tile_counts.shape[1])
        visible = expand_heads((vis != VISIBLE_NONE).sum(-1, dtype=torch.int32), plan.tile_counts.shape[1])
        size = cfg.params_of("bfla").coarse_block_size if method == "bfla" else plan.block_m
        blocks = slice(row // size * size // plan.block_m, (row // size * size + size) // plan.block_m)
        plan_head = head if plan.tile_counts.shape[1] == 4 else head // 2
        assert torch.equal(plan.tile_counts[batch, plan_head, blocks], visible[batch, plan_head, blocks])


@pytest.mark.parametrize("planner", ["reference", "fast"])
def test_nan_query_row_in_pbs_last_block_keeps_other_rows_finite(planner):
    """PBS's key order comes from its last query block: a NaN row there is left out of the importance (one row
    fewer, documented), so the order may change, but it is not scrambled and no other row goes non-finite."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS["pbs"])
    batch, head = int(torch.randint(2, ())), int(torch.randint(4, ()))
    row = NAN_N - 1 - int(torch.randint(cfg.params_of("pbs").block_size, ()))
    bad, plan, out = _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row)
    # the importance ignores the row: the same order as from the other rows' scores alone
    importance = pbs_key_importance(bad.double(), k.double(), 1 / math.sqrt(NAN_D), cfg.params_of("pbs").block_size)
    assert bool(torch.isfinite(importance).all())
    assert_order_agrees(plan.key_index, segmented_argsort_desc(importance, 32, NAN_N // 32).int(), importance,
                        _pbs_segments(NAN_N, 32), "pbs key order with a NaN row")


@pytest.mark.parametrize("planner", ["reference", "fast"])
@pytest.mark.parametrize("method", list(PRESETS))
def test_nan_key_reaches_every_row_that_sees_it(method, planner):
    """A NaN key: every row that sees it in dense attention is NaN (its tile is kept by every block that sees it,
    and S2O ranks it first, before any early stop); every other row stays finite."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS[method])
    batch, kv_head, j = int(torch.randint(2, ())), int(torch.randint(2, ())), int(torch.randint(NAN_N, ()))
    bad = k.clone()
    bad[batch, kv_head, j] = float("nan")
    _, out = _plan_and_output(q, bad, v, cfg, planner)
    sees = torch.zeros(out.shape[:3], dtype=torch.bool)
    sees[batch, 2 * kv_head: 2 * kv_head + 2, j:] = True
    assert bool(out[sees].isnan().all())
    assert bool(torch.isfinite(out[~sees]).all())
