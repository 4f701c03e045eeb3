"""PBS-Attn (Wang et al. 2025): segmented query-aware key permutation + MeanPooling block selection.

Reorder stage ``pbs`` (Sec. 3.2-3.3): keys sorted by the importance the last query block gives them, inside
segments of S keys. Select stage ``pbs``: MeanPooling block selection (Appendix B.1, Algorithm 2).

Per query head h, query block i (block size B both ways, logical order):

1. Q_bar_i = mean of the block's query rows, K_bar_j = mean of logical key tile j (ragged blocks: mean over the
   rows they have).
2. Candidates: tiles visible to the block (causal, from original positions). With a PBS key permutation the query
   block's own (on-diagonal) segment is masked out of the pooled softmax (App. B.1): it is always computed. Without
   a permutation (the MeanPooling baseline) only the causal mask applies: the diagonal tiles stay candidates.
3. a = softmax over candidates of Q_bar_i . K_bar_j * scale (scale = the attention's, 1/sqrt(d) by default).
4. Keep the fewest top-a candidates whose mass reaches tau (Alg. 2 lines 11-15; ``top_mass``); tau >= 1 keeps
   every visible tile.
5. Always keep the on-diagonal tiles (segment, or the partially visible "most recent" tiles without a permutation,
   as the paper's baseline does) and, if ``keep_first_block``, the tile holding original key 0.

GQA: selection per query head, as in the paper (pooled keys per KV head are shared, not repeated). With reorder
``none`` this is the paper's MeanPooling baseline (first and most recent key blocks forced).

Non-finite inputs (not in the paper; kept confined as in dense attention): a non-finite pooled mean keeps its tile
and leaves the softmax (``mass_keep``); the importance ignores non-finite scores. A NaN query row in the last query
block can change its KV head's key order, hence every block of the group's selection (rows stay finite). The full
text and the measurements: docs/methods.md ("`pbs` step by step", "PBS-Attn").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..params import MethodParams, block_field, fail, fraction_field, span_field
from ..kernels.reference import segmented_argsort_desc
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from .tiles import diagonal_tiles, finish_plan, first_key_tile, visibility
from .scoring import Reordering, block_mean, chunk_count, compute_dtype, group_scores, logical_keys, mass_keep
from .fast_path import check_selectable, plan_from_tables, segment_bound, tile_grid

__all__ = ["PBSParams", "pbs_key_importance", "reorder_pbs", "select_pbs", "reorder_pbs_fast", "select_pbs_fast"]


@dataclass(frozen=True)
class PBSParams(MethodParams):
    """PBS-Attn (Wang et al. 2025): segmented query-aware key permutation + mean-pooling block selection.

    Defaults from the paper (Sec. 4.1), B=128 and S=256, except the threshold: 0.97, not 0.9. At 0.9 a pretrained
    model (SmolLM2-135M) lost +0.069 nats per token at 16K and +0.054 at 8K; at 0.97, +0.038 and +0.019 (density
    0.42 and 0.48 instead of 0.28 and 0.34; docs/methods.md). ``threshold=1.0`` keeps every causal block.
    """

    block_size: int = 128
    segment_size: int = 256
    threshold: float = 0.97
    keep_first_block: bool = True

    field_checks: ClassVar[dict] = {
        # params.MAX_SPAN, as every segment: keys move only inside whole segments, so one longer than the prompt
        # permutes nothing (reorder="none" says so)
        "block_size": block_field(),
        "segment_size": span_field("keys are sorted inside whole segments only: one past the prompt sorts none"),
        "threshold": fraction_field()}

    def check_fields(self) -> None:
        if self.segment_size % self.block_size:
            fail("PBSParams", "segment_size", f"must be a multiple of block_size={self.block_size}")


def pbs_key_importance(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """PBS Eq. (10): s = mean over the last query block's rows of softmax(Q_last K^T * scale), per KV head.

    ``rows`` = the last ``min(rows, Nq)`` query rows (a full block, even when Nq is not a multiple of the block).
    The softmax is causal (a row gives no mass to keys after its own position; with Nq == Nk only keys inside
    the last, always-kept segment are affected). GQA: the mean also runs over the group's query heads, so one
    key order serves the whole group and K/V are permuted once per KV head. A non-finite score leaves its row's
    softmax like a future key (a non-finite row gives every key 0), so importances are always finite.
    Never forms the (rows x Nk) matrix whole: two passes over key chunks (log-sum-exp, then the mean).
    Returns (B, Hkv, Nk) in the compute dtype.
    """
    batch, heads_q, num_queries, _ = q.shape
    heads_kv, num_keys = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    rows = min(rows, num_queries)
    cdt = compute_dtype(q.dtype)
    q_last = q[:, :, num_queries - rows:].to(cdt)  # (B, Hq, rows, D)
    positions = torch.arange(num_queries - rows, num_queries, device=q.device) + (num_keys - num_queries)
    step = chunk_count(batch * heads_q * rows)
    neg = torch.finfo(cdt).min

    def logits(c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        z = group_scores(q_last, k[:, :, c0:c1].to(cdt)) * scale  # (B, Hq, rows, c)
        counted = (torch.arange(c0, c1, device=q.device)[None, :] <= positions[:, None]) & torch.isfinite(z)
        return torch.where(counted, z, torch.full((), neg, dtype=cdt, device=q.device)), counted

    # pass 1: running max and sum of exp per row
    mx = torch.full((batch, heads_q, rows), neg, dtype=cdt, device=q.device)
    se = torch.zeros((batch, heads_q, rows), dtype=cdt, device=q.device)
    for c0 in range(0, num_keys, step):
        z, counted = logits(c0, min(c0 + step, num_keys))
        new = torch.maximum(mx, z.amax(-1))
        se = se * torch.exp(mx - new) + (torch.exp(z - new[..., None]) * counted).sum(-1)
        mx = new
    lse = mx + torch.log(se)  # -inf for a row with no finite score: its probabilities below are all masked
    # pass 2: probabilities, averaged over the rows of every query head of the group
    out = torch.empty((batch, heads_kv, num_keys), dtype=cdt, device=q.device)
    for c0 in range(0, num_keys, step):
        c1 = min(c0 + step, num_keys)
        z, counted = logits(c0, c1)
        prob = torch.where(counted, torch.exp(z - lse[..., None]), torch.zeros((), dtype=cdt, device=q.device))
        out[:, :, c0:c1] = prob.view(batch, heads_kv, group * rows, c1 - c0).mean(2)
    return out


def reorder_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, params) -> Reordering:
    """Query-aware key permutation (PBS Sec. 3.3): keys sorted by descending importance inside segments of S.

    Segments are the first floor(Nk/S) * S keys (paper Sec. 3.2); the trailing Nk mod S keys keep their order.
    Ties keep the original order (stable sort). Queries are not permuted (the paper's main method; the card: with
    GQA, permuting queries would cost per query head). Works for chunked prefill (Nq < Nk): segments are over
    the absolute key positions.
    """
    num_keys = k.shape[2]
    importance = pbs_key_importance(q, k, scale, params.block_size)
    perm = segmented_argsort_desc(importance, params.segment_size, num_keys // params.segment_size)
    return Reordering("pbs", key_index=perm.to(torch.int32).contiguous(), segment_size=params.segment_size)


def select_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    bs = params.block_size
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    vis = visibility(num_queries, num_keys, bs, bs, reordering, batch, heads_q, q.device)
    visible = vis != VISIBLE_NONE
    if params.threshold >= 1.0:
        return finish_plan(visible, vis, bs, bs, reordering)
    cdt = compute_dtype(q.dtype)
    keys, valid = logical_keys(k, reordering.key_index)
    query_mean = block_mean(q, bs, dtype=cdt)
    key_mean = block_mean(keys, bs, valid, dtype=cdt)
    diag = diagonal_tiles(vis, reordering, num_queries, num_keys, bs, bs)
    candidates = visible & ~diag if reordering.segment_size is not None else visible
    keep = mass_keep(group_scores(query_mean, key_mean) * scale, candidates, params.threshold) | diag
    if params.keep_first_block:
        keep = keep | first_key_tile(reordering, num_keys, bs, batch, heads_q, q.device)
    return finish_plan(keep, vis, bs, bs, reordering)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def reorder_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, params) -> Reordering:
    """= ``reorder_pbs``: importance of the last query block, keys sorted inside segments."""
    from ..kernels.pbs import pbs_key_permutation

    perm = pbs_key_permutation(q, k, scale, params.block_size, params.segment_size)
    return Reordering("pbs", key_index=perm, segment_size=params.segment_size)


def select_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    """= ``select_pbs`` (MeanPooling block selection)."""
    from ..kernels.mass import MassRule, mass_select
    from ..kernels.pooling import block_pool, pooled_logits

    check_selectable(reordering)
    bs = params.block_size
    grid = tile_grid(q.shape, k.shape, q.device, reordering, bs, bs)
    segment = reordering.segment_size or 0
    rule = MassRule(threshold=params.threshold, scale=scale, segment=segment, keep_diagonal=True,
                    diagonal_in_softmax=segment == 0, keep_first_key=params.keep_first_block)
    permuted = reordering.key_index is not None
    key_tiles = logits = None
    if permuted or not rule.keeps_all:
        key_tiles = block_pool(k, bs, key_index=reordering.key_index, want_mean=not rule.keeps_all,
                               want_positions=permuted)
    if not rule.keeps_all:
        logits = pooled_logits(block_pool(q, bs).mean, key_tiles.mean, block_m=bs, block_n=bs,
                               num_queries=grid.num_queries, num_keys=grid.num_keys,
                               segment_bound=segment_bound(reordering))
    tables = mass_select(grid, rule, logits, key_tiles=key_tiles)
    return plan_from_tables(bs, bs, tables, reordering)


register_method(Method(
    name="pbs", params=PBSParams, reorder=reorder_pbs, select=select_pbs, fast_reorder=reorder_pbs_fast,
    fast_select=select_pbs_fast, select_after=("none",), density=DensityKnob("threshold"),
    keep_all={"threshold": 1.0}, description="PBS-Attn: query-aware key permutation + mean-pooled block mass",
))
