"""Select stage ``sparge``: SpargeAttn selective token compression + TopCdf (Zhang et al. 2025, Sec. 3.2-3.4).

Query blocks of ``block_size_q`` rows, key tiles of ``block_size_kv`` logical keys:

1. q_i = mean of query block i, k_j = mean of key tile j; s_qi, s_kj = the block's mean token cosine
   similarity (``block_self_similarity``; the reference code's mean of the normalised Gram matrix).
2. S_hat = q k^T * scale (scale = the attention's, 1/sqrt(d) by default); S_hat[:, j] = -inf for
   non-self-similar key tiles (s_kj < theta) and for causally invisible tiles (block-causal, original positions).
3. P_hat[i] = softmax(S_hat[i]); M[i] = TopCdf(P_hat[i], tau). Boundary choice: the fewest top blocks whose
   cumulative mass reaches tau (the crossing block is kept; the paper's snippet ``cumsum <= tau*sum`` drops it,
   and its code then keeps at least one). tau >= 1 keeps every visible tile, explicitly.
4. M[i, :] = 1 if s_qi < theta; M[:, j] = 1 if s_kj < theta (non-self-similar blocks are never skipped).
5. Added for causal prefill (the paper targets mostly non-causal models and is silent): the diagonal tiles (the
   partially visible ones, or the on-diagonal segment under a PBS permutation) are always kept, so no query row
   can end up seeing no key at all.
6. The P.V skip lambda (``pv_threshold``) goes to the plan as ``pv_skip``: the kernel skips a tile's P.V when
   every row's tile maximum is below its running maximum by more than |lambda| (plan.py's rule; the paper
   applies it per warp's slice of rows, the plan per query block).

GQA: per query head, as the reference implementation (which repeats the pooled keys per head; here the pooled
keys are shared through ``group_scores``).
"""

from __future__ import annotations

import torch

from ..plan import VISIBLE_NONE, BlockPlan
from ._blocks import diagonal_tiles, finish_plan, visibility
from ._common import (
    bcast_heads,
    block_mean,
    block_self_similarity,
    compute_dtype,
    group_scores,
    logical_keys,
    masked_softmax,
    top_mass,
)
from .reorder import Reordering

__all__ = ["select_sparge"]


def select_sparge(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.sparge
    bm, bn = p.block_size_q, p.block_size_kv
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    vis = visibility(Nq, Nk, bm, bn, r, B, Hq, q.device)
    visible = vis != VISIBLE_NONE
    if p.cdf_threshold >= 1.0:
        return finish_plan(visible, vis, bm, bn, r, pv_skip=p.pv_threshold)
    cdt = compute_dtype(q)
    keys, valid = logical_keys(k, r.key_index)
    theta = p.similarity_threshold
    q_odd = block_self_similarity(q, bm, dtype=cdt) < theta  # (B, Hq, nqb)
    k_odd = bcast_heads(block_self_similarity(keys, bn, valid, dtype=cdt) < theta, Hq)  # (B, Hq, nkt)
    cand = visible & ~k_odd[:, :, None, :]
    pooled = group_scores(block_mean(q, bm, dtype=cdt), block_mean(keys, bn, valid, dtype=cdt))
    prob = masked_softmax(pooled * scale, cand)
    keep = top_mass(prob, cand, p.cdf_threshold)
    keep = keep | q_odd[..., None] | k_odd[:, :, None, :] | diagonal_tiles(vis, r, Nq, Nk, bm, bn)
    return finish_plan(keep, vis, bm, bn, r, pv_skip=p.pv_threshold)
