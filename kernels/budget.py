"""Fixed-share selection: per (batch, head, query block), the forced tiles and the ceil(budget x visible) highest
scoring other tiles of a row of tile scores, written straight into plan rows (no sort, no boolean table).

The rule of ``methods.tiles.keep_top_budget`` (the specification): keys in order; the diagonal (partially
visible) tiles and, with ``keep_first_key``, tile 0 are forced; a visible tile whose score is NaN is kept; of the
other visible tiles, the ``allowed`` = max(1, ceil(budget x visible tiles)) highest scores are kept, ties to the
lower tile; with ``local`` > 0 the ``local`` tiles just before the diagonal are forced too. The ``allowed``-th
highest score is found by a 32-step bisection on the scores' bit patterns (ordered
like the floats), one row reduction per step; ties at it are kept in tile order by a prefix count.

With a mass target (``methods.tiles.tiles_to_reach``; scores are log masses), ``allowed`` is the fewest tiles,
highest first, whose masses with the forced tiles' reach ``mass_target`` of the visible mass, clamped between the
``min_budget`` and ``budget`` shares: the score of the tile that reaches it is found by the same bisection, on the
mass at or above each candidate instead of the count.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (TileGrid, empty_plan_tables, jit_any_length, orderable, plan_buckets, query_block_bounds,
                     row_visibility, row_warps, rows_per_program, store_plan_rows)

__all__ = ["budget_select"]


@triton.jit
def key_reaching(key, ranked, weight, base, goal):
    """(ROWS, 1) v*: the largest int32 ``key`` value such that ``base`` plus the ``weight`` of the ``ranked`` tiles
    with keys >= v* reaches ``goal`` (ROWS,), by bisection on the keys (the smallest ranked key when nothing does)."""
    big = 2147483647
    lo = tl.min(tl.where(ranked, key, big), 1).to(tl.int64)  # weight(>= lo) = all ranked
    hi = tl.max(tl.where(ranked, key, -big - 1), 1).to(tl.int64) + 1  # weight(>= hi) = 0
    for _ in range(32):
        active = hi - lo > 1
        mid = tl.where(active, lo + (hi - lo) // 2, lo)
        ok = base + tl.sum(tl.where(ranked & (key >= mid.to(tl.int32)[:, None]), weight, 0.0), 1) >= goal
        lo = tl.where(active & ok, mid, lo)
        hi = tl.where(active & (ok == 0), mid, hi)
    return lo.to(tl.int32)[:, None]


@triton.jit
def top_count(key, ranked, allowed):
    """Keep mask of the ``allowed`` (ROWS,) largest int32 ``key`` of each row of (ROWS, W) among ``ranked``, ties to
    the lower index: v* = the largest value with at least ``allowed`` ranked keys >= it."""
    v = key_reaching(key, ranked, 1.0, 0.0, allowed.to(tl.float32))
    above = ranked & (key > v)
    tie = (ranked & (key == v)).to(tl.int32)
    room = allowed - tl.sum(above.to(tl.int32), 1)
    return above | ((tie > 0) & ((tl.cumsum(tie, 1) - tie) < room[:, None]))


@triton.jit
def tiles_to_reach(key, mass, ranked, have, goal):
    """(ROWS,) how many ``ranked`` tiles, by descending int32 ``key`` (ties in tile order), bring ``have`` to
    ``goal`` with their ``mass``; at least one, every ranked one when the goal is out of reach. The key v* of the
    tile that reaches it is the largest with have + mass(key >= v*) >= goal."""
    v = key_reaching(key, ranked, mass, have, goal)
    above = ranked & (key > v)
    tie = ranked & (key == v)
    ties = tl.sum(tie.to(tl.int32), 1)
    short = goal - have - tl.sum(tl.where(above, mass, 0.0), 1)  # still missing before the ties at v*
    each = tl.max(tl.where(tie, mass, 0.0), 1)
    more = tl.math.ceil(short / tl.maximum(each, 1e-38))
    more = tl.minimum(tl.maximum(more, 1.0), ties.to(tl.float32)).to(tl.int32)
    return tl.sum(above.to(tl.int32), 1) + more


@jit_any_length
def _budget_select_kernel(
    score_ptr, stride_sb, stride_sh, stride_si,
    offs_ptr, stride_pb, stride_ph, stride_pi,
    cnt_ptr, msk_ptr,
    H, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, ROW0, ROW1, budget, local, mass_target, min_budget,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    KEEP_FIRST_KEY: tl.constexpr, KEEP_ALL: tl.constexpr, BY_MASS: tl.constexpr,
):
    i = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < ROW1
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row = bh.to(tl.int64) * NUM_QUERY_BLOCKS + i
    qmin, qmax = query_block_bounds(i, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    j = tl.arange(0, W)
    jin = j < NUM_KEY_TILES
    vis, part, _ = row_visibility(j, jin, qmin, qmax, score_ptr, score_ptr, score_ptr, 0, NUM_KEYS, BLOCK_N, False)
    vis = vis & rin[:, None]
    forced = vis & part
    if KEEP_FIRST_KEY:
        forced = forced | (vis & (j == 0)[None, :])
    first_diagonal = qmin // BLOCK_N  # the tile holding the block's first query position
    forced = forced | (vis & (j[None, :] >= (first_diagonal - local)[:, None]) & (j[None, :] < first_diagonal[:, None]))
    if KEEP_ALL:
        keep = vis
    else:
        srow = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + i.to(tl.int64) * stride_si
        s = tl.load(score_ptr + srow[:, None] + j[None, :], mask=vis, other=0.0)
        unreadable = vis & (s != s)
        ranked = vis & (forced == 0) & (unreadable == 0)
        visible = tl.sum(vis.to(tl.int32), 1).to(tl.float32)
        allowed = tl.maximum(tl.math.ceil(budget * visible - 1e-9), 1.0).to(tl.int32)
        key = orderable(s)
        if BY_MASS:
            mass = tl.where(vis & (unreadable == 0), tl.exp(s), 0.0)
            have = tl.sum(tl.where(forced, mass, 0.0), 1)
            needed = tiles_to_reach(key, mass, ranked, have, mass_target * tl.sum(mass, 1))
            least = tl.maximum(tl.math.ceil(tl.minimum(min_budget, budget) * visible - 1e-9), 1.0).to(tl.int32)
            allowed = tl.minimum(allowed, tl.maximum(needed, least))
        keep = top_count(key, ranked, allowed) | unreadable
    keep = (keep | forced) & vis
    obase = offs_ptr + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + i.to(tl.int64) * stride_pi
    store_plan_rows(keep, part, j, jin, rin, obase, cnt_ptr, msk_ptr, row, NUM_KEY_TILES, BLOCK_N, W)


def budget_select(grid: TileGrid, scores: Optional[torch.Tensor], budget: float, *, keep_first_key: bool,
                  local: int = 0, mass_target: float = 0.0, min_budget: float = 0.0):
    """``PlanTables`` of the fixed-share rule on ``scores`` (B, heads, nqb, nkt) float32 (only visible tiles are
    read; None, or ``budget`` >= 1, keeps every visible tile). Keys and queries in order; ``local`` tiles before
    each block's diagonal are forced; ``mass_target`` > 0 (scores are log masses) keeps the fewest tiles reaching
    it, between the ``min_budget`` and ``budget`` shares."""
    B, H, nqb, nkt = grid.batch, grid.heads, grid.num_query_blocks, grid.num_key_tiles
    keep_all = scores is None or budget >= 1.0
    tables = empty_plan_tables(B, H, nqb, nkt, grid.device)
    offs, cnt, msk = tables
    sc = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=grid.device) if keep_all else scores
    if not keep_all and (sc.dtype != torch.float32 or tuple(sc.shape) != (B, H, nqb, nkt) or sc.stride(-1) != 1):
        raise ValueError(f"budget_select: scores must be float32 ({B}, {H}, {nqb}, {nkt}) with unit last stride, "
                         f"got {sc.dtype} {tuple(sc.shape)} stride {sc.stride()}")
    for r0, r1, width in plan_buckets(nqb, nkt, grid.block_m, grid.block_n, grid.num_queries, grid.num_keys, 1):
        rows = rows_per_program(width, r1 - r0)
        _budget_select_kernel[(triton.cdiv(r1 - r0, rows), B * H)](
            sc, sc.stride(0), sc.stride(1), sc.stride(2),
            offs, offs.stride(0), offs.stride(1), offs.stride(2), cnt, msk,
            H, nqb, nkt, grid.num_queries, grid.num_keys, r0, r1, float(budget), int(local), float(mass_target),
            float(min_budget),
            BLOCK_M=grid.block_m, BLOCK_N=grid.block_n, W=width, ROWS=rows, KEEP_FIRST_KEY=keep_first_key,
            KEEP_ALL=keep_all, BY_MASS=mass_target > 0.0, num_warps=row_warps(rows, width),
        )
    return tables
