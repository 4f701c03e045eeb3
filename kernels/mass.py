"""Mass selection: per (batch, head, query block), one method's ``MassRule`` applied to a row of pooled scores,
written straight into plan rows (or a keep table).

Per row: visibility from original positions, the rule's candidates and forced tiles, the softmax of the scaled
scores over the candidates, the cumulative-mass rule (``common.top_mass``), and the plan row itself in the plan's
order (partially visible tiles first, then fully visible ones, then the rest, each ascending): no boolean tile
table, no argsort.

Non-finite scores: a visible tile whose scaled score is NaN or infinite is kept and leaves the softmax. A query
block whose pooled statistics are not finite has such scores in every column, so it keeps every visible tile; a
key tile whose pooled statistics are not finite has them in every row, so every query block that sees it keeps
it. The references (``methods.scoring.mass_keep``) apply the same rule.

The strided-row selectors (``kernels.sampled``, ``kernels.peak``) score a sample of rows, whose scores cannot say
where the others meet a non-finite input: ``keep_nonfinite`` gives NaN scores (kept) to the query blocks and key
tiles that hold one (``nonfinite_blocks``: one pass over Q and over K), as ``methods.scoring.keep_nonfinite``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (TileGrid, empty_plan_tables, is_finite, jit_any_length, plan_buckets, query_block_bounds,
                     row_visibility, row_warps, rows_per_program, split_heads, store_plan_rows, top_mass)
from .pooling import BlockPool

__all__ = ["MassRule", "mass_select", "nonfinite_blocks", "keep_nonfinite"]


@dataclass(frozen=True)
class MassRule:
    """How one method turns a row of pooled scores into kept tiles (each method's fast stage builds one).

    threshold             tau: keep the fewest highest-probability candidates whose mass reaches tau of the
                          row's total; >= 1 keeps every visible tile without reading any score.
    scale                 multiplies the scores before the softmax.
    segment               the PBS segment of a segmented key permutation (0: keys in order, or not permuted in
                          segments); it defines the diagonal (the query block's own segment).
    keep_diagonal         the diagonal tiles (partially visible ones, or the own segment) are always kept.
    diagonal_in_softmax   False: the diagonal tiles are not candidates (PBS under its permutation).
    keep_first_key        the tile holding original key 0 (the attention sink) is always kept.
    similarity_threshold  SpargeAttn's judge theta: a key tile whose self-similarity is below it leaves the
                          softmax and is kept, as is every tile of such a query block (None: no judge).
    """

    threshold: float
    scale: float = 1.0
    segment: int = 0
    keep_diagonal: bool = False
    diagonal_in_softmax: bool = True
    keep_first_key: bool = False
    similarity_threshold: Optional[float] = None

    @property
    def keeps_all(self) -> bool:
        return self.threshold >= 1.0


@jit_any_length
def _mass_select_kernel(
    logit_ptr, stride_lb, stride_lh, stride_li,
    kmin_ptr, kmax_ptr, kpad_ptr,
    ksim_ptr, qsim_ptr,
    offs_ptr, stride_pb, stride_ph, stride_pi,
    cnt_ptr, msk_ptr, keep_ptr,
    H, KV_DIV, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, ROW0, ROW1,
    scale, tau, theta,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, DIAGONAL_IN_SOFTMAX: tl.constexpr, KEEP_DIAGONAL: tl.constexpr,
    KEEP_FIRST_KEY: tl.constexpr, JUDGE: tl.constexpr, KEEP_ALL: tl.constexpr, WRITE_PLAN: tl.constexpr,
):
    # ROWS query blocks of one (batch, head) per program: every reduction serves ROWS rows at once
    i = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < ROW1
    bh = tl.program_id(1)
    b, h, hk = split_heads(bh, H, KV_DIV)
    row = bh.to(tl.int64) * NUM_QUERY_BLOCKS + i
    qmin, qmax = query_block_bounds(i, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    j = tl.arange(0, W)
    jin = j < NUM_KEY_TILES
    kbase = (b.to(tl.int64) * (H // KV_DIV) + hk) * NUM_KEY_TILES
    vis, part, kmin = row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr, kbase, NUM_KEYS, BLOCK_N,
                                     HAS_POSITIONS)
    vis = vis & rin[:, None]
    # the diagonal: the query block's own segment under a segmented key permutation, else the partial tiles
    if SEGMENT > 0:
        tseg = (j * BLOCK_N) // SEGMENT
        diag = vis & (tseg[None, :] >= (qmin // SEGMENT)[:, None]) & (tseg[None, :] <= (qmax // SEGMENT)[:, None])
    else:
        diag = part
    forced = vis & (j < 0)[None, :]
    if KEEP_DIAGONAL:
        forced = forced | diag
    if KEEP_FIRST_KEY:
        if HAS_POSITIONS:
            forced = forced | (vis & (kmin == 0)[None, :])  # the logical tile that holds original key 0
        else:
            forced = forced | (vis & (j == 0)[None, :])
    cand = vis
    if not DIAGONAL_IN_SOFTMAX:
        cand = cand & (diag == 0)
    if JUDGE:  # SpargeAttn: non-self-similar key tiles leave the softmax and are kept, as are such query rows
        kodd = tl.load(ksim_ptr + kbase + j, mask=jin, other=0.0) < theta
        qodd = tl.load(qsim_ptr + row, mask=rin, other=1.0) < theta
        cand = cand & (kodd == 0)[None, :]
        forced = forced | kodd[None, :] | qodd[:, None]
    if KEEP_ALL:
        keep = vis
    else:
        lrow = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + i.to(tl.int64) * stride_li
        z = tl.load(logit_ptr + lrow[:, None] + j[None, :], mask=vis, other=0.0) * scale
        # a non-finite score (non-finite pooled statistics) is kept and leaves the softmax
        unreadable = vis & (is_finite(z) == 0)
        cand = cand & (unreadable == 0)
        forced = forced | unreadable
        z = tl.where(cand, z, -3.4028234663852886e38)
        e = tl.where(cand, tl.exp(z - tl.max(z, 1)[:, None]), 0.0)
        den = tl.sum(e, 1)
        p = e / tl.where(den > 0, den, 1.0)[:, None]
        total = tl.sum(p, 1)
        keep = top_mass(p, cand, tau * total, total * 0.0)
    keep = (keep | forced) & vis
    if WRITE_PLAN:
        obase = offs_ptr + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + i.to(tl.int64) * stride_pi
        store_plan_rows(keep, part, j, jin, rin, obase, cnt_ptr, msk_ptr, row, NUM_KEY_TILES, BLOCK_N, W)
    else:
        tl.store(keep_ptr + row[:, None] * NUM_KEY_TILES + j[None, :], keep.to(tl.int8),
                 mask=rin[:, None] & jin[None, :])


def mass_select(grid: TileGrid, rule: MassRule, logits: Optional[torch.Tensor] = None, *,
                key_tiles: Optional[BlockPool] = None, query_similarity: Optional[torch.Tensor] = None,
                keep_table: bool = False):
    """Apply ``rule`` to every (batch, head, query block) of ``grid``.

    ``logits`` (B, heads, nqb, nkt) float32 unscaled pooled scores (only the causal region is read; not needed
    when the rule keeps all). ``key_tiles``: the key tiles' ``block_pool`` statistics (B, kv_heads, nkt): their
    positions when keys are permuted (None: keys in order), their ``similarity`` for the judge.
    ``query_similarity`` (B, heads, nqb): the query blocks' similarity for the judge.
    Returns ``PlanTables`` (plan rows of width nkt), or with ``keep_table`` an int8 (B, heads, nqb, nkt) table of
    kept tiles (zero past each row's launch width).
    """
    B, H, nqb, nkt = grid.batch, grid.heads, grid.num_query_blocks, grid.num_key_tiles
    dev = grid.device
    keep_all = rule.keeps_all
    if not keep_all and logits is None:
        raise ValueError("mass_select: the rule reads scores (threshold < 1) but no logits were given")
    judge = rule.similarity_threshold is not None and not keep_all
    if judge and (query_similarity is None or key_tiles is None or key_tiles.similarity is None):
        raise ValueError("mass_select: the similarity judge needs query_similarity and key_tiles.similarity")
    permuted = key_tiles is not None and key_tiles.min_position is not None
    dummy_i = torch.empty(1, 1, 1, 1, dtype=torch.int32, device=dev)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    tables = keep = None
    if keep_table:
        keep = torch.zeros(B, H, nqb, nkt, dtype=torch.int8, device=dev)
        offs = cnt = msk = dummy_i
    else:
        tables = empty_plan_tables(B, H, nqb, nkt, dev)
        offs, cnt, msk = tables
    lg = logits if logits is not None else dummy_f.view(1, 1, 1, 1)
    kmin = key_tiles.min_position if permuted else dummy_i
    kmax = key_tiles.max_position if permuted else dummy_i
    kpad = key_tiles.has_padding if permuted else dummy_i
    ksim = key_tiles.similarity if judge else dummy_f
    qsim = query_similarity if judge else dummy_f
    segment_bound = rule.segment if (rule.segment and permuted) else 1
    for r0, r1, width in plan_buckets(nqb, nkt, grid.block_m, grid.block_n, grid.num_queries, grid.num_keys,
                                      segment_bound):
        rows = rows_per_program(width, r1 - r0)
        _mass_select_kernel[(triton.cdiv(r1 - r0, rows), B * H)](
            lg, lg.stride(0), lg.stride(1), lg.stride(2),
            kmin, kmax, kpad, ksim, qsim,
            offs, offs.stride(0), offs.stride(1), offs.stride(2),
            cnt, msk, keep if keep is not None else dummy_i,
            H, H // grid.kv_heads, nqb, nkt, grid.num_queries, grid.num_keys, r0, r1,
            float(rule.scale), float(rule.threshold),
            float(rule.similarity_threshold) if judge else 0.0,
            BLOCK_M=grid.block_m, BLOCK_N=grid.block_n, SEGMENT=int(rule.segment), W=width, ROWS=rows,
            HAS_POSITIONS=permuted, DIAGONAL_IN_SOFTMAX=rule.diagonal_in_softmax,
            KEEP_DIAGONAL=rule.keep_diagonal, KEEP_FIRST_KEY=rule.keep_first_key, JUDGE=judge, KEEP_ALL=keep_all,
            WRITE_PLAN=not keep_table, num_warps=row_warps(rows, width),
        )
    return keep if keep_table else tables


# -- non-finite inputs of the strided-row selectors (the twins of ``methods.scoring.keep_nonfinite``'s flags) -----
@jit_any_length
def _nonfinite_blocks_kernel(x_ptr, stride_xb, stride_xh, stride_xn, stride_xd, out_ptr, HEADS, N, NUM_BLOCKS,
                             BLOCK: tl.constexpr, STEP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    base = x_ptr + (bh // HEADS).to(tl.int64) * stride_xb + (bh % HEADS).to(tl.int64) * stride_xh
    bad = tl.zeros([STEP], tl.int32)
    for r0 in tl.static_range(0, BLOCK, STEP):
        rows = i * BLOCK + r0 + tl.arange(0, STEP)
        x = tl.load(base + rows.to(tl.int64)[:, None] * stride_xn + d[None, :] * stride_xd,
                    mask=(rows < N)[:, None] & (d < D)[None, :], other=0.0)
        bad = tl.maximum(bad, tl.max((is_finite(x) == 0).to(tl.int32), 1))
    tl.store(out_ptr + bh.to(tl.int64) * NUM_BLOCKS + i, tl.max(bad, 0).to(tl.int8))


def nonfinite_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """int8 (B, H, ceil(N/block)), contiguous, of ``x`` (B, H, N, D): 1 for the blocks of ``block`` rows holding a
    NaN or infinite element (= ``methods.scoring``'s ``nonfinite_key_tiles`` / ``nonfinite_query_blocks``), from
    one pass over ``x`` (a program per block). The strided-row kernels score a sample of rows, which cannot tell
    what the others score: a key with an infinite element scores +inf or -inf by each row's sign, and a query row
    with one outputs NaN or zeros by every key it sees (``keep_nonfinite``)."""
    B, H, N, D = x.shape
    nb = -(-N // block)
    out = torch.empty(B, H, nb, dtype=torch.int8, device=x.device)
    _nonfinite_blocks_kernel[(nb, B * H)](x, *x.stride(), out, H, N, nb, BLOCK=block, STEP=min(block, 32), D=D,
                                          D_PAD=max(16, triton.next_power_of_2(D)))
    return out


@jit_any_length
def _keep_nonfinite_kernel(score_ptr, key_bad_ptr, query_bad_ptr, HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES,
                           NUM_QUERIES, NUM_KEYS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0)  # query block
    bh = tl.program_id(1)  # batch * HQ + query head
    hk = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP  # batch * HKV + its KV head
    block_bad = tl.load(query_bad_ptr + bh.to(tl.int64) * NUM_QUERY_BLOCKS + i).to(tl.int32)
    _, qmax = query_block_bounds(i, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    row = score_ptr + (bh.to(tl.int64) * NUM_QUERY_BLOCKS + i) * NUM_KEY_TILES
    c = tl.arange(0, CHUNK)
    for t0 in range(0, qmax // BLOCK_N + 1, CHUNK):
        t = t0 + c
        seen = t * BLOCK_N <= qmax
        flagged = (tl.load(key_bad_ptr + hk.to(tl.int64) * NUM_KEY_TILES + t, mask=seen, other=0) + block_bad) != 0
        tl.store(row + t, tl.full([CHUNK], float("nan"), tl.float32), mask=seen & flagged)


def keep_nonfinite(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """``scores`` (B, Hq, nqb, nkt) float32, contiguous, of a strided-row kernel, with NaN (kept) in place: in every
    visible tile of a query block of ``block_m`` rows holding a NaN or infinite element of ``q``, and in the tiles
    of ``block_n`` keys holding one of ``k`` (its query head's KV head's), in every block that sees them
    (= ``methods.scoring.keep_nonfinite``). Flags from one pass over Q and over K (``nonfinite_blocks``), then a
    program per plan row that reads its row's flags and writes only the NaN; the kernels' passes are unchanged.
    Returns ``scores``."""
    B, Hq, nqb, nkt = scores.shape
    key_bad, query_bad = nonfinite_blocks(k, block_n), nonfinite_blocks(q, block_m)
    _keep_nonfinite_kernel[(nqb, B * Hq)](scores, key_bad, query_bad, Hq, Hq // k.shape[1], nqb, nkt, q.shape[2],
                                           k.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, CHUNK=64)
    return scores
