"""S2O's reorder and select stages on the GPU.

* ``s2o_rank_keys``: every segment's causal prefix ranked by descending <segment query mean, key>, as one sort of
  packed (segment, score, position) 64-bit keys (a radix sort ranks every segment at once).
* ``s2o_assemble``: the logical key list: per segment its own keys (padded with -1), then its ranking.
* ``s2o_select``: the plan: intra-segment masked tiles, then the ranked prefix.

A non-finite score ranks first (as +inf; ties by position), so an early stop never passes a key whose scores
are not finite: dense attention would not be finite there either.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (PlanTables, dot, dot_precision, empty_plan_tables, interpreting, is_finite, launchable,
                     orderable, pow2, split_heads)
from .validate import cdiv

__all__ = ["s2o_rank_keys", "s2o_assemble", "s2o_select"]


@triton.jit
def _s2o_rank_keys_kernel(
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd, qm_ptr, out_ptr,
    HKV, NUM_SEGMENTS, SEGMENT, TOTAL, POSITION_BITS, SEGMENT_SHIFT, BH0, GROUP,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bh_local = tl.program_id(1)  # (batch, KV head) inside this chunk of them
    bh = BH0 + bh_local
    b, hk, _ = split_heads(bh, HKV, 1)
    t = c * BLOCK_T + tl.arange(0, BLOCK_T)
    tin = t < (NUM_SEGMENTS - 1) * SEGMENT
    d = tl.arange(0, D_PAD)
    dmask = d < D
    kt = tl.load(k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + t.to(tl.int64)[:, None] * stride_kn
                 + d[None, :] * stride_kd, mask=tin[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    n = tl.arange(0, G_PAD)
    nin = n < NUM_SEGMENTS
    # segment query means of the GQA group's heads, averaged (one ranking per KV group)
    qm = tl.zeros([G_PAD, D_PAD], tl.float32)
    for p in range(GROUP):
        hq = (b.to(tl.int64) * HKV + hk) * GROUP + p
        qm += tl.load(qm_ptr + (hq * NUM_SEGMENTS + n[:, None]) * D + d[None, :], mask=nin[:, None] & dmask[None, :],
                      other=0.0)
    qm = qm / GROUP
    sc = dot(kt, tl.trans(qm), PREC)  # (BLOCK_T, G_PAD): <q_mean[n], K[t]>
    sc = tl.where(is_finite(sc), sc, float("inf"))  # non-finite scores rank first
    use = tin[:, None] & nin[None, :] & (t[:, None] < n[None, :] * SEGMENT)  # segment n ranks its prefix [0, nS)
    # ascending packed key = (segment, descending score, position): one global sort ranks every segment
    desc = (2147483647 - orderable(sc).to(tl.int64))
    seg = (bh_local.to(tl.int64) * NUM_SEGMENTS + n).to(tl.int64)
    key = (seg[None, :] << SEGMENT_SHIFT) | (desc << POSITION_BITS) | t.to(tl.int64)[:, None]
    start = (n * (n - 1) // 2).to(tl.int64) * SEGMENT  # segment n's part of the (batch, head)'s list
    tl.store(out_ptr + bh_local.to(tl.int64) * TOTAL + start[None, :] + t[:, None], key, mask=use)


def s2o_rank_keys(k: torch.Tensor, query_mean: torch.Tensor, segment: int) -> tuple[torch.Tensor, int]:
    """Every segment's causal prefix ranked by descending <query_mean[n], K[t]> (stable): int64 (B, Hkv, TOT) with
    TOT = S * g * (g - 1) / 2; entry ``S*n*(n-1)/2 + r`` holds (in its low bits) the position of segment n's r-th
    key.

    ``query_mean`` (B, H, g, D) float32 segment means, H = Hkv (one ranking per KV head) or a multiple of it (the
    kernel then averages each GQA group's heads; slower: every program re-reads the group's means).

    Returns (sorted packed keys, number of low bits that hold the position).
    """
    k = launchable(k)
    B, Hkv, N, D = k.shape
    g = query_mean.shape[2]
    group = query_mean.shape[1] // Hkv
    total = segment * g * (g - 1) // 2
    position_bits = max(1, ((g - 1) * segment - 1).bit_length()) if g > 1 else 1
    out = torch.empty(B, Hkv, max(total, 1), dtype=torch.int64, device=k.device)
    if total == 0:
        return out[..., :0], position_bits
    qm = query_mean.float().contiguous()
    segment_bits = 63 - 32 - position_bits  # bits left for the segment id: (batch, head) chunks sorted together
    per_chunk = max(1, (1 << segment_bits) // g) if segment_bits > 0 else 0
    if per_chunk == 0:
        raise ValueError(f"s2o_rank_keys: N={N} too long for 64-bit packed keys")
    d_pad = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(g))
    block_t = 16 if interpreting() else 64  # 128 x 64 int64 keys per 4 warps spilled (stack frame of 512 bytes)
    flat = out.view(B * Hkv, total)
    chunks = []
    for bh0 in range(0, B * Hkv, per_chunk):  # one chunk unless N is huge (bits run out)
        bh1 = min(B * Hkv, bh0 + per_chunk)
        part = flat[bh0:bh1]
        _s2o_rank_keys_kernel[(triton.cdiv((g - 1) * segment, block_t), bh1 - bh0)](
            k, *k.stride(), qm, part, Hkv, g, segment, total, position_bits, 32 + position_bits, bh0, group,
            BLOCK_T=block_t, G_PAD=g_pad, D=D, D_PAD=d_pad, PREC=dot_precision(torch.float32), num_warps=4,
        )
        # one radix sort of 64-bit keys ranks every segment of the chunk at once (segment id in the top bits)
        chunks.append(torch.sort(part.reshape(-1)).values)
    ranked = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return ranked.view(B, Hkv, total), position_bits


@triton.jit
def _s2o_assemble_kernel(ranked_ptr, out_ptr, N, SEGMENT, TOTAL, POSITION_MASK, LENGTH, BLOCK_N,
                         BLOCK: tl.constexpr):
    c = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    seg_len = tl.minimum(N - n * SEGMENT, SEGMENT)
    intra_pad = (seg_len + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    base = tl.cast(n * (n + 1) // 2, tl.int64) * SEGMENT
    s = c * BLOCK + tl.arange(0, BLOCK)
    live = s < intra_pad + n * SEGMENT
    own = tl.where(s < seg_len, n * SEGMENT + s, -1)
    src = bh.to(tl.int64) * TOTAL + tl.cast(n * (n - 1) // 2, tl.int64) * SEGMENT + (s - intra_pad)
    ranked = (tl.load(ranked_ptr + src, mask=live & (s >= intra_pad), other=0) & POSITION_MASK).to(tl.int32)
    tl.store(out_ptr + bh.to(tl.int64) * LENGTH + base + s, tl.where(s < intra_pad, own, ranked), mask=live)


def s2o_assemble(ranked: torch.Tensor, position_bits: int, n: int, segment: int, block_n: int,
                 length: int) -> torch.Tensor:
    """The S2O logical key list (B, Hkv, L) int32: per segment its own keys (padded with -1), then its ranking."""
    B, Hkv = ranked.shape[:2]
    g = cdiv(n, segment)
    out = torch.empty(B, Hkv, length, dtype=torch.int32, device=ranked.device)
    block = 256 if not interpreting() else 64
    longest = cdiv(segment, block_n) * block_n + (g - 1) * segment
    src = ranked if ranked.numel() else torch.empty(1, dtype=torch.int64, device=ranked.device)
    _s2o_assemble_kernel[(triton.cdiv(longest, block), g, B * Hkv)](
        src, out, n, segment, ranked.shape[-1], (1 << position_bits) - 1, length, block_n, BLOCK=block,
        num_warps=4,
    )
    return out


@triton.jit
def _s2o_select_kernel(qidx_ptr, stride_qb, stride_qh, offs_ptr, stride_pb, stride_ph, stride_pi, cnt_ptr, msk_ptr,
                       H, N, NUM_QUERY_BLOCKS, SEGMENT, WIDTH,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                       HAS_QUERY_INDEX: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < NUM_QUERY_BLOCKS
    bh = tl.program_id(1)
    b, h, _ = split_heads(bh, H, 1)
    seg = (i * BLOCK_M) // SEGMENT
    if HAS_QUERY_INDEX:
        r = i[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        qi = tl.load(qidx_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + r, mask=r < N, other=-1)
        qmax = tl.max(qi, 1)
    else:
        qmax = tl.minimum(i * BLOCK_M + BLOCK_M, N) - 1
    seg_len = tl.minimum(N - seg * SEGMENT, SEGMENT)
    intra_pad = (seg_len + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    base = SEGMENT * seg * (seg + 1) // 2
    n_masked = tl.minimum((qmax - seg * SEGMENT) // BLOCK_N + 1, intra_pad // BLOCK_N)
    count = n_masked + (seg * SEGMENT) // BLOCK_N
    obase = offs_ptr + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + i.to(tl.int64) * stride_pi
    for t0 in range(0, WIDTH, W):
        t = t0 + tl.arange(0, W)[None, :]
        nm = n_masked[:, None]
        o = tl.where(t < nm, base[:, None] + t * BLOCK_N, (base + intra_pad)[:, None] + (t - nm) * BLOCK_N)
        tl.store(obase[:, None] + t, tl.where(t < count[:, None], o, 0), mask=rin[:, None] & (t < WIDTH))
    row = bh.to(tl.int64) * NUM_QUERY_BLOCKS + i
    tl.store(cnt_ptr + row, count, mask=rin)
    tl.store(msk_ptr + row, n_masked, mask=rin)


def s2o_select(query_index: Optional[torch.Tensor], *, batch: int, heads: int, n: int, segment: int, block_m: int,
               block_n: int, width: int, device=None) -> PlanTables:
    """``sparse_compile.methods.s2o.select_s2o``'s tables, (B, heads, nqb, width)."""
    nqb = cdiv(n, block_m)
    tables = empty_plan_tables(batch, heads, nqb, width, device)
    offs, cnt, msk = tables
    qi = query_index if query_index is not None else cnt
    w = min(1024, max(16, triton.next_power_of_2(width)))
    rows = max(1, min(pow2(nqb), 64 if interpreting() else 4))
    _s2o_select_kernel[(triton.cdiv(nqb, rows), batch * heads)](
        qi, qi.stride(0), qi.stride(1), offs, offs.stride(0), offs.stride(1), offs.stride(2), cnt, msk,
        heads, n, nqb, segment, width, BLOCK_M=block_m, BLOCK_N=block_n, W=w, ROWS=rows,
        HAS_QUERY_INDEX=query_index is not None, num_warps=4,
    )
    return tables
