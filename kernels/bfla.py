"""BFLA's selection on the GPU: flatten-g block scores, and the tile stage fused with the plan rows.

* ``bfla_block_scores``: the max-over-group-pairs scores of flattened groups as one tensor-core matmul with a max
  epilogue, causal region only. A block pair with a non-finite group product scores NaN (the mass rule then keeps
  it), whatever the hardware maximum does with NaN.
* ``bfla_tiles``: stage 2 on the tile grid per (batch, KV head, query tile): the OR of the group's coarse masks,
  expansion, local band, sink and the two hash rescues, straight into plan rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (TileGrid, dot, dot_precision, empty_plan_tables, interpreting, is_finite, jit_any_length,
                     mix32, physical_rows, plan_buckets, query_block_bounds, row_visibility, row_warps,
                     rows_per_program, runs_in_float32, split_heads, store_plan_rows)
from .reference import hash32
from .pooling import BlockPool
from .validate import cdiv

__all__ = ["bfla_block_scores", "bfla_tiles"]


@jit_any_length
def _bfla_scores_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    idx_ptr, stride_ib, stride_ih, stride_in,
    out_ptr,
    HQ, GROUP, NUM_QUERIES, NUM_KEYS, L, LQ, LK, SEGMENT_BOUND,
    COARSE: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HAS_INDEX: tl.constexpr,
    PREC: tl.constexpr,
):
    tl.static_assert(R == QB * NG and C == KB * NG)
    bh = tl.program_id(0)
    jt = tl.program_id(1)
    it = tl.program_id(2)
    b, h, hk = split_heads(bh, HQ, GROUP)
    _, qmax = query_block_bounds(it * QB + QB - 1, COARSE, NUM_QUERIES, NUM_KEYS)  # the program's last block
    # causal skip (the lower bound of any original position in the column block, see common.tile_limit)
    if (jt * KB * COARSE) // SEGMENT_BOUND * SEGMENT_BOUND <= qmax:
        u = it * R + tl.arange(0, R)  # query groups (flatten-g rows)
        v = jt * C + tl.arange(0, C)  # key groups
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        i_base = idx_ptr + b.to(tl.int64) * stride_ib + hk.to(tl.int64) * stride_ih
        acc = tl.zeros([R, C], tl.float32)
        klive = v < 0
        # <flatten(Q_u), flatten(K_v)> = sum over the offset t inside the group of <Q[u*G+t], K[v*G+t]>
        for t in range(G):
            qrow = u * G + t
            qa = tl.load(q_base + qrow.to(tl.int64)[:, None] * stride_qn + d[None, :] * stride_qd,
                         mask=(qrow[:, None] < NUM_QUERIES) & dmask[None, :], other=0.0)
            phys, kval = physical_rows(i_base, v * G + t, stride_in, v * G + t < L, NUM_KEYS, HAS_INDEX)
            klive = klive | kval
            ka = tl.load(k_base + phys.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                         mask=kval[:, None] & dmask[None, :], other=0.0)
            acc += dot(qa, tl.trans(ka), PREC)
        qlive = u * G < NUM_QUERIES
        live = qlive[:, None] & klive[None, :]
        nonfinite = live & (is_finite(acc) == 0)
        acc = tl.where(live & (nonfinite == 0), acc, -3.4028234663852886e38)
        # max over the group pairs of each (coarse query block, coarse key block); NaN where any live pair is not
        # finite (explicitly: the hardware maximum may drop a NaN operand)
        best = tl.max(tl.max(tl.reshape(acc, (QB, NG, KB, NG)), 3), 1)
        bad = tl.max(tl.max(tl.reshape(nonfinite.to(tl.int32), (QB, NG, KB, NG)), 3), 1)
        best = tl.where(bad > 0, float("nan"), best)
        a = it * QB + tl.arange(0, QB)
        c = jt * KB + tl.arange(0, KB)
        tl.store(out_ptr + (bh.to(tl.int64) * LQ + a[:, None]) * LK + c[None, :], best,
                 mask=(a[:, None] < LQ) & (c[None, :] < LK))


def bfla_block_scores(q: torch.Tensor, k: torch.Tensor, block: int, group: int,
                      key_index: Optional[torch.Tensor] = None, segment_bound: int = 1) -> torch.Tensor:
    """``sparse_compile.methods.bfla.bfla_block_scores`` (unscaled), causal region only: (B, Hq, LQ, LK) float32.

    ``segment_bound``: keys permuted inside segments of this many keys (1: in order), for the causal skip.
    """
    if runs_in_float32(q.dtype):
        q, k = q.float(), k.float()
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = key_index.shape[-1] if key_index is not None else Nk
    LQ, LK = cdiv(Nq, block), cdiv(L, block)
    groups = block // group
    out = torch.empty(B, Hq, LQ, LK, dtype=torch.float32, device=q.device)
    d_pad = max(16, triton.next_power_of_2(D))
    if interpreting():
        rows = 16
    else:
        rows = 64 if LQ * groups <= 256 else 128
    rows = max(rows, groups)
    blocks_per_program = rows // groups
    idx = key_index if key_index is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
    grid = (B * Hq, triton.cdiv(LK, blocks_per_program), triton.cdiv(LQ, blocks_per_program))
    _bfla_scores_kernel[grid](
        q, *q.stride(), k, *k.stride(), idx, *idx.stride(), out,
        Hq, Hq // Hkv, Nq, Nk, L, LQ, LK, segment_bound,
        COARSE=block, G=group, NG=groups, QB=blocks_per_program, KB=blocks_per_program,
        R=blocks_per_program * groups, C=blocks_per_program * groups, D=D, D_PAD=d_pad,
        HAS_INDEX=key_index is not None, PREC=dot_precision(q.dtype), num_warps=8 if rows >= 128 else 4,
        num_stages=3,
    )
    return out


@jit_any_length
def _bfla_tiles_kernel(
    mass_ptr,
    kmin_ptr, kmax_ptr, kpad_ptr,
    offs_ptr, stride_pb, stride_ph, stride_pi, cnt_ptr, msk_ptr,
    HKV, GROUP, NUM_QUERY_TILES, NUM_KEY_TILES, LQ, LK, NUM_QUERIES, NUM_KEYS, ROW0, ROW1,
    local_tiles, sink_tiles, stride, seed_stride, seed_random, random_threshold,
    TILE_Q: tl.constexpr, TILE_K: tl.constexpr, COARSE: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, STRIDE_ON: tl.constexpr, RANDOM_ON: tl.constexpr, KEEP_ALL: tl.constexpr,
):
    i = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < ROW1
    bh = tl.program_id(1)  # (batch, KV head): the tile mask is shared by the GQA group
    b, hk, _ = split_heads(bh, HKV, 1)
    row = bh.to(tl.int64) * NUM_QUERY_TILES + i
    qmin, qmax = query_block_bounds(i, TILE_Q, NUM_QUERIES, NUM_KEYS)
    j = tl.arange(0, W)
    jin = j < NUM_KEY_TILES
    vis, part, kmin = row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr,
                                     bh.to(tl.int64) * NUM_KEY_TILES, NUM_KEYS, TILE_K, HAS_POSITIONS)
    vis = vis & rin[:, None]
    if KEEP_ALL:
        keep = vis
    else:
        ci = (i * TILE_Q) // COARSE
        cj = (j * TILE_K) // COARSE
        keep = vis & (j < 0)[None, :]
        for p in range(GROUP):  # OR of the group's query heads (the paper's tile mask is per KV head)
            mrow = ((b.to(tl.int64) * HKV + hk) * GROUP + p) * LQ + ci
            m = tl.load(mass_ptr + mrow[:, None] * LK + cj[None, :], mask=vis & (cj < LK)[None, :], other=0)
            keep = keep | (m != 0)
        first = qmin // TILE_K - local_tiles  # the band: the query tile's own key tiles and local_tiles before
        last = qmax // TILE_K
        keep = keep | ((j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])) | (j < sink_tiles)[None, :]
        if STRIDE_ON:
            hi = mix32(tl.cast(seed_stride, tl.uint32) ^ i.to(tl.uint32))
            chi = mix32(hi[:, None] ^ j.to(tl.uint32)[None, :])
            keep = keep | (vis & (keep == 0) & (chi % tl.cast(stride, tl.uint32) == 0))
        if RANDOM_ON:
            hh = mix32(mix32(tl.cast(seed_random, tl.uint32) ^ hk.to(tl.uint32)) ^ i.to(tl.uint32))
            psi = mix32(hh[:, None] ^ j.to(tl.uint32)[None, :])
            keep = keep | (vis & (keep == 0) & (psi.to(tl.int64) < random_threshold))
        keep = keep & vis
    obase = offs_ptr + b.to(tl.int64) * stride_pb + hk.to(tl.int64) * stride_ph + i.to(tl.int64) * stride_pi
    store_plan_rows(keep, part, j, jin, rin, obase, cnt_ptr, msk_ptr, row, NUM_KEY_TILES, TILE_K, W)


def bfla_tiles(grid: TileGrid, coarse_keep: Optional[torch.Tensor], *, coarse: int, local_tiles: int,
               sink_tiles: int, stride: int, stride_seed: int, random_rescue: float, random_seed: int,
               key_tiles: Optional[BlockPool] = None, segment: int = 0):
    """BFLA stage 2 on the tile grid (``grid``: query tiles x key tiles), per (batch, KV head, query tile),
    straight into plan rows.

    ``coarse_keep`` int8 (B, Hq, LQ, LK): the coarse mass mask per query head (``mass_select(keep_table=True)``),
    OR-ed over the GQA group here; None keeps every visible tile. The stride rescue keeps a dropped tile (i, j)
    when ``hash32(stride_seed, i, j) % stride == 0``, the random rescue when ``hash32(random_seed, kv_head, i, j)
    < random_rescue * 2^32``. ``key_tiles``: the key tiles' positions under a permutation (segments of
    ``segment`` keys). Returns ``PlanTables`` with one row per (batch, KV head).
    """
    nqt, nkt = grid.num_query_blocks, grid.num_key_tiles
    LQ, LK = cdiv(grid.num_queries, coarse), cdiv(grid.key_length, coarse)
    tables = empty_plan_tables(grid.batch, grid.kv_heads, nqt, nkt, grid.device)
    offs, cnt, msk = tables
    dummy = torch.empty(1, dtype=torch.int32, device=grid.device)
    permuted = key_tiles is not None and key_tiles.min_position is not None
    mass = coarse_keep if coarse_keep is not None else torch.empty(1, dtype=torch.int8, device=grid.device)
    # the first step of each hash chain (the seed's own mix) on the host
    seed_stride, seed_random = int(hash32(stride_seed)), int(hash32(random_seed))
    segment_bound = segment if (segment and permuted) else 1
    for r0, r1, width in plan_buckets(nqt, nkt, grid.block_m, grid.block_n, grid.num_queries, grid.num_keys,
                                      segment_bound):
        rows = rows_per_program(width, r1 - r0)
        _bfla_tiles_kernel[(triton.cdiv(r1 - r0, rows), grid.batch * grid.kv_heads)](
            mass, key_tiles.min_position if permuted else dummy, key_tiles.max_position if permuted else dummy,
            key_tiles.has_padding if permuted else dummy,
            offs, offs.stride(0), offs.stride(1), offs.stride(2), cnt, msk,
            grid.kv_heads, grid.heads // grid.kv_heads, nqt, nkt, LQ, LK, grid.num_queries, grid.num_keys, r0, r1,
            int(local_tiles), int(sink_tiles), max(1, int(stride)), seed_stride, seed_random,
            int(random_rescue * 2**32),
            TILE_Q=grid.block_m, TILE_K=grid.block_n, COARSE=coarse, W=width, ROWS=rows, HAS_POSITIONS=permuted,
            STRIDE_ON=stride > 0, RANDOM_ON=random_rescue > 0, KEEP_ALL=coarse_keep is None,
            num_warps=row_warps(rows, width),
        )
    return tables
