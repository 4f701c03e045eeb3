"""Select stage ``pbs``: MeanPooling block selection (PBS-Attn, Appendix B.1, Algorithm 2).

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

import torch

from ..plan import VISIBLE_NONE, BlockPlan
from ._blocks import diagonal_tiles, finish_plan, first_key_tile, visibility
from ._common import block_mean, compute_dtype, group_scores, logical_keys, masked_softmax, top_mass
from .reorder import Reordering

__all__ = ["select_pbs"]


def select_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.pbs
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
