"""Sampled-row peak selection (built here): tiles ranked by the best exact score of a sample of query rows,
measured against what those rows already read in the tiles every plan keeps. One pass over the keys, no exp: a
row's largest score lists the same lookups as its softmax mass (``sampled``'s ranking), and measured against a
level known before the pass it needs neither exp nor the row's final normaliser.

Per query head h and query block i of B rows (keys in order; queries are the last Nq of Nk positions):

1. Sampled rows: ``sampled``'s (rows k-1, 2k-1, ..., B-1 of the block; k = ``sample_every``).
2. Each sampled row r: its level L_r = max of its exact scores q_r . k_j * scale over the keys j <= its position
   in the block's diagonal tiles (the tiles holding the block's own positions) and, if ``keep_first_block``, in
   tile 0 (the attention sink): the keys the plan keeps whatever the ranking says.
3. s_ij = max over the block's sampled rows r and the keys j <= r's position in tile j of (score - L_r): how far
   the tile's best key rises above what the row reads anyway (> 0: it would take the row's softmax over).
4. The forced tiles (the diagonal tiles; tile 0 if ``keep_first_block``) and the block's ceil(budget x visible
   tiles) (at least one) other tiles of highest s_ij (ties: lower tile first), as ``sampled``.

GPU (``kernels.peak``): one QK^T pass over 1/k of the rows with a row max per tile, the diagonal tiles once more for
the levels, a KV head's query heads sharing each key tile load; ranking and plan rows by ``kernels.budget``. With
``scores_in_fp8`` QK^T runs in e4m3 (``kernels.fp8``: keys one scale per (batch, KV head), rows their own).

Non-finite inputs (``sampled``'s rule): a key tile with a NaN or infinite key element has a NaN score (kept) in every
block that sees it; a block with a NaN or infinite query element in any row, a sampled row scoring a seen key NaN or
+inf, or a non-finite level, keeps every visible tile (``scoring.keep_nonfinite``); a -inf score weighs nothing. V
is never read to plan. GQA: per query head. Why, the reasons for the rule and the measurements: docs/methods.md
("`peak` step by step", "Peak").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import BlockPlan
from ..registry import Method, register_method
from .tiles import BUDGET_KNOB, StridedRowParams, finish_budget_plan, scores_in_fp8, strided_rows
from .scoring import (FP8_MAX, Reordering, chunk_count, compute_dtype, fp8_rows_and_keys,  # noqa: F401
                      group_scores, keep_nonfinite)

__all__ = ["PeakParams", "scores_in_fp8", "peak_tile_scores", "select_peak", "select_peak_fast"]


@dataclass(frozen=True)
class PeakParams(StridedRowParams):
    """Sampled-row peak selection: every ``sample_every``-th row's best score per key tile, above the row's level in
    the tiles always kept; a fixed share of tiles per block.

    Each query block keeps its diagonal tile(s), the sink tile (``keep_first_block``) and its ceil(``budget`` x
    visible tiles) other tiles of highest peak; ``budget=1.0`` keeps every causal block. ``block_size`` is the
    query block and the key tile. Ranking by the best score keeps lookups but misses broad context more often than
    ``sampled``'s mass: the eight local tiles matter more here (SmolLM2-135M at 16K, prose: +0.025 nats per token
    with four, +0.015 with eight; docs/methods.md).
    """


def peak_tile_scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, every: int,
                     keep_first_block: bool, fp8: bool = False) -> torch.Tensor:
    """(B, Hq, nqb, nkt) in the compute dtype: s_ij of the module docstring (steps 1-3); NaN in every tile of a
    block whose sampled rows see a NaN or +inf score or have a non-finite level, or with a non-finite query element
    in any row, and in every block in the tiles with a non-finite key element. Key chunks at a time (levels, then
    peaks); never the (rows x Nk) matrix whole. ``fp8``: q rows and keys rounded to e4m3 as ``kernels.fp8`` does
    (a scale per row, per (batch, KV head)), the products summed in float32."""
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    cdt = torch.float32 if fp8 else compute_dtype(q.dtype)
    dev = q.device
    rows = strided_rows(num_queries, block, every, dev)
    per = max(1, block // every)
    nqb, nkt = -(-num_queries // block), -(-num_keys // block)
    qs = q[:, :, rows].to(cdt)  # (B, Hq, R, D)
    row_scale = torch.full((), scale, dtype=cdt, device=dev)
    k_in = k  # before any FP8 rounding
    if fp8:
        qs, k, row_scale = fp8_rows_and_keys(qs, k, scale)  # row_scale: (B, Hq, R)
    offset = num_keys - num_queries
    positions = rows + offset
    diagonal_start = ((rows // block) * block + offset) // block * block  # first key of the block's first diagonal
    step = chunk_count(batch * heads_q * rows.numel() * block) * block  # keys per chunk: whole tiles
    minus_inf = torch.full((), float("-inf"), dtype=cdt, device=dev)
    chunks = [(c0, min(c0 + step, num_keys)) for c0 in range(0, num_keys, step)]

    def seen_scores(c0: int, c1: int):  # in each row's units (times row_scale: logits)
        keys = torch.arange(c0, c1, device=dev)
        z = group_scores(qs, k[:, :, c0:c1].to(cdt))
        kept = keys[None, :] >= diagonal_start[:, None]
        if keep_first_block:
            kept = kept | (keys < block)[None, :]
        return torch.where(keys[None, :] <= positions[:, None], z, minus_inf), kept

    level = torch.full((batch, heads_q, rows.numel()), float("-inf"), dtype=cdt, device=dev)
    top = level.clone()
    for c0, c1 in chunks:
        z, kept = seen_scores(c0, c1)
        level = torch.maximum(level, torch.where(kept, z, minus_inf).amax(-1))
        top = torch.maximum(top, z.amax(-1))  # NaN propagates
    bad = ~(torch.isfinite(top) & torch.isfinite(level))
    out = torch.empty((batch, heads_q, nqb, nkt), dtype=cdt, device=dev)
    for c0, c1 in chunks:
        z, _ = seen_scores(c0, c1)
        pad = -(c1 - c0) % block
        tiles = (c1 - c0 + pad) // block
        z = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(batch, heads_q, -1, tiles, block)
        peak = (z.amax(-1) - level[..., None]) * row_scale[..., None]  # per row, or one scale (0-d: broadcasts)
        out[..., c0 // block: c0 // block + tiles] = peak.view(batch, heads_q, nqb, per, tiles).amax(-2)
    block_bad = bad.view(batch, heads_q, nqb, per).any(-1)
    out = torch.where(block_bad[..., None], torch.full((), float("nan"), dtype=cdt, device=dev), out)
    return keep_nonfinite(out, q, k_in, block)  # the rows not sampled: a non-finite key or query element


def select_peak(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    keep_all = params.budget >= 1.0
    scores = None if keep_all else peak_tile_scores(q, k, scale, params.block_size, params.sample_every,
                                                    params.keep_first_block, scores_in_fp8(params, q.device))
    return finish_budget_plan(scores, q, k, reordering, params)


def select_peak_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering,
                     params) -> BlockPlan:
    """= ``select_peak``: the peaks from ``kernels.peak``, the ranking and the plan rows from ``kernels.budget``."""
    from ..kernels.peak import peak_tile_scores as peak_kernel
    from .fast_path import budget_plan, scores_wanted

    scores = None
    if scores_wanted(reordering, params, "peak"):
        scores = peak_kernel(q, k, scale, params.block_size, params.sample_every, params.keep_first_block,
                             scores_in_fp8(params, q.device))
    return budget_plan(scores, q, k, reordering, params)


register_method(Method(
    name="peak", params=PeakParams, select=select_peak, fast_select=select_peak_fast,
    density=BUDGET_KNOB, keep_all={"budget": 1.0},
    description="strided-row peak: every k-th query row's best score per key tile above its kept tiles, one pass",
))
