"""The selection tests' small configurations, structured inputs and the comparison helpers of the agreement rule
(``test_selection_fast.py`` says the rule): float64 bounds with margins on masses and scores, exact comparisons of
everything else."""

from __future__ import annotations

import math

import torch

from sparse_compile import SparseConfig
from sparse_compile.extend import SampledParams
from sparse_compile.kernels import bfla as bfla_kernels
from sparse_compile.kernels import pooling
from sparse_compile.kernels.mass import MassRule, mass_select
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.methods.fast_path import tile_grid
from sparse_compile.methods.tiles import diagonal_tiles, first_key_tile, local_tiles, visibility
from sparse_compile.methods.scoring import (
    block_mean,
    block_self_similarity,
    group_scores,
    logical_keys,
    masked_softmax,
    top_mass,
)
from sparse_compile.methods.bfla import bfla_block_scores
from sparse_compile.methods.peak import PeakParams, peak_tile_scores, scores_in_fp8
from sparse_compile.methods.sampled import sampled_tile_logits
from sparse_compile.plan import VISIBLE_NONE

from method_helpers import SMALL as METHOD_SMALL

EPS_P = 2e-4  # relative margin on a block probability when ordering blocks
EPS_M = 5e-5  # absolute margin on a cumulative mass against tau * total
EPS_ORDER = 1e-5  # relative margin on a score when ordering keys or queries
EPS_SIM = 1e-4  # margin on SpargeAttn's self-similarity against theta

# the method tests' small blocks, for the methods these tests compare (PRESETS)
SMALL = {name: params for name, params in METHOD_SMALL.items() if name != "antidiag"}
PRESETS = {"pbs": ("pbs", "pbs"), "sparge": ("none", "sparge"), "bfla": ("none", "bfla"), "s2o": ("s2o", "s2o"),
           "sampled": ("none", "sampled"), "peak": ("none", "peak")}


def _config(reorder, select, params=SMALL, **kw):
    return SparseConfig(method="pbs", reorder=reorder, select=select, **params, **kw)


def stage_params(config, stage: str):
    """What a reorder stage receives: its method's parameters (None for ``"none"``, which keeps keys in order)."""
    return None if stage == "none" else config.params_of(stage)


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


def reference_bounds(select, q, k, scale, r, config, plans=()):
    """Float64 masses of the reference selector for (sure, maybe) keep bounds at its block level.

    ``plans`` (sampled with a mass target): the plans compared. A mass target's tile count per block moves
    with rounding near the target, so the counts come from the plans (the fewer for sure, the more for maybe) and
    the bounds check that each plan keeps its block's best tiles, not how many.
    Returns (sure, maybe) bool (B, H, nqb, nkt) including the forced tiles, restricted to visible tiles.
    """
    qd, kd = q.double(), k.double()
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
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
        fp8 = scores_in_fp8(p, q.device)
        if select == "sampled":  # FP8 products summed in another order: an absolute margin too
            mass = torch.where(visible, sampled_tile_logits(qd, kd, scale, bs, p.sample_every, fp8, p.local_tiles,
                                                           p.keep_first_block).exp(), -1.0)
            tol = (3e-3 if fp8 else EPS_P) * mass.clamp_min(0) + 1e-12
        else:  # peaks are differences of logits: an absolute margin (FP8 products summed in another order: wider)
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
        allowed_sure = allowed_maybe = allowed
        if plans and getattr(p, "mass_target", 0.0) > 0:  # (peak keeps a fixed share)
            counts = [(keep_table(plan, visible.shape[-1]) & visible & ~forced).sum(-1, keepdim=True)
                      for plan in plans]
            allowed_sure = torch.minimum(*counts)
            allowed_maybe = torch.maximum(*counts)
        others = (visible & ~forced)[..., None, :]
        above_sure = ((mass[..., None, :] > mass[..., :, None] + tol[..., :, None]) & others).sum(-1)
        above_maybe = ((mass[..., None, :] >= mass[..., :, None] - tol[..., :, None]) & others).sum(-1) - 1
        sure = visible & (above_maybe < allowed_sure)
        maybe = visible & (above_sure < allowed_maybe)
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
    keep = mass_select(tile_grid(q.shape, k.shape, q.device, r, b, b), rule, score, key_tiles=cpos, keep_table=True)
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


def _pbs_segments(n, seg):
    return [(s * seg, (s + 1) * seg) for s in range(n // seg)]
