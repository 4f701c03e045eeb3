"""Sampled-row tile mass on the GPU: the exact causal softmax of every k-th query row, summed per key tile.

Per (batch, query head, query block of BLOCK_M rows): the block's sampled rows are rows EVERY-1, 2*EVERY-1, ... of
the block (its last row among them; in a ragged last block, rows past its end are replaced by its last row). Each
sampled row's softmax over every key it sees is computed exactly, and the mass it puts in each key tile of
BLOCK_N keys is averaged over the block's sampled rows. The selector ranks tiles by that mass: a lookup is one
query row and one key, and pooled means dilute both, where sampled rows see them whole.

One program serves BLOCKS consecutive query blocks of one head (BLOCKS * BLOCK_M / EVERY rows on the tensor
cores) in two passes over the keys they see: the rows' max and sum of exp, then each tile's mass; tiles that every
row sees whole skip the position test. Output: the log of the mass (plus ``TINY``) per visible tile, so the mass
selection's softmax of it is the mass itself. A sampled row that scores a key it sees as NaN or +inf makes its
row sum NaN, hence every tile of its block NaN: the block keeps every visible tile (as a block with non-finite
pooled statistics does everywhere in selection); no score is tested one by one. A -inf score weighs nothing, as in
dense attention. Tiles no query of the block sees are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot, dot_precision, interpreting, launchable, load_head_rows, query_block_bounds, split_heads
from .validate import cdiv

__all__ = ["TINY", "sampled_rows_per_block", "sampled_mass_logits"]

_LOG2E = 1.4426950408889634
#: added to a tile's mass before the log, so that a tile with no mass has a finite (very low) score
TINY = 1e-30


def sampled_rows_per_block(block_m: int, every: int) -> int:
    """Rows scored per query block."""
    return max(1, block_m // every)


@triton.jit
def _load_keys(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N: tl.constexpr):
    keys = t * BLOCK_N + tl.arange(0, BLOCK_N)
    kt = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                 mask=(keys < NUM_KEYS)[:, None] & dmask[None, :], other=0.0)
    return keys, kt


@triton.jit
def _row_stats_inner(q, k_base, m, s, qpos, t0, t1, stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask,
                     BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Pass 1 over key tiles [t0, t1): each row's running max (unscaled) and sum of exp2, online. Only MASKED
    tiles compare positions; a NaN or +inf score makes its row's sum NaN (no per-score finiteness test)."""
    for t in range(t0, t1):
        keys, kt = _load_keys(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        if MASKED:
            z = tl.where(keys[None, :] <= qpos[:, None], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp2((m - m_new) * qk_scale) + tl.sum(tl.exp2(z * qk_scale - (m_new * qk_scale)[:, None]), 1)
        m = m_new
    return m, s


@triton.jit
def _mass_inner(q, k_base, mb, inv, qpos, blocks, qmax, out_rows, t0, t1, stride_kn, stride_kd, NUM_KEYS,
                NUM_QUERY_BLOCKS, qk_scale, tiny, d, dmask, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                ROWS: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Pass 2 over key tiles [t0, t1): each tile's mass, summed over each block's rows, stored as its log."""
    for t in range(t0, t1):
        keys, kt = _load_keys(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        p = tl.exp2(z * qk_scale - mb[:, None])
        if MASKED:
            p = tl.where(keys[None, :] <= qpos[:, None], p, 0.0)
        mass = tl.sum(tl.reshape(tl.sum(p, 1) * inv, (BLOCKS, ROWS)), 1)
        tl.store(out_rows + t, tl.log(mass + tiny), mask=(blocks < NUM_QUERY_BLOCKS) & (t * BLOCK_N <= qmax))


@triton.jit
def _sampled_mass_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    out_ptr,
    HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, NUM_PROGRAMS, qk_scale, tiny,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVERY: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr,
):
    tl.static_assert(ROWS * EVERY <= BLOCK_M)
    tl.static_assert(BLOCKS * ROWS >= 16)  # tl.dot's smallest M
    M: tl.constexpr = BLOCKS * ROWS
    # the latest query blocks see the most keys: launch them first
    g = NUM_PROGRAMS - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk = split_heads(bh, HQ, GROUP)
    slot = tl.arange(0, M)
    blk = g * BLOCKS + slot // ROWS
    live = blk < NUM_QUERY_BLOCKS
    row = blk * BLOCK_M + (EVERY - 1) + (slot % ROWS) * EVERY
    row = tl.where(live, tl.minimum(row, tl.minimum(blk * BLOCK_M + BLOCK_M, NUM_QUERIES) - 1), 0)
    qpos = row + (NUM_KEYS - NUM_QUERIES)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = load_head_rows(q_ptr, b, h, row, live, d, dmask, stride_qb, stride_qh, stride_qn, stride_qd)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    # tiles every row of the program sees whole (no position test), then the tiles up to the latest row's
    last = tl.minimum(g * BLOCKS + BLOCKS, NUM_QUERY_BLOCKS) - 1
    _, qmax_last = query_block_bounds(last, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    num_tiles = tl.minimum(qmax_last // BLOCK_N + 1, NUM_KEY_TILES)
    earliest = tl.min(tl.where(live, qpos, NUM_KEYS), 0)
    whole = tl.minimum((earliest + 1) // BLOCK_N, num_tiles)

    m = tl.full([M], -1.0e30, tl.float32)
    s = tl.zeros([M], tl.float32)
    m, s = _row_stats_inner(q, k_base, m, s, qpos, 0, whole, stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask,
                            BLOCK_N, False, PREC)
    m, s = _row_stats_inner(q, k_base, m, s, qpos, whole, num_tiles, stride_kn, stride_kd, NUM_KEYS, qk_scale, d,
                            dmask, BLOCK_N, True, PREC)
    # each row's share of its block's mean: 1 / (sum of exp * rows); a NaN sum stays NaN (the block keeps all)
    inv = 1.0 / (s * ROWS)
    mb = m * qk_scale
    blocks = g * BLOCKS + tl.arange(0, BLOCKS)
    _, qmax = query_block_bounds(blocks, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    out_rows = out_ptr + (bh.to(tl.int64) * NUM_QUERY_BLOCKS + blocks) * NUM_KEY_TILES
    _mass_inner(q, k_base, mb, inv, qpos, blocks, qmax, out_rows, 0, whole, stride_kn, stride_kd, NUM_KEYS,
                NUM_QUERY_BLOCKS, qk_scale, tiny, d, dmask, BLOCK_N, BLOCKS, ROWS, False, PREC)
    _mass_inner(q, k_base, mb, inv, qpos, blocks, qmax, out_rows, whole, num_tiles, stride_kn, stride_kd, NUM_KEYS,
                NUM_QUERY_BLOCKS, qk_scale, tiny, d, dmask, BLOCK_N, BLOCKS, ROWS, True, PREC)


def sampled_mass_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block_m: int, block_n: int,
                        every: int) -> torch.Tensor:
    """(B, Hq, nqb, nkt) float32: log(mean sampled-row mass of each visible tile + ``TINY``), NaN in every tile of
    a block whose sampled rows score a key as NaN or +inf; entries of tiles no query of the block sees are left
    unwritten.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), keys in order, queries the last Nq positions. ``every`` a power of two
    <= ``block_m``.
    """
    if every < 1 or every & (every - 1) or every > block_m:
        raise ValueError(f"sampled_mass_logits: every must be a power of two <= block_m={block_m}, got {every}")
    q, k = launchable(q), launchable(k)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb, nkt = cdiv(Nq, block_m), cdiv(Nk, block_n)
    rows = sampled_rows_per_block(block_m, every)
    # 128 rows on the tensor cores per program (16 under the interpreter, where every element costs time)
    blocks = max(1, (16 if interpreting() else 128) // rows)
    out = torch.empty(B, Hq, nqb, nkt, dtype=torch.float32, device=q.device)
    programs = cdiv(nqb, blocks)
    d_pad = max(16, triton.next_power_of_2(D))
    _sampled_mass_kernel[(programs, B * Hq)](
        q, *q.stride(), k, *k.stride(), out,
        Hq, Hq // Hkv, nqb, nkt, Nq, Nk, programs, float(scale) * _LOG2E, TINY,
        BLOCK_M=block_m, BLOCK_N=block_n, EVERY=every, ROWS=rows, BLOCKS=blocks, D=D, D_PAD=d_pad,
        PREC=dot_precision(q.dtype), num_warps=8 if rows * blocks >= 128 else 4, num_stages=2,
    )
    return out
