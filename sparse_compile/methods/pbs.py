"""PBS-Attn (Wang et al. 2025): segmented query-aware key permutation + MeanPooling block selection.

Reorder stage ``pbs`` (Sec. 3.2-3.3): keys sorted by the importance the last query block gives them, inside
segments of S keys. Select stage ``pbs``: MeanPooling block selection (Appendix B.1, Algorithm 2).

Per query head h, query block i (block size B both ways, logical order):

1. Q_bar_i = mean of the block's query rows, K_bar_j = mean of logical key tile j (ragged blocks: mean over the
   rows they have).
2. Candidates: tiles visible to the block (causal, from original positions). With a PBS key permutation the
   query block's own (on-diagonal) segment is masked out of the pooled softmax, as App. B.1 says ("this mask also
   includes the on-diagonal segments") and the authors' code does: it is always computed. Without a
   permutation (the MeanPooling baseline) C is only the causal mask, so the diagonal tiles stay candidates.
3. a = softmax over candidates of Q_bar_i . K_bar_j * scale (scale = the attention's, 1/sqrt(d) by default).
4. Keep the fewest top-a candidates whose mass reaches tau (Alg. 2 lines 11-15; see ``top_mass``). tau >= 1 keeps
   every visible tile.
5. Always keep the on-diagonal tiles (segment, or the partially visible "most recent" tiles without a
   permutation, as the paper's baseline does) and, if ``keep_first_block``, the tile holding original key 0.

GQA: selection per query head (pooled queries are per head; pooled keys per KV head are shared, not repeated),
as in the paper, which selects per head; the kernel runs one program per query head anyway.
With reorder ``none`` this is the paper's MeanPooling baseline (first and most recent key blocks forced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodParams, check_block, check_fraction, check_int, fail
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from ._blocks import diagonal_tiles, finish_plan, first_key_tile, visibility
from ._common import (
    Reordering,
    block_mean,
    cdiv,
    chunk_count,
    compute_dtype,
    group_scores,
    logical_keys,
    masked_softmax,
    segmented_argsort_desc,
    top_mass,
)
from ._fast import check_selectable, plan_from_tables, seg_bound, selection_kernels

__all__ = ["PBSParams", "pbs_key_importance", "reorder_pbs", "select_pbs", "reorder_pbs_fast", "select_pbs_fast"]


@dataclass(frozen=True)
class PBSParams(MethodParams):
    """PBS-Attn (Wang et al. 2025): segmented query-aware key permutation + mean-pooling block selection.

    Defaults from the paper (Sec. 4.1): B=128, S=256, threshold 0.9. ``threshold=1.0`` keeps every causal block.
    """

    block_size: int = 128
    segment_size: int = 256
    threshold: float = 0.9
    keep_first_block: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block("PBSParams", "block_size", self.block_size)
        check_int("PBSParams", "segment_size", self.segment_size, low=1)
        if self.segment_size % self.block_size:
            fail("PBSParams", "segment_size", f"must be a multiple of block_size={self.block_size}")
        check_fraction("PBSParams", "threshold", self.threshold)


def pbs_key_importance(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """PBS Eq. (10): s = mean over the last query block's rows of softmax(Q_last K^T * scale), per KV head.

    ``rows`` = the last ``min(rows, Nq)`` query rows (a full block, even when Nq is not a multiple of the block).
    The softmax is causal (a row gives no mass to keys after its own position; with Nq == Nk only keys inside
    the last, always-kept segment are affected). GQA: the mean also runs over the group's query heads, so one
    key order serves the whole group and K/V are permuted once per KV head.
    Never forms the (rows x Nk) matrix whole: two passes over key chunks (log-sum-exp, then the mean).
    Returns (B, Hkv, Nk) in the compute dtype.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    m = Hq // Hkv
    r = min(rows, Nq)
    cdt = compute_dtype(q)
    ql = q[:, :, Nq - r:].to(cdt)  # (B, Hq, r, D)
    qpos = torch.arange(Nq - r, Nq, device=q.device) + (Nk - Nq)  # absolute positions of those rows
    step = chunk_count(B * Hq * r)
    neg = torch.finfo(cdt).min

    def logits(c0: int, c1: int) -> torch.Tensor:
        z = group_scores(ql, k[:, :, c0:c1].to(cdt)) * scale  # (B, Hq, r, c)
        vis = torch.arange(c0, c1, device=q.device)[None, :] <= qpos[:, None]
        return torch.where(vis, z, torch.full((), neg, dtype=cdt, device=q.device)), vis

    # pass 1: running max and sum of exp per row
    mx = torch.full((B, Hq, r), neg, dtype=cdt, device=q.device)
    se = torch.zeros((B, Hq, r), dtype=cdt, device=q.device)
    for c0 in range(0, Nk, step):
        z, vis = logits(c0, min(c0 + step, Nk))
        new = torch.maximum(mx, z.amax(-1))
        se = se * torch.exp(mx - new) + (torch.exp(z - new[..., None]) * vis).sum(-1)
        mx = new
    lse = mx + torch.log(se)
    # pass 2: probabilities, averaged over the rows of every query head of the group
    out = torch.empty((B, Hkv, Nk), dtype=cdt, device=q.device)
    for c0 in range(0, Nk, step):
        c1 = min(c0 + step, Nk)
        z, vis = logits(c0, c1)
        p = torch.exp(z - lse[..., None]) * vis
        out[:, :, c0:c1] = p.view(B, Hkv, m * r, c1 - c0).mean(2)
    return out


