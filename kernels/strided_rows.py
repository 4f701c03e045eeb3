"""Programs over strided query rows, shared by the selectors that score every k-th row of each query block exactly
(``kernels.sampled``, ``kernels.peak``): which rows a program holds, its key-tile bounds and launch shape.

A program serves BLOCKS consecutive query blocks of HEADS query heads of one KV head, ROWS = BLOCK_M / EVERY rows per
(head, block): rows EVERY-1, 2*EVERY-1, ... of the block (its last row among them; in a ragged last block, rows past
its end are replaced by its last row), so every key any row of the block sees is seen by one of its rows. The
HEADS share every key tile load. Programs run the latest query blocks first (they see the most keys).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import interpreting, query_block_bounds

__all__ = ["rows_per_block", "load_key_tile", "program_rows", "program_keys", "program_blocks", "heads_per_program",
           "program_shape"]


def rows_per_block(block_m: int, every: int) -> int:
    """Rows scored per query block."""
    return max(1, block_m // every)


@triton.jit
def load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N: tl.constexpr):
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    kt = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                 mask=(keys < NUM_KEYS)[:, None] & dmask[None, :], other=0.0)
    return keys, kt


@triton.jit
def program_rows(q_ptr, stride_qb, stride_qh, stride_qn, stride_qd, HQ, GROUP, NUM_QUERY_BLOCKS, NUM_QUERIES,
                 NUM_KEYS, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVERY: tl.constexpr,
                 ROWS: tl.constexpr, BLOCKS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr):
    """The sampled rows of a program: BLOCKS consecutive query blocks (the latest first across programs) of HEADS
    query heads of one KV head, ROWS rows per (head, block), row fastest. Returns the (M, D_PAD) query tile, each
    row's position and liveness, the batch, the first head, the KV head, the query block index, the tiles every
    row sees whole and the tiles the latest row sees."""
    tl.static_assert(ROWS * EVERY <= BLOCK_M)
    tl.static_assert(HEADS * BLOCKS * ROWS >= 16)  # tl.dot's smallest M
    M: tl.constexpr = HEADS * BLOCKS * ROWS
    g = NUM_PROGRAMS - 1 - tl.program_id(0)  # the latest query blocks see the most keys: launch them first
    bh = tl.program_id(1)  # (batch, group of HEADS query heads)
    b = bh // (HQ // HEADS)
    h0 = (bh % (HQ // HEADS)) * HEADS
    slot = tl.arange(0, M)
    head = h0 + slot // (BLOCKS * ROWS)
    blk = g * BLOCKS + (slot // ROWS) % BLOCKS
    live = blk < NUM_QUERY_BLOCKS
    row = blk * BLOCK_M + (EVERY - 1) + (slot % ROWS) * EVERY
    row = tl.where(live, tl.minimum(row, tl.minimum(blk * BLOCK_M + BLOCK_M, NUM_QUERIES) - 1), 0)
    qpos = row + (NUM_KEYS - NUM_QUERIES)
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head.to(tl.int64)[:, None] * stride_qh
                + row.to(tl.int64)[:, None] * stride_qn + d[None, :] * stride_qd,
                mask=live[:, None] & (d < D)[None, :], other=0.0)
    last = tl.minimum(g * BLOCKS + BLOCKS, NUM_QUERY_BLOCKS) - 1
    _, qmax_last = query_block_bounds(last, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    num_tiles = tl.minimum(qmax_last // BLOCK_N + 1, (NUM_KEYS + BLOCK_N - 1) // BLOCK_N)
    earliest = tl.min(tl.where(live, qpos, NUM_KEYS), 0)
    whole = tl.minimum((earliest + 1) // BLOCK_N, num_tiles)
    return q, qpos, live, b, h0, h0 // GROUP, g, blk, whole, num_tiles


@triton.jit
def program_keys(k_ptr, b, hk, stride_kb, stride_kh, D: tl.constexpr, D_PAD: tl.constexpr):
    """The keys of a program's KV head: their base pointer, the head-dim range and its mask (for ``load_key_tile``)."""
    d = tl.arange(0, D_PAD)
    return k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh, d, d < D


@triton.jit
def program_blocks(out_ptr, b, h0, g, HQ, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS,
                   BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, HEADS: tl.constexpr):
    """Per (head, block) of a program (head-major, as the rows): the output row pointers, liveness, latest position."""
    group = tl.arange(0, HEADS * BLOCKS)
    gblk = g * BLOCKS + group % BLOCKS
    _, qmax = query_block_bounds(gblk, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    ghead = h0 + group // BLOCKS
    rows = out_ptr + ((b.to(tl.int64) * HQ + ghead) * NUM_QUERY_BLOCKS + gblk) * NUM_KEY_TILES
    return rows, gblk < NUM_QUERY_BLOCKS, qmax


def heads_per_program(group: int, rows: int, target: int) -> int:
    """Query heads of one KV head per program: the largest power of two dividing ``group`` with at most ``target``
    rows (they share every key tile load)."""
    heads = 1
    while group % (heads * 2) == 0 and heads * 2 * rows <= target:
        heads *= 2
    return heads


def program_shape(group: int, rows: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """(heads, blocks, num_warps, num_stages) of a program of the sampled-row kernels: 256 rows on the tensor cores
    in bf16, 128 in FP8 (16 under the interpreter, where every element costs time). At 128K on an H100: the bf16
    one-pass kernel at every 16th row ran 7.9 ms with 256 rows, 8 warps and 3 stages, 8.5-11.8 ms with 128 rows; the
    FP8 one at every 8th row 9.3 ms with 128 rows, 4 warps, 3 stages, 10.5 ms with 256 rows (docs/kernels.md)."""
    target = 16 if interpreting() else (128 if fp8 else 256)
    heads = heads_per_program(group, rows, target)
    blocks = max(1, target // (heads * rows), -(-16 // (heads * rows)))
    m = heads * blocks * rows
    return heads, blocks, (8 if m >= 256 else 4), (3 if m >= (128 if fp8 else 256) else 2)
