"""Sampled-row tile mass on the GPU: every k-th query row's exact exp-scores, summed per key tile, each row's over
an estimate of its softmax normaliser (``methods.sampled``, steps 1-3, is the specification).

Per (batch, query head, query block of BLOCK_M rows): the block's sampled rows are rows EVERY-1, 2*EVERY-1, ... of
the block (its last row among them; in a ragged last block, rows past its end are replaced by its last row). A
row's forced region is the keys it sees in its block's diagonal tiles, the LOCAL tiles before them and, with
KEEP_FIRST, tile 0 (the tiles every plan keeps); of the tiles before the region, those with t % FAR_STRIDE ==
FAR_STRIDE - 1 are sampled. Its normaliser's estimate: its exp-scores' sum in the region, plus the largest sampled
far tile's, plus FAR_STRIDE times the other sampled far tiles'. A tile's mass: the sum over the block's rows of
their exp-scores in the tile over their estimates. The region and the sampled far tiles are a few tiles per block,
so the statistics come first and the masses in one pass (the exact normaliser would need a pass over every key).

One program serves BLOCKS consecutive query blocks of HEADS query heads of one KV head (HEADS * BLOCKS * BLOCK_M /
EVERY rows on the tensor cores, each key tile loaded once for all of them): the statistics (tile 0, the sampled
far tiles, the tiles from the first block's region on), then one pass over every tile the program sees, storing
each tile's mass as it goes; tiles that every row sees whole skip the position test. Output: the log of the mass
(plus ``TINY``) per visible tile. A row whose masses sum to ``LIMIT`` or more, or to NaN (a NaN or +inf score it
sees, or statistics that weigh nothing), makes its block NaN in every visible tile: the block keeps every visible
tile (as a block with non-finite pooled statistics does everywhere in selection); no score is tested one by one. A
-inf score weighs nothing, as in dense attention. What the sampled rows cannot see, after the launch
(``kernels.mass.keep_nonfinite``: whether a row scores a key with an infinite element +inf or -inf depends on the
row, ``methods.sampled``): NaN in every visible tile of a block with a NaN or infinite element in any row, and in
the tiles with one in a key, in every block that sees them. Tiles no query of the block sees are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot, dot_precision, jit_any_length, runs_in_float32
from .fp8 import quantize_heads, quantize_rows
from .mass import keep_nonfinite
from .strided_rows import load_key_tile, program_blocks, program_keys, program_rows, program_shape, rows_per_block
from .validate import cdiv

__all__ = ["TINY", "LIMIT", "FAR_STRIDE", "sampled_mass_logits"]

_LOG2E = 1.4426950408889634
#: added to a tile's mass before the log, so that a tile with no mass has a finite (very low) score
TINY = 1e-30
#: a row whose masses sum to LIMIT or beyond (or to NaN): its block keeps every visible tile
LIMIT = 2.0 ** 64
#: every FAR_STRIDE-th tile before a row's forced region estimates its far mass
FAR_STRIDE = 8


@triton.jit
def _normaliser_inner(q, k_base, m, f, far, far_max, qpos, lo, t0, t1, step, stride_kn, stride_kd, NUM_KEYS,
                      qk_scale, d, dmask, BLOCK_N: tl.constexpr, KEEP_FIRST: tl.constexpr, FAR_STRIDE: tl.constexpr,
                      PREC: tl.constexpr):
    """Tiles t0, t0 + step, ... < t1: each row's running max (in the row's units), its sum of exp2 over the keys it
    sees in its forced region (keys from ``lo`` on and, with KEEP_FIRST, tile 0), and over the sampled far tiles
    (t % FAR_STRIDE == FAR_STRIDE - 1, before ``lo``) their sum and largest tile sum."""
    for t in range(t0, t1, step):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        region = keys[None, :] >= lo[:, None]
        if KEEP_FIRST:
            region = region | (keys < BLOCK_N)[None, :]
        seen = keys[None, :] <= qpos[:, None]
        sampled = (t % FAR_STRIDE) == FAR_STRIDE - 1
        counted = seen & (region | sampled)
        z = tl.where(counted, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        decay = tl.exp2((m - m_new) * qk_scale)
        e = tl.exp2(z * qk_scale[:, None] - (m_new * qk_scale)[:, None])
        in_region = tl.sum(tl.where(region, e, 0.0), 1)
        tile_far = tl.sum(e, 1) - in_region
        f = f * decay + in_region
        far = far * decay + tile_far
        far_max = tl.maximum(far_max * decay, tile_far)
        m = m_new
    return m, f, far, far_max


@triton.jit
def _mass_inner(q, k_base, mb, inv, total, qpos, live_blocks, qmax, out_rows, t0, t1, stride_kn, stride_kd,
                NUM_KEYS, qk_scale, tiny, d, dmask, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                MASKED: tl.constexpr, PREC: tl.constexpr):
    """Tiles [t0, t1): each tile's mass, summed over each (head, block)'s rows, stored as its log as it goes;
    ``total`` sums each row's masses (a NaN or +inf score turns it non-finite). Only MASKED tiles compare positions."""
    for t in range(t0, t1):
        keys, kt = load_key_tile(k_base, t, stride_kn, stride_kd, NUM_KEYS, d, dmask, BLOCK_N)
        z = dot(q, tl.trans(kt), PREC)
        p = tl.exp2(z * qk_scale[:, None] - mb[:, None])
        if MASKED:
            p = tl.where(keys[None, :] <= qpos[:, None], p, 0.0)
        row_mass = tl.sum(p, 1) * inv
        total += row_mass
        mass = tl.sum(tl.reshape(row_mass, (GROUPS, ROWS)), 1)
        tl.store(out_rows + t, tl.log(mass + tiny), mask=live_blocks & (t * BLOCK_N <= qmax))
    return total


