"""SpargeAttn (Zhang et al. 2025), select stage ``sparge``: selective token compression + TopCdf (Zhang et al. 2025,
Sec. 3.2-3.4).

Query blocks of ``block_size_q`` rows, key tiles of ``block_size_kv`` logical keys:

1. q_i = mean of query block i, k_j = mean of key tile j; s_qi, s_kj = the block's mean token cosine
   similarity (``block_self_similarity``: the mean of the block's normalised Gram matrix).
2. S_hat = q k^T * scale (scale = the attention's, 1/sqrt(d) by default); S_hat[:, j] = -inf for
   non-self-similar key tiles (s_kj < theta) and for causally invisible tiles (block-causal, original positions).
3. P_hat[i] = softmax(S_hat[i]); M[i] = TopCdf(P_hat[i], tau): the fewest top blocks whose cumulative mass reaches
   tau (the crossing block is kept; the paper's snippet drops it). tau >= 1 keeps every visible tile, explicitly.
4. M[i, :] = 1 if s_qi < theta; M[:, j] = 1 if s_kj < theta (non-self-similar blocks are never skipped).
5. Added for causal prefill: the diagonal tiles (or the on-diagonal segment under a PBS permutation) are always
   kept, so no query row sees no key; with ``keep_first_block`` (default) also the tile holding key 0, the
   attention sink, which mean pooling dilutes so that TopCdf dropped it on a pretrained model.
6. The P.V skip lambda (``pv_threshold``) goes to the plan as ``pv_skip``: per row (plan.py's rule), the MMA kept;
   the paper decides per warp's slice of rows and skips that warp's MMA.

GQA: per query head, as the paper selects per head (the pooled keys are shared through ``group_scores``).

Non-finite inputs (not in the paper; kept confined as in dense attention): a query block or key tile whose pooled
mean is not finite gives non-finite scores, and such a tile is kept and leaves the softmax (``mass_keep``); the
kernel's online softmax carries a NaN into those rows' outputs (a non-finite row never decides a P.V skip). No
selector reads V. The departures' reasons and measurements: docs/methods.md ("`sparge` step by step", "SpargeAttn").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..params import MethodParams, block_field, finite_field, fraction_field, optional_field
from ..kernels.validate import expand_heads
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from .tiles import diagonal_tiles, finish_plan, first_key_tile, visibility
from .scoring import Reordering, block_mean, block_self_similarity, compute_dtype, group_scores, logical_keys, mass_keep
from .fast_path import check_selectable, plan_from_tables, segment_bound, tile_grid

__all__ = ["SpargeParams", "select_sparge", "select_sparge_fast"]


@dataclass(frozen=True)
class SpargeParams(MethodParams):
    """SpargeAttn (Zhang et al. 2025): mean-pool + self-similarity judge + TopCdf, and the P·V skip.

    The paper tunes (τ, θ, λ) per layer; these defaults are a fixed, conservative point (τ = 0.99: at 0.98
    SmolLM2-135M lost +0.058 nats per token on prose at 8K; docs/methods.md).
    ``keep_first_block`` keeps the tile holding key 0 (the attention sink; not in the paper).
    ``cdf_threshold=1.0, pv_threshold=None`` keeps every causal block and never skips P·V.
    ``pv_threshold`` is λ < 0 in natural-log units: a row drops a tile's P·V share when its tile maximum is
    below its running maximum by more than |λ|.
    """

    block_size_q: int = 128
    block_size_kv: int = 64
    cdf_threshold: float = 0.99
    similarity_threshold: float = 0.6
    pv_threshold: float | None = -20.0
    keep_first_block: bool = True

    field_checks: ClassVar[dict] = {"block_size_q": block_field(), "block_size_kv": block_field(),
                                    "cdf_threshold": fraction_field(), "similarity_threshold": fraction_field(low=-1.0),
                                    "pv_threshold": optional_field(finite_field(sign=-1))}


def select_sparge(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    bm, bn = params.block_size_q, params.block_size_kv
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    vis = visibility(num_queries, num_keys, bm, bn, reordering, batch, heads_q, q.device)
    visible = vis != VISIBLE_NONE
    if params.cdf_threshold >= 1.0:
        return finish_plan(visible, vis, bm, bn, reordering, pv_skip=params.pv_threshold)
    cdt = compute_dtype(q.dtype)
    keys, valid = logical_keys(k, reordering.key_index)
    theta = params.similarity_threshold
    query_odd = block_self_similarity(q, bm, dtype=cdt) < theta  # (B, Hq, nqb)
    key_odd = expand_heads(block_self_similarity(keys, bn, valid, dtype=cdt) < theta, heads_q)  # (B, Hq, nkt)
    candidates = visible & ~key_odd[:, :, None, :]
    pooled = group_scores(block_mean(q, bm, dtype=cdt), block_mean(keys, bn, valid, dtype=cdt))
    keep = mass_keep(pooled * scale, candidates, params.cdf_threshold)
    keep = keep | query_odd[..., None] | key_odd[:, :, None, :] | diagonal_tiles(vis, reordering, num_queries,
                                                                                 num_keys, bm, bn)
    if params.keep_first_block:
        keep = keep | first_key_tile(reordering, num_keys, bn, batch, heads_q, q.device)
    return finish_plan(keep, vis, bm, bn, reordering, pv_skip=params.pv_threshold)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def select_sparge_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    """= ``select_sparge`` (self-similarity judge + TopCdf; P.V skip to the plan)."""
    from ..kernels.mass import MassRule, mass_select
    from ..kernels.pooling import block_pool, pooled_logits

    check_selectable(reordering)
    bm, bn = params.block_size_q, params.block_size_kv
    grid = tile_grid(q.shape, k.shape, q.device, reordering, bm, bn)
    rule = MassRule(threshold=params.cdf_threshold, scale=scale, segment=reordering.segment_size or 0,
                    keep_diagonal=True, keep_first_key=params.keep_first_block,
                    similarity_threshold=params.similarity_threshold)
    permuted = reordering.key_index is not None
    key_tiles = logits = query_tiles = None
    if permuted or not rule.keeps_all:
        key_tiles = block_pool(k, bn, key_index=reordering.key_index, want_mean=not rule.keeps_all,
                               want_similarity=not rule.keeps_all, want_positions=permuted)
    if not rule.keeps_all:
        query_tiles = block_pool(q, bm, want_similarity=True)
        logits = pooled_logits(query_tiles.mean, key_tiles.mean, block_m=bm, block_n=bn,
                               num_queries=grid.num_queries, num_keys=grid.num_keys,
                               segment_bound=segment_bound(reordering))
    tables = mass_select(grid, rule, logits, key_tiles=key_tiles,
                         query_similarity=query_tiles.similarity if query_tiles is not None else None)
    return plan_from_tables(bm, bn, tables, reordering, pv_skip=params.pv_threshold)


register_method(Method(
    name="sparge", params=SpargeParams, select=select_sparge, fast_select=select_sparge_fast,
    select_after=("none", "pbs"), density=DensityKnob("cdf_threshold"),
    keep_all={"cdf_threshold": 1.0, "pv_threshold": None},
    description="SpargeAttn: self-similarity judge + TopCdf selection, P.V skip in the kernel",
))
