"""Select stage ``s2o``: S2O's two passes as one plan (Zhang et al. 2026, Sec. 3.2-3.3, Alg. 2-4).

Needs the ``s2o`` reorder (its ranked key list). For query block i (``block_size_q`` logical rows, all inside
one segment n because S is a multiple of the block):

* Pass 1, dense intra-segment causal window: the tiles of segment n's own keys (original order) that hold a key
  at or before the block's last query position. They are the plan's masked tiles: the kernel applies the causal
  mask (and the -1 padding of a ragged last segment) and early stopping never applies to them.
* Pass 2, coordinate-scheduled prefix: every tile of segment n's ranked causal prefix [0, nS), in ranked order
  (best first). All of them are fully visible (every key < nS <= every query position of the segment).
* Early stop: ``plan.early_stop = tau``. The paper stops when the gain Delta-l of a tile is below tau * l and
  discards that tile; plan.py fixes the block-level form: stop when g_r < tau * l_r for ALL rows of the query
  block, keeping the tile that triggered it (already computed). tau = 0 never stops: exact dense attention.

The local dense window W <= S of Alg. 3/4 is taken as W = S: Alg. 4 lists no step for a separate window, and the
ablation (Table 3) describes the window as the intra-segment pass that avoids special-casing masked positions;
``S2OParams`` has no window parameter.

Selection is thus nothing up front: every causal tile is listed; the kernel decides online how far down the
ranked list to go. Tile tables are per query head (query sorting is per head), (B, Hq, N/bm, <= N/bn + S/bn).
"""

from __future__ import annotations

import torch

from ..plan import BlockPlan
from ._common import cdiv
from .reorder import Reordering, s2o_segment_tensors

__all__ = ["select_s2o"]


def select_s2o(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.s2o
    lay = r.extras["layout"]
    bm, bn, S = p.block_size_q, p.block_size_kv, lay.segment
    B, Hq, N, _ = q.shape
    Hkv = k.shape[1]
    dev = q.device
    nqb = cdiv(N, bm)
    i = torch.arange(nqb, device=dev)
    seg = i * bm // S
    # last (absolute) query position of each block, after the query permutation
    if r.query_index is None:
        qmax = (torch.clamp((i + 1) * bm, max=N) - 1).expand(B, Hkv, nqb)
    else:
        qi = torch.nn.functional.pad(r.query_index.long(), (0, nqb * bm - N), value=-1)
        qmax = qi.view(B, Hq, nqb, bm).amax(-1)
    base, _, intra_pad = s2o_segment_tensors(seg, N, S, bn)
    intra_tiles = intra_pad // bn
    prefix_tiles = seg * S // bn
    # pass-1 tiles: own-segment tiles starting at or before qmax (a prefix of them, in original order)
    n_masked = torch.minimum((qmax - seg * S) // bn + 1, intra_tiles)
    counts = n_masked + prefix_tiles
    width = max(a // bn + b // bn for a, b in zip(lay.intra_pad, lay.prefix_len))
    t = torch.arange(width, device=dev)
    offs = torch.where(
        t < n_masked[..., None],
        base[:, None] + t * bn,  # own keys, original order
        (base + intra_pad)[:, None] + (t - n_masked[..., None]) * bn,  # ranked prefix, best first
    )
    offs = torch.where(t < counts[..., None], offs, torch.zeros_like(offs))
    return BlockPlan(
        block_m=bm,
        block_n=bn,
        tile_offsets=offs.to(torch.int32).contiguous(),
        tile_counts=counts.to(torch.int32).contiguous(),
        masked_counts=n_masked.to(torch.int32).contiguous(),
        key_index=r.key_index,
        query_index=r.query_index,
        early_stop=float(p.early_stop),
    )
