"""Sampled-row tile mass on the GPU: the exact causal softmax of every k-th query row, summed per key tile.

Per (batch, query head, query block of BLOCK_M rows): the block's sampled rows are rows EVERY-1, 2*EVERY-1, ... of
the block (its last row among them; in a ragged last block, rows past its end are replaced by its last row). Each
sampled row's softmax over every key it sees is computed exactly, and the mass it puts in each key tile of
BLOCK_N keys is averaged over the block's sampled rows. The selector ranks tiles by that mass: a lookup is one
query row and one key, and pooled means dilute both, where sampled rows see them whole.

One program serves BLOCKS consecutive query blocks of HEADS query heads of one KV head (HEADS * BLOCKS * BLOCK_M /
EVERY rows on the tensor cores, each key tile loaded once for all of them) in two passes over the keys they see:
the rows' max and sum of exp, then each tile's mass; tiles that every row sees whole skip the position test. Output: the log of the mass (plus ``TINY``) per visible tile, so the mass
selection's softmax of it is the mass itself. A sampled row that scores a key it sees as NaN or +inf makes its
row sum NaN, hence every tile of its block NaN: the block keeps every visible tile (as a block with non-finite
pooled statistics does everywhere in selection); no score is tested one by one. A -inf score weighs nothing, as in
dense attention. Tiles no query of the block sees are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot, dot_precision, jit_any_length, launchable
from .fp8 import quantize_heads, quantize_rows
from .strided_rows import load_key_tile, program_blocks, program_keys, program_rows, program_shape, rows_per_block
from .validate import cdiv

__all__ = ["TINY", "sampled_mass_logits"]

_LOG2E = 1.4426950408889634
#: added to a tile's mass before the log, so that a tile with no mass has a finite (very low) score
TINY = 1e-30


@triton.jit
def _row_stats_inner(q, k_base, m, s, qpos, t0, t1, stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask,
                     BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Pass 1 over key tiles [t0, t1): each row's running max (in the row's units; ``qk_scale`` per row makes them
    log2 logits) and sum of exp2, online. Only MASKED tiles compare positions; a NaN or +inf score makes its row's
    sum NaN (no per-score finiteness test)."""
    for t in range(t0, t1):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        if MASKED:
            z = tl.where(keys[None, :] <= qpos[:, None], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp2((m - m_new) * qk_scale) + tl.sum(tl.exp2(z * qk_scale[:, None] - (m_new * qk_scale)[:, None]),
                                                         1)
        m = m_new
    return m, s


@triton.jit
def _mass_inner(q, k_base, mb, inv, qpos, live_blocks, qmax, out_rows, t0, t1, stride_kn, stride_kd, NUM_KEYS,
                qk_scale, tiny, d, dmask, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, PREC: tl.constexpr):
    """Pass 2 over key tiles [t0, t1): each tile's mass, summed over each (head, block)'s rows, stored as its log."""
    for t in range(t0, t1):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        p = tl.exp2(z * qk_scale[:, None] - mb[:, None])
        if MASKED:
            p = tl.where(keys[None, :] <= qpos[:, None], p, 0.0)
        mass = tl.sum(tl.reshape(tl.sum(p, 1) * inv, (GROUPS, ROWS)), 1)
        tl.store(out_rows + t, tl.log(mass + tiny), mask=live_blocks & (t * BLOCK_N <= qmax))


@jit_any_length
def _sampled_mass_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd, k_scale_ptr,
    out_ptr,
    HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, NUM_PROGRAMS, scale, tiny,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVERY: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
):
    GROUPS: tl.constexpr = HEADS * BLOCKS
    M: tl.constexpr = GROUPS * ROWS
    q, qpos, live, b, h0, hk, g, blk, whole, num_tiles = program_rows(
        q_ptr, stride_qb, stride_qh, stride_qn, stride_qd, HQ, GROUP, NUM_QUERY_BLOCKS, NUM_QUERIES, NUM_KEYS,
        NUM_PROGRAMS, BLOCK_M, BLOCK_N, EVERY, ROWS, BLOCKS, HEADS, D, D_PAD)
    k_base, d, dmask = program_keys(k_ptr, b, hk, stride_kb, stride_kh, D, D_PAD)
    if FP8:  # rows quantized here, keys before the launch (kernels.fp8); scores in each row's units
        q, q_scale = quantize_rows(q)
        qk_scale = q_scale * (tl.load(k_scale_ptr + b * (HQ // GROUP) + hk) * scale)
    else:
        qk_scale = tl.full([M], scale, tl.float32)
    m = tl.full([M], -1.0e30, tl.float32)
    s = tl.zeros([M], tl.float32)
    m, s = _row_stats_inner(q, k_base, m, s, qpos, 0, whole, stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask,
                            BLOCK_N, False, PREC)
    m, s = _row_stats_inner(q, k_base, m, s, qpos, whole, num_tiles, stride_kn, stride_kd, NUM_KEYS, qk_scale, d,
                            dmask, BLOCK_N, True, PREC)
    # each row's share of its block's mean: 1 / (sum of exp * rows); a NaN sum stays NaN (the block keeps all)
    inv = 1.0 / (s * ROWS)
    mb = m * qk_scale
    out_rows, live_blocks, qmax = program_blocks(out_ptr, b, h0, g, HQ, NUM_QUERY_BLOCKS, NUM_KEY_TILES,
                                                 NUM_QUERIES, NUM_KEYS, BLOCK_M, BLOCKS, HEADS)
    _mass_inner(q, k_base, mb, inv, qpos, live_blocks, qmax, out_rows, 0, whole, stride_kn, stride_kd, NUM_KEYS,
                qk_scale, tiny, d, dmask, BLOCK_N, GROUPS, ROWS, False, PREC)
    _mass_inner(q, k_base, mb, inv, qpos, live_blocks, qmax, out_rows, whole, num_tiles, stride_kn, stride_kd,
                NUM_KEYS, qk_scale, tiny, d, dmask, BLOCK_N, GROUPS, ROWS, True, PREC)


def sampled_mass_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block_m: int, block_n: int,
                        every: int, fp8: bool = False) -> torch.Tensor:
    """(B, Hq, nqb, nkt) float32: log(mean sampled-row mass of each visible tile + ``TINY``), NaN in every tile of
    a block whose sampled rows score a key as NaN or +inf; entries of tiles no query of the block sees are left
    unwritten.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), keys in order, queries the last Nq positions. ``every`` a power of two
    <= ``block_m``. ``fp8``: QK^T in e4m3 on the tensor cores (keys per (batch, KV head), rows each with its own
    scale: ``kernels.fp8``), where ``fp8_tensor_cores`` says so.
    """
    if every < 1 or every & (every - 1) or every > block_m:
        raise ValueError(f"sampled_mass_logits: every must be a power of two <= block_m={block_m}, got {every}")
    q, k = launchable(q), launchable(k)
    k_scale = None
    if fp8:
        k, k_scale = quantize_heads(k)  # raises where the device has no FP8
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb, nkt = cdiv(Nq, block_m), cdiv(Nk, block_n)
    rows = rows_per_block(block_m, every)
    heads, blocks, warps, stages = program_shape(Hq // Hkv, rows, fp8)
    out = torch.empty(B, Hq, nqb, nkt, dtype=torch.float32, device=q.device)
    programs = cdiv(nqb, blocks)
    d_pad = max(32 if fp8 else 16, triton.next_power_of_2(D))
    _sampled_mass_kernel[(programs, B * Hq // heads)](
        q, *q.stride(), k, *k.stride(), k if k_scale is None else k_scale, out,
        Hq, Hq // Hkv, nqb, nkt, Nq, Nk, programs, float(scale) * _LOG2E, TINY,
        BLOCK_M=block_m, BLOCK_N=block_n, EVERY=every, ROWS=rows, BLOCKS=blocks, HEADS=heads, D=D, D_PAD=d_pad,
        PREC="none" if fp8 else dot_precision(q.dtype), FP8=fp8, num_warps=warps, num_stages=stages,
    )
    return out