def reorder_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """Query-aware key permutation (PBS Sec. 3.3): keys sorted by descending importance inside segments of S.

    Segments are the first floor(Nk/S) * S keys (paper Sec. 3.2); the trailing Nk mod S keys keep their order.
    Ties keep the original order (stable sort). Queries are not permuted (the paper's main method; the card: with
    GQA, permuting queries would cost per query head). Works for chunked prefill (Nq < Nk): segments are over
    the absolute key positions.
    """
    p = config.params_of("pbs")
    Nk = k.shape[2]
    s = pbs_key_importance(q, k, scale, p.block_size)
    perm = segmented_argsort_desc(s, p.segment_size, Nk // p.segment_size)
    return Reordering("pbs", key_index=perm.to(torch.int32).contiguous(), segment_size=p.segment_size)


def select_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.params_of("pbs")
    bs = p.block_size
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    vis = visibility(Nq, Nk, bs, bs, r, B, Hq, q.device)
    visible = vis != VISIBLE_NONE
    if p.threshold >= 1.0:
        return finish_plan(visible, vis, bs, bs, r)
    cdt = compute_dtype(q)
    keys, valid = logical_keys(k, r.key_index)
    qbar = block_mean(q, bs, dtype=cdt)
    kbar = block_mean(keys, bs, valid, dtype=cdt)
    diag = diagonal_tiles(vis, r, Nq, Nk, bs, bs)
    cand = visible & ~diag if r.segment_size is not None else visible
    prob = masked_softmax(group_scores(qbar, kbar) * scale, cand)
    keep = top_mass(prob, cand, p.threshold) | diag
    if p.keep_first_block:
        keep = keep | first_key_tile(r, Nk, bs, B, Hq, q.device)
    return finish_plan(keep, vis, bs, bs, r)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def reorder_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """= ``reorder.reorder_pbs``: importance of the last query block, keys sorted inside segments."""
    p = config.params_of("pbs")
    perm = selection_kernels().pbs_key_permutation(q, k, scale, p.block_size, p.segment_size)
    return Reordering("pbs", key_index=perm, segment_size=p.segment_size)


def select_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``pbs.select_pbs`` (MeanPooling block selection)."""
    check_selectable(r)
    sel = selection_kernels()
    p = config.params_of("pbs")
    bs = p.block_size
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = r.key_index.shape[-1] if r.key_index is not None else Nk
    nqb, nkt = cdiv(Nq, bs), cdiv(L, bs)
    keep_all = p.threshold >= 1.0
    kpool = None
    if r.key_index is not None or not keep_all:
        kpool = sel.block_pool(k, bs, key_index=r.key_index, want_mean=not keep_all,
                               want_pos=r.key_index is not None)
    logits = None
    if not keep_all:
        qbar = sel.block_pool(q, bs)["mean"]
        logits = sel.pooled_logits(qbar, kpool["mean"], block_m=bs, block_n=bs, num_queries=Nq, num_keys=Nk,
                                   seg_bound=seg_bound(r))
    seg = r.segment_size or 0
    tables = sel.mass_select(
        logits, batch=B, heads=Hq, kv_heads=Hkv, num_query_blocks=nqb, num_key_tiles=nkt, num_queries=Nq,
        num_keys=Nk, block_m=bs, block_n=bs, scale=scale, tau=p.threshold, segment=seg,
        tile_pos=kpool if r.key_index is not None else None, exclude_diag=seg > 0, force_diag=True,
        force_first=p.keep_first_block, keep_all=keep_all, device=q.device,
    )
    return plan_from_tables(bs, bs, tables, r)


register_method(Method(
    name="pbs", params=PBSParams, reorder=reorder_pbs, select=select_pbs, fast_reorder=reorder_pbs_fast,
    fast_select=select_pbs_fast, select_after=("none",), density=DensityKnob("threshold"),
    keep_all={"threshold": 1.0}, description="PBS-Attn: query-aware key permutation + mean-pooled block mass",
))
