"""Block pooling: one pass over Q or K for every pooled statistic, and pooled-query x pooled-key scores.

* ``block_pool``: per block of rows (optionally read through a logical -> physical key index): the mean,
  SpargeAttn's mean cosine self-similarity, the min/max original key position and a padding flag (the visibility
  inputs of a permuted tiling), and a per-row dot product with a per-KV-head "guide" vector, optionally sorted
  inside each block (S2O's query order).
* ``pooled_logits``: pooled-query x pooled-key scores per GQA group without repeating keys, only in the causal
  region (tiles no query of a block can see are never computed, and never read).

Non-finite rows: the mean and the similarity of a block holding one are non-finite (the selectors then keep that
block), unless ``finite_rows_mean`` leaves such rows out of the mean (S2O's segment means, which rank keys);
a guide dot product that is not finite is stored as +inf (it sorts first).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import (dot, dot_precision, interpreting, is_finite, jit_any_length, launchable, orderable, physical_rows,
                     pow2, query_block_bounds, split_heads, tile_limit)
from .sorting import segmented_argsort_desc
from .validate import cdiv

__all__ = ["BlockPool", "block_pool", "pooled_logits"]

#: blocks at least this long are read in a loop with row sums kept across chunks (shorter: reduced per chunk)
LONG_BLOCK = 1024


class BlockPool(NamedTuple):
    """What ``block_pool`` computed (None where not asked for), per (batch, head, block) unless noted.

    mean          float32 (B, H, nb, D), over the block's valid rows.
    similarity    float32 (B, H, nb): SpargeAttn's mean cosine self-similarity (``block_self_similarity``).
    min_position  int32 (B, H, nb): the earliest valid original position (INT32_MAX when none).
    max_position  int32 (B, H, nb): the latest valid original position (-1 when none).
    has_padding   int32 (B, H, nb): 1 when the block holds padding entries or rows past the end.
    guide_score   float32 (B, H, L): each row's dot product with its guide vector (non-finite stored as +inf).
    guide_order   int32 (B, H, L): inside each block, the rows by descending ``guide_score`` (stable).
    """

    mean: Optional[torch.Tensor] = None
    similarity: Optional[torch.Tensor] = None
    min_position: Optional[torch.Tensor] = None
    max_position: Optional[torch.Tensor] = None
    has_padding: Optional[torch.Tensor] = None
    guide_score: Optional[torch.Tensor] = None
    guide_order: Optional[torch.Tensor] = None


@triton.jit
def _rows_to_slots(x, ROW_SLOTS: tl.constexpr):
    """(blocks, CHUNK, D) -> (blocks, ROW_SLOTS, D): as is, or summed over the rows when ROW_SLOTS is 1."""
    if ROW_SLOTS == 1:
        return tl.sum(x, 1, keep_dims=True)
    else:
        return x


@jit_any_length
def _pool_kernel(
    x_ptr, stride_xb, stride_xh, stride_xn, stride_xd,
    idx_ptr, stride_ib, stride_ih, stride_in,
    guide_ptr, stride_gb, stride_gh,
    mean_ptr, sim_ptr, kmin_ptr, kmax_ptr, kpad_ptr, gdot_ptr, order_ptr,
    H, L, N, NUM_BLOCKS, GUIDE_DIV,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, HAS_INDEX: tl.constexpr, WANT_MEAN: tl.constexpr, WANT_SIM: tl.constexpr,
    WANT_POS: tl.constexpr, WANT_GUIDE: tl.constexpr, SORT_GUIDE: tl.constexpr, FINITE_ROWS_MEAN: tl.constexpr,
    ROW_SLOTS: tl.constexpr,
):
    tl.static_assert(not SORT_GUIDE or (BLOCKS_PER_PROGRAM == 1 and WANT_GUIDE))
    tl.static_assert(ROW_SLOTS == 1 or ROW_SLOTS == CHUNK)
    # BLOCKS_PER_PROGRAM blocks per program, each read CHUNK rows at a time: tiles (blocks, CHUNK, D_PAD)
    blk = tl.program_id(0) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    bh = tl.program_id(1)
    b, h, _ = split_heads(bh, H, 1)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    d3 = offs_d[None, None, :]
    x_base = x_ptr + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    i_base = idx_ptr + b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih
    if WANT_GUIDE:
        gvec = tl.load(guide_ptr + b.to(tl.int64) * stride_gb + (h // GUIDE_DIV).to(tl.int64) * stride_gh + offs_d,
                       mask=dmask, other=0.0)
    # over several chunks, sums are kept per row slot (ROW_SLOTS = CHUNK) and reduced over rows once after the
    # loop: a reduction over rows crosses warps (shared memory and barriers) and inside the loop it stalled every
    # chunk's loads; with one chunk (ROW_SLOTS = 1) the rows are reduced at once
    acc = tl.zeros([BLOCKS_PER_PROGRAM, ROW_SLOTS, D_PAD], tl.float32)
    acc_unit = tl.zeros([BLOCKS_PER_PROGRAM, ROW_SLOTS, D_PAD], tl.float32)
    cnt = tl.zeros([BLOCKS_PER_PROGRAM, CHUNK], tl.int32)
    mean_cnt = tl.zeros([BLOCKS_PER_PROGRAM, CHUNK], tl.int32)
    kmin = tl.full([BLOCKS_PER_PROGRAM, CHUNK], 2147483647, tl.int32)
    kmax = tl.full([BLOCKS_PER_PROGRAM, CHUNK], -1, tl.int32)
    pad = tl.zeros([BLOCKS_PER_PROGRAM, CHUNK], tl.int32)
    for r0 in range(0, BLOCK, CHUNK):
        loc = r0 + tl.arange(0, CHUNK)
        rows = blk[:, None] * BLOCK + loc[None, :]
        in_blk = (loc < BLOCK)[None, :] & (blk < NUM_BLOCKS)[:, None]  # a block not a power of two ends early
        inb = in_blk & (rows < L)
        phys, valid = physical_rows(i_base, rows, stride_in, inb, N, HAS_INDEX)
        ptrs = x_base + phys.to(tl.int64)[:, :, None] * stride_xn + d3 * stride_xd
        x = tl.load(ptrs, mask=valid[:, :, None] & (d3 < D), other=0.0).to(tl.float32)
        cnt += valid.to(tl.int32)
        if WANT_MEAN:
            if FINITE_ROWS_MEAN:
                row_finite = tl.sum((is_finite(x) == 0).to(tl.int32), 2) == 0
                acc += _rows_to_slots(tl.where(row_finite[:, :, None], x, 0.0), ROW_SLOTS)
                mean_cnt += (valid & row_finite).to(tl.int32)
            else:
                acc += _rows_to_slots(x, ROW_SLOTS)
                mean_cnt += valid.to(tl.int32)
        if WANT_SIM:
            # one reciprocal per row instead of a division per element
            inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 2)), 1.1754943508222875e-38)
            acc_unit += _rows_to_slots(x * inv[:, :, None], ROW_SLOTS)
        if WANT_POS:
            kmin = tl.minimum(kmin, tl.where(valid, phys, 2147483647))
            kmax = tl.maximum(kmax, tl.where(valid, phys, -1))
            pad = pad | (in_blk & (valid == 0)).to(tl.int32)  # rows past L are padding too (block_visibility)
        if WANT_GUIDE:
            score = tl.sum(x * gvec[None, None, :], 2)
            tl.store(gdot_ptr + bh.to(tl.int64) * L + rows, tl.where(is_finite(score), score, float("inf")),
                     mask=inb)
    n = tl.sum(cnt, 1)
    live = blk < NUM_BLOCKS
    out = bh.to(tl.int64) * NUM_BLOCKS + blk
    if WANT_MEAN:
        n_mean = tl.maximum(tl.sum(mean_cnt, 1), 1).to(tl.float32)
        tl.store(mean_ptr + out[:, None] * D + offs_d[None, :], tl.sum(acc, 1) / n_mean[:, None],
                 mask=live[:, None] & dmask[None, :])
    if WANT_SIM:
        nf = n.to(tl.float32)
        unit = tl.sum(acc_unit, 1)
        tl.store(sim_ptr + out, tl.sum(unit * unit, 1) / tl.maximum(nf * nf, 1.0), mask=live)
    if WANT_POS:
        tl.store(kmin_ptr + out, tl.min(kmin, 1), mask=live)
        tl.store(kmax_ptr + out, tl.max(kmax, 1), mask=live)
        tl.store(kpad_ptr + out, tl.max(pad, 1), mask=live)
    if SORT_GUIDE:
        # S2O's query sort, fused: this program holds one whole segment, whose row scores it has just written;
        # read them back (the barrier orders the CTA's global stores and loads) and sort them descending, ties by
        # lower index (a stable sort), with packed 64-bit keys
        tl.debug_barrier()
        loc = tl.arange(0, BLOCK)
        rows = blk * BLOCK + loc  # one block per program: blk has one entry
        inb = rows < L
        score = tl.load(gdot_ptr + bh.to(tl.int64) * L + rows, mask=inb, other=0.0)
        key = (orderable(score).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)
        key = tl.where(inb, key, -9223372036854775807)  # rows past the end sort last
        srt = tl.sort(key, descending=True)
        seg0 = tl.sum(blk, 0) * BLOCK
        idx = seg0 + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
        tl.store(order_ptr + bh.to(tl.int64) * L + rows, idx, mask=inb)


def block_pool(x: torch.Tensor, block: int, *, key_index: Optional[torch.Tensor] = None, want_mean: bool = True,
               want_similarity: bool = False, want_positions: bool = False, guide: Optional[torch.Tensor] = None,
               sort_guide: bool = False, finite_rows_mean: bool = False) -> BlockPool:
    """One pass over ``x`` (B, H, N, D) in blocks of ``block`` logical rows (see ``BlockPool``).

    ``key_index`` (B, H, L) int32 reads logical row p from physical row key_index[p] (< 0: padding).
    ``guide`` (B, Hg, D), Hg dividing H: ``guide_score`` is each row's dot product with ``guide[b, h // (H/Hg)]``;
    ``sort_guide`` adds ``guide_order`` (= ``segmented_argsort_desc(guide_score, block, nb)``, fused into the same
    program when the block is a power of two <= 4096). ``finite_rows_mean``: rows holding a non-finite value are
    left out of the mean (by default they make it non-finite).
    """
    x = launchable(x)
    B, H, N, D = x.shape
    L = key_index.shape[-1] if key_index is not None else N
    nb = cdiv(L, block)
    dev = x.device
    f32 = torch.float32
    mean = torch.empty(B, H, nb, D, dtype=f32, device=dev) if want_mean else None
    sim = torch.empty(B, H, nb, dtype=f32, device=dev) if want_similarity else None
    kmin = kmax = kpad = None
    if want_positions:
        kmin, kmax, kpad = (torch.empty(B, H, nb, dtype=torch.int32, device=dev) for _ in range(3))
    gdot = torch.empty(B, H, L, dtype=f32, device=dev) if guide is not None else None
    fuse_sort = sort_guide and guide is not None and block & (block - 1) == 0 and block <= 4096
    order = torch.empty(B, H, L, dtype=torch.int32, device=dev) if fuse_sort else None
    dummy = torch.empty(1, dtype=f32, device=dev)
    idx = key_index if key_index is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=dev)
    g = guide.float().contiguous() if guide is not None else torch.empty(1, 1, 1, dtype=f32, device=dev)
    d_pad = max(16, triton.next_power_of_2(D))
    budget = (1 << 16) if interpreting() else 8192  # elements per tile; the interpreter pays per program
    chunk = min(pow2(block), max(16, budget // d_pad))
    per_program = 1
    warps, row_slots = 4, 1
    if chunk >= block and not fuse_sort:  # small blocks: several per program (full, one chunk each)
        per_program = max(1, min(pow2(nb), budget // (chunk * d_pad)))
    elif block >= LONG_BLOCK:
        # long blocks (S2O's segments), read in a loop: row sums per row slot across chunks, and the launch shape
        # measured fastest on the H100 (docs/kernels.md): with few programs (S2O's guide key, one
        # per KV head) 16 warps reading 64 rows at D = 128, with many (its query pass, one per head and segment)
        # 4 warps reading 32
        if not interpreting():
            if nb * B * H < 64:
                warps = 16
            else:
                chunk = min(chunk, max(16, 4096 // d_pad))
        row_slots = chunk if chunk < block else 1

    def or_dummy(t):
        return t if t is not None else dummy

    _pool_kernel[(triton.cdiv(nb, per_program), B * H)](
        x, *x.stride(), idx, *idx.stride(), g, g.stride(0), g.stride(1),
        or_dummy(mean), or_dummy(sim), or_dummy(kmin), or_dummy(kmax), or_dummy(kpad), or_dummy(gdot),
        or_dummy(order),
        H, L, N, nb, max(1, H // g.shape[1]) if guide is not None else 1,
        BLOCK=block, BLOCKS_PER_PROGRAM=per_program, CHUNK=chunk, D=D, D_PAD=d_pad, HAS_INDEX=key_index is not None,
        WANT_MEAN=want_mean, WANT_SIM=want_similarity, WANT_POS=want_positions, WANT_GUIDE=guide is not None,
        SORT_GUIDE=fuse_sort, FINITE_ROWS_MEAN=finite_rows_mean, ROW_SLOTS=row_slots,
        num_warps=warps,
    )
    if sort_guide and guide is not None and order is None:
        order = segmented_argsort_desc(gdot, block, nb).to(torch.int32)
    return BlockPool(mean, sim, kmin, kmax, kpad, gdot, order)


@jit_any_length
def _pooled_logits_kernel(
    qm_ptr, km_ptr, out_ptr,
    HQ, GROUP, NUM_QUERY_BLOCKS, NUM_KEY_TILES, NUM_QUERIES, NUM_KEYS, SEGMENT_BOUND,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
):
    jt = tl.program_id(0)
    it = tl.program_id(1)
    bh = tl.program_id(2)
    b, h, hk = split_heads(bh, HQ, GROUP)
    _, qmax = query_block_bounds(tl.minimum(it * R + R, NUM_QUERY_BLOCKS) - 1, BLOCK_M, NUM_QUERIES, NUM_KEYS)
    # causal skip: nothing in this column block is visible to the row block's last (latest) query block
    if jt * C < tile_limit(qmax, SEGMENT_BOUND, BLOCK_N, NUM_KEY_TILES):
        i = it * R + tl.arange(0, R)
        j = jt * C + tl.arange(0, C)
        d = tl.arange(0, D_PAD)
        a = tl.load(qm_ptr + (bh.to(tl.int64) * NUM_QUERY_BLOCKS + i[:, None]) * D + d[None, :],
                    mask=(i[:, None] < NUM_QUERY_BLOCKS) & (d[None, :] < D), other=0.0)
        kb = (b.to(tl.int64) * (HQ // GROUP) + hk) * NUM_KEY_TILES
        bt = tl.load(km_ptr + (kb + j[:, None]) * D + d[None, :],
                     mask=(j[:, None] < NUM_KEY_TILES) & (d[None, :] < D), other=0.0)
        z = dot(a, tl.trans(bt), PREC)
        tl.store(out_ptr + (bh.to(tl.int64) * NUM_QUERY_BLOCKS + i[:, None]) * NUM_KEY_TILES + j[None, :], z,
                 mask=(i[:, None] < NUM_QUERY_BLOCKS) & (j[None, :] < NUM_KEY_TILES))


def pooled_logits(query_mean: torch.Tensor, key_mean: torch.Tensor, *, block_m: int, block_n: int,
                  num_queries: int, num_keys: int, segment_bound: int = 1) -> torch.Tensor:
    """``query_mean @ key_mean^T`` per GQA group (B, Hq, nqb, nkt) float32, unscaled.

    Entries of tiles that no query of the row's block can see (keys in order, or permuted inside segments of
    ``segment_bound`` keys) are left unwritten: selection never reads them.
    """
    B, Hq, nqb, D = query_mean.shape
    Hkv, nkt = key_mean.shape[1], key_mean.shape[2]
    out = torch.empty(B, Hq, nqb, nkt, dtype=torch.float32, device=query_mean.device)
    d_pad = max(16, triton.next_power_of_2(D))
    rows = cols = 16 if interpreting() else 64
    grid = (triton.cdiv(nkt, cols), triton.cdiv(nqb, rows), B * Hq)
    _pooled_logits_kernel[grid](
        query_mean.contiguous(), key_mean.contiguous(), out, Hq, Hq // Hkv, nqb, nkt, num_queries, num_keys,
        segment_bound, BLOCK_M=block_m, BLOCK_N=block_n, D=D, D_PAD=d_pad, R=rows, C=cols,
        PREC=dot_precision(torch.float32), num_warps=4,
    )
    return out
