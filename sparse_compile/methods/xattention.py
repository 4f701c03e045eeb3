"""Select stage ``xattention``: antidiagonal block scoring (XAttention, Xu et al. 2025), as PBS combines it.

With stride s and block size B (logical order; keys possibly PBS-permuted):

1. Strided reshape: query group t = logical rows [t*s, t*s+s) becomes the vector
   [Q[t*s+s-1], ..., Q[t*s]] (reversed), key group u = [K[u*s], ..., K[u*s+s-1]]; their dot product is the sum of
   the antidiagonal of the s x s sub-block (u, t) of Q K^T.
2. Group scores * scale / s (the reference implementation's 1/sqrt(d)/stride), causal at group level (key group
   u visible to query group t iff its earliest original position <= t's last absolute position), softmax over
   each query group's row of key groups. Query groups past Nq are dropped; ragged groups are zero-padded.
3. Block score (i, j) = sum of those probabilities over the B/s query groups of block i and the B/s key groups
   of tile j.
4. Always kept: the diagonal (the query block's own segment under a PBS permutation, else the partially
   visible tiles) and, if ``keep_first_block``, the tile of original key 0. Their mass counts first; the other
   visible tiles follow in descending score while the mass before them is below threshold * row total (the
   reference selection rule). threshold >= 1 keeps every visible tile.

GQA: per query head (the reference implementation scores every head; K is shared per group, never repeated).
Memory: the group-score rows are computed for chunks of query blocks, each chunk at most ``CHUNK_ELEMENTS``
elements; only the (N/B)^2 block table is kept.
"""

from __future__ import annotations

import torch

from ..plan import VISIBLE_NONE, BlockPlan
from ._blocks import diagonal_tiles, finish_plan, first_key_tile, visibility
from ._common import bcast_heads, cdiv, chunk_count, compute_dtype, group_scores, logical_keys, masked_softmax, top_mass
from .reorder import Reordering

__all__ = ["select_xattention", "antidiagonal_block_scores"]


def antidiagonal_block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, stride: int,
                              key_index=None) -> torch.Tensor:
    """Steps 1-3 above: XAttention block scores (B, Hq, n_query_blocks, n_key_tiles) in the compute dtype."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cdt = compute_dtype(q)
    dev = q.device
    keys, valid = logical_keys(k, key_index)
    L = keys.shape[2]
    nqb, nkt = cdiv(Nq, block), cdiv(L, block)
    gpb = block // stride
    ng, mg = nqb * gpb, nkt * gpb
    kr = torch.nn.functional.pad(keys.to(cdt), (0, 0, 0, nkt * block - L)).reshape(B, Hkv, mg, stride * D)
    # earliest original position of each key group (padding: never visible)
    kpos = torch.arange(L, device=dev).expand(1, 1, L) if key_index is None else key_index.long()
    kpos = torch.where(valid, kpos, torch.full_like(kpos, 2**62))
    kmin = torch.nn.functional.pad(kpos, (0, nkt * block - L), value=2**62).view(*kpos.shape[:2], mg, stride)
    kmin = bcast_heads(kmin.amin(-1), Hq)  # (B|1, Hq, mg)
    t = torch.arange(ng, device=dev)
    qmax = (Nk - Nq) + torch.clamp((t + 1) * stride, max=Nq) - 1
    qlive = t * stride < Nq
    out = torch.empty(B, Hq, nqb, nkt, dtype=cdt, device=dev)
    step = chunk_count(B * Hq * gpb * mg)
    for i0 in range(0, nqb, step):
        i1 = min(i0 + step, nqb)
        rows = slice(i0 * gpb, i1 * gpb)
        # this chunk's query groups, reversed inside each group (the antidiagonal), cast chunk by chunk
        qc = q[:, :, i0 * block: min(i1 * block, Nq)].to(cdt)
        qc = torch.nn.functional.pad(qc, (0, 0, 0, (i1 - i0) * block - qc.shape[2]))
        qr = qc.view(B, Hq, (i1 - i0) * gpb, stride, D).flip(3).reshape(B, Hq, (i1 - i0) * gpb, stride * D)
        z = group_scores(qr, kr) * (scale / stride)
        allowed = (kmin[:, :, None, :] <= qmax[rows, None]) & qlive[rows, None]
        pr = masked_softmax(z, allowed)
        out[:, :, i0:i1] = pr.view(B, Hq, i1 - i0, gpb, nkt, gpb).sum((3, 5))
    return out


def select_xattention(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.xattention
    bs = p.block_size
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    vis = visibility(Nq, Nk, bs, bs, r, B, Hq, q.device)
    visible = vis != VISIBLE_NONE
    if p.threshold >= 1.0:
        return finish_plan(visible, vis, bs, bs, r)
    score = antidiagonal_block_scores(q, k, scale, bs, p.stride, r.key_index)
    score = torch.where(visible, score, torch.zeros((), dtype=score.dtype, device=score.device))
    forced = diagonal_tiles(vis, r, Nq, Nk, bs, bs)
    if p.keep_first_block:
        forced = forced | first_key_tile(r, Nk, bs, B, Hq, q.device)
    forced = forced & visible
    total = score.sum(-1, keepdim=True)
    head = torch.where(forced, score, torch.zeros((), dtype=score.dtype, device=score.device)).sum(-1, keepdim=True)
    keep = top_mass(score, visible & ~forced, p.threshold, head_start=head, total=total) | forced
    return finish_plan(keep, vis, bs, bs, r)
