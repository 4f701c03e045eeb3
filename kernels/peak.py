"""Sampled-row peak scores on the GPU: per query block and key tile, the best exact score of the block's sampled
rows in the tile, above each row's level (its best score in the tiles every plan keeps). One pass, no exp.

Per (batch, query head, query block of BLOCK_M rows): the rows are ``kernels.strided_rows``' (rows EVERY-1,
2*EVERY-1, ... of the block). A row's level is its max score over the keys it sees in its block's diagonal tiles
and, with KEEP_FIRST, tile 0. A tile's peak is max over the block's rows of (the row's max score in the tile - its
level), times the softmax scale. With FP8, QK^T runs in e4m3 (``kernels.fp8``: keys quantized per KV head before
the launch, each row in the kernel with its own scale) and the scores stay in each row's units until the peak.

Programs as in ``kernels.strided_rows`` (BLOCKS query blocks of HEADS query heads of one KV head, each key tile loaded
once for all): first the levels (tile 0 and the tiles from the program's first diagonal on: BLOCKS + 1 tiles more
than the pass), then one pass over every tile the program sees, storing each tile's peak per (head, block) as it
goes. Reductions propagate NaN; a block whose rows see a NaN or +inf score, or have no finite level, gets NaN in
every visible tile (it keeps them all). A -inf score weighs nothing. What the sampled rows cannot see, after the
launch (``kernels.mass.keep_nonfinite``: whether a row scores a key with an infinite element +inf or -inf depends on
the row): NaN in every visible tile of a block with a NaN or infinite element in any row, and in the tiles with one
in a key, in every block that sees them. Tiles no query of the block sees are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot, dot_precision, is_finite, jit_any_length, runs_in_float32
from .fp8 import quantize_heads, quantize_rows
from .mass import keep_nonfinite
from .strided_rows import load_key_tile, program_blocks, program_keys, program_rows, program_shape, rows_per_block
from .validate import cdiv

__all__ = ["peak_tile_scores"]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _level_inner(q, k_base, level, qpos, lo, t0, t1, stride_kn, stride_kd, NUM_KEYS, d, dmask,
                 BLOCK_N: tl.constexpr, KEEP_FIRST: tl.constexpr, PREC: tl.constexpr):
    """Each row's max (unscaled) over the keys of tiles [t0, t1) it sees at or after ``lo`` (or in tile 0 with
    KEEP_FIRST)."""
    for t in range(t0, t1):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        kept = keys[None, :] >= lo[:, None]
        if KEEP_FIRST:
            kept = kept | (keys < BLOCK_N)[None, :]
        z = tl.where(kept & (keys[None, :] <= qpos[:, None]), z, float("-inf"))
        level = _max_nan(level, tl.reduce(z, 1, _max_nan))
    return level


@triton.jit
def _peak_inner(q, k_base, level, top, qpos, qmax, out_rows, live_blocks, t0, t1, stride_kn, stride_kd, NUM_KEYS,
                row_scale, d, dmask, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, PREC: tl.constexpr):
    """Tiles [t0, t1): each (head, block)'s peak, stored as it goes; ``top`` keeps each row's max (NaN-propagating).
    Scores are in each row's units until ``row_scale`` makes them logits. Only MASKED tiles compare positions."""
    for t in range(t0, t1):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        if MASKED:
            z = tl.where(keys[None, :] <= qpos[:, None], z, float("-inf"))
        best = tl.reduce(z, 1, _max_nan)
        top = _max_nan(top, best)
        peak = tl.reduce(tl.reshape((best - level) * row_scale, (GROUPS, ROWS)), 1, _max_nan)
        tl.store(out_rows + t, peak, mask=live_blocks & (t * BLOCK_N <= qmax))
    return top