@jit_any_length
def _sampled_mass_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd, k_scale_ptr,
    out_ptr,
    HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, NUM_PROGRAMS, LOCAL, scale, tiny, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVERY: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    HEADS: tl.constexpr, KEEP_FIRST: tl.constexpr, FAR_STRIDE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PREC: tl.constexpr, FP8: tl.constexpr,
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
    # the forced region: each row's block's diagonal tiles, the LOCAL tiles before them and (KEEP_FIRST) tile 0
    offset = NUM_KEYS - NUM_QUERIES
    lo = ((blk * BLOCK_M + offset) // BLOCK_N - LOCAL) * BLOCK_N
    first_region_tile = tl.maximum((g * BLOCKS * BLOCK_M + offset) // BLOCK_N - LOCAL, 0)  # of the program
    m = tl.full([M], -1.0e30, tl.float32)
    f = tl.zeros([M], tl.float32)
    far = tl.zeros([M], tl.float32)
    far_max = tl.zeros([M], tl.float32)
    if KEEP_FIRST:
        m, f, far, far_max = _normaliser_inner(q, k_base, m, f, far, far_max, qpos, lo, 0,
                                               tl.minimum(1, first_region_tile), 1, stride_kn, stride_kd, NUM_KEYS,
                                               qk_scale, d, dmask, BLOCK_N, KEEP_FIRST, FAR_STRIDE, PREC)
    # the sampled far tiles every row of the program sees whole, then the region's tiles (where later blocks' rows
    # may still find sampled far tiles)
    m, f, far, far_max = _normaliser_inner(q, k_base, m, f, far, far_max, qpos, lo, FAR_STRIDE - 1, first_region_tile,
                                           FAR_STRIDE, stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask, BLOCK_N,
                                           KEEP_FIRST, FAR_STRIDE, PREC)
    m, f, far, far_max = _normaliser_inner(q, k_base, m, f, far, far_max, qpos, lo, first_region_tile, num_tiles, 1,
                                           stride_kn, stride_kd, NUM_KEYS, qk_scale, d, dmask, BLOCK_N, KEEP_FIRST,
                                           FAR_STRIDE, PREC)
    # each row's normaliser: its region's sum and its far mass estimated from every FAR_STRIDE-th far tile (the
    # largest counted once, so that one far lookup is not multiplied)
    inv = 1.0 / (f + far_max + FAR_STRIDE * (far - far_max))
    mb = m * qk_scale
    out_rows, live_blocks, qmax = program_blocks(out_ptr, b, h0, g, HQ, NUM_QUERY_BLOCKS, NUM_KEY_TILES,
                                                 NUM_QUERIES, NUM_KEYS, BLOCK_M, BLOCKS, HEADS)
    total = tl.zeros([M], tl.float32)
    total = _mass_inner(q, k_base, mb, inv, total, qpos, live_blocks, qmax, out_rows, 0, whole, stride_kn, stride_kd,
                        NUM_KEYS, qk_scale, tiny, d, dmask, BLOCK_N, GROUPS, ROWS, False, PREC)
    total = _mass_inner(q, k_base, mb, inv, total, qpos, live_blocks, qmax, out_rows, whole, num_tiles, stride_kn,
                        stride_kd, NUM_KEYS, qk_scale, tiny, d, dmask, BLOCK_N, GROUPS, ROWS, True, PREC)
    # a row whose masses sum to ``limit`` or more, or to NaN (a NaN or +inf score): its block keeps every visible tile
    bad = (live & ((total < limit) == 0)).to(tl.int32)
    block_bad = tl.max(tl.reshape(bad, (GROUPS, ROWS)), 1) > 0
    if tl.max(block_bad.to(tl.int32), 0) > 0:
        for t in range(0, num_tiles):
            tl.store(out_rows + t, tl.full([GROUPS], float("nan"), tl.float32),
                     mask=block_bad & live_blocks & (t * BLOCK_N <= qmax))


def sampled_mass_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block_m: int, block_n: int,
                        every: int, fp8: bool = False, local: int = 0, keep_first: bool = True) -> torch.Tensor:
    """(B, Hq, nqb, nkt) float32: log(sum over the sampled rows of each's mass in each visible tile over its
    normaliser's estimate + ``TINY``), NaN in every tile of a block with a row whose masses sum to ``LIMIT`` or more
    or to NaN or with a non-finite query element in any row, and in the tiles with a non-finite key element that a
    block sees; entries of tiles no query of the block sees are left unwritten. The forced region: ``local`` tiles
    before each block's diagonal, the diagonal tiles and, with ``keep_first``, tile 0.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D), keys in order, queries the last Nq positions. ``every`` a power of two
    <= ``block_m``. ``fp8``: QK^T in e4m3 on the tensor cores (keys per (batch, KV head), rows each with its own
    scale: ``kernels.fp8``), where ``fp8_tensor_cores`` says so.
    """
    if every < 1 or every & (every - 1) or every > block_m:
        raise ValueError(f"sampled_mass_logits: every must be a power of two <= block_m={block_m}, got {every}")
    if runs_in_float32(q.dtype):
        q, k = q.float(), k.float()
    keys, k_scale = k, None  # keys: before any FP8 rounding
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
        Hq, Hq // Hkv, nqb, nkt, Nq, Nk, programs, int(local), float(scale) * _LOG2E, TINY, LIMIT,
        BLOCK_M=block_m, BLOCK_N=block_n, EVERY=every, ROWS=rows, BLOCKS=blocks, HEADS=heads, KEEP_FIRST=keep_first,
        FAR_STRIDE=FAR_STRIDE, D=D, D_PAD=d_pad,
        PREC="none" if fp8 else dot_precision(q.dtype), FP8=fp8, num_warps=warps, num_stages=stages,
    )
    return keep_nonfinite(out, q, keys, block_m, block_n)  # what the sampled rows cannot see