@jit_any_length
def _peak_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd, k_scale_ptr,
    out_ptr,
    HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, NUM_PROGRAMS, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVERY: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    HEADS: tl.constexpr, KEEP_FIRST: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr,
    FP8: tl.constexpr,
):
    GROUPS: tl.constexpr = HEADS * BLOCKS
    M: tl.constexpr = GROUPS * ROWS
    q, qpos, live, b, h0, hk, g, blk, whole, num_tiles = program_rows(
        q_ptr, stride_qb, stride_qh, stride_qn, stride_qd, HQ, GROUP, NUM_QUERY_BLOCKS, NUM_QUERIES, NUM_KEYS,
        NUM_PROGRAMS, BLOCK_M, BLOCK_N, EVERY, ROWS, BLOCKS, HEADS, D, D_PAD)
    k_base, d, dmask = program_keys(k_ptr, b, hk, stride_kb, stride_kh, D, D_PAD)
    if FP8:  # rows quantized here, keys before the launch (kernels.fp8); scores in each row's units
        q, q_scale = quantize_rows(q)
        row_scale = q_scale * tl.load(k_scale_ptr + b * (HQ // GROUP) + hk) * scale
    else:
        row_scale = tl.full([M], scale, tl.float32)
    offset = NUM_KEYS - NUM_QUERIES
    diagonal_start = (blk * BLOCK_M + offset) // BLOCK_N * BLOCK_N
    # levels: the diagonals lie in [the first block's first diagonal tile, num_tiles); the sink is tile 0
    level = tl.full([M], float("-inf"), tl.float32)
    first_diagonal = (g * BLOCKS * BLOCK_M + offset) // BLOCK_N
    if KEEP_FIRST:
        level = _level_inner(q, k_base, level, qpos, diagonal_start, 0, tl.minimum(1, first_diagonal), stride_kn,
                             stride_kd, NUM_KEYS, d, dmask, BLOCK_N, KEEP_FIRST, PREC)
    level = _level_inner(q, k_base, level, qpos, diagonal_start, first_diagonal, num_tiles, stride_kn, stride_kd,
                         NUM_KEYS, d, dmask, BLOCK_N, KEEP_FIRST, PREC)
    out_rows, live_blocks, qmax = program_blocks(out_ptr, b, h0, g, HQ, NUM_QUERY_BLOCKS, NUM_KEY_TILES,
                                                 NUM_QUERIES, NUM_KEYS, BLOCK_M, BLOCKS, HEADS)
    top = tl.full([M], float("-inf"), tl.float32)
    top = _peak_inner(q, k_base, level, top, qpos, qmax, out_rows, live_blocks, 0, whole, stride_kn, stride_kd,
                      NUM_KEYS, row_scale, d, dmask, BLOCK_N, GROUPS, ROWS, False, PREC)
    top = _peak_inner(q, k_base, level, top, qpos, qmax, out_rows, live_blocks, whole, num_tiles, stride_kn,
                      stride_kd, NUM_KEYS, row_scale, d, dmask, BLOCK_N, GROUPS, ROWS, True, PREC)
    # a block whose rows met a NaN or +inf score, or have no finite level, keeps every visible tile
    bad = (live & ((is_finite(top) & is_finite(level)) == 0)).to(tl.int32)
    block_bad = tl.max(tl.reshape(bad, (GROUPS, ROWS)), 1) > 0
    if tl.max(block_bad.to(tl.int32), 0) > 0:
        for t in range(0, num_tiles):
            tl.store(out_rows + t, tl.full([GROUPS], float("nan"), tl.float32),
                     mask=block_bad & live_blocks & (t * BLOCK_N <= qmax))


def peak_tile_scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, every: int,
                     keep_first: bool, fp8: bool = False) -> torch.Tensor:
    """(B, Hq, nqb, nkt) float32 peaks (``methods.peak``'s s_ij), NaN in every visible tile of a block with a
    non-finite score or level or a non-finite query element in any row, and in the tiles with a non-finite key
    element that a block sees; entries of tiles no query of the block sees are left unwritten.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), keys in order, queries the last Nq positions; query blocks and key tiles of
    ``block`` rows; ``every`` a power of two <= ``block``. ``fp8``: QK^T in e4m3 on the tensor cores (keys per
    (batch, KV head), rows each with its own scale: ``kernels.fp8``), where ``fp8_tensor_cores`` says so.
    """
    if every < 1 or every & (every - 1) or every > block:
        raise ValueError(f"peak_tile_scores: every must be a power of two <= block={block}, got {every}")
    if runs_in_float32(q.dtype):
        q, k = q.float(), k.float()
    keys, k_scale = k, None  # keys: before any FP8 rounding
    if fp8:
        k, k_scale = quantize_heads(k)  # raises where the device has no FP8
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb, nkt = cdiv(Nq, block), cdiv(Nk, block)
    rows = rows_per_block(block, every)
    heads, blocks, warps, stages = program_shape(Hq // Hkv, rows, fp8)
    out = torch.empty(B, Hq, nqb, nkt, dtype=torch.float32, device=q.device)
    programs = cdiv(nqb, blocks)
    _peak_kernel[(programs, B * Hq // heads)](
        q, *q.stride(), k, *k.stride(), k if k_scale is None else k_scale, out,
        Hq, Hq // Hkv, nqb, nkt, Nq, Nk, programs, float(scale),
        BLOCK_M=block, BLOCK_N=block, EVERY=every, ROWS=rows, BLOCKS=blocks, HEADS=heads, KEEP_FIRST=keep_first,
        D=D, D_PAD=max(32 if fp8 else 16, triton.next_power_of_2(D)), PREC="none" if fp8 else dot_precision(q.dtype),
        FP8=fp8, num_warps=warps,
        num_stages=stages,
    )
    return keep_nonfinite(out, q, keys, block, block)  # what the sampled rows cannot see
