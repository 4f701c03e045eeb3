"""S2O's reorder and select stages on the GPU.

* ``s2o_rank_keys``: every segment's causal prefix ranked by descending <segment query mean, key>: one stable sort
  of every segment's scores at once, then one of their segment ids.
* ``s2o_assemble``: the logical key list: per segment its own keys (padded with -1), then its ranking.
* ``s2o_select``: the plan: intra-segment masked tiles, then the ranked prefix.

A non-finite score ranks first (as +inf; ties by position), so an early stop never passes a key whose scores
are not finite: dense attention would not be finite there either.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import (PlanTables, dot, dot_precision, empty_plan_tables, interpreting, is_finite, jit_any_length,
                     launchable, orderable, pow2, split_heads)
from .validate import cdiv

__all__ = ["S2ORanking", "s2o_rank_keys", "s2o_assemble", "s2o_select"]


@jit_any_length
def _s2o_rank_keys_kernel(
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd, qm_ptr, out_ptr,
    HKV, NUM_SEGMENTS, SEGMENT, TOTAL, GROUP,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
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
    start = (n * (n - 1) // 2).to(tl.int64) * SEGMENT  # segment n's part of the (batch, head)'s list
    # ascending int32 key = descending score (~x reverses the signed order)
    tl.store(out_ptr + bh.to(tl.int64) * TOTAL + start[None, :] + t[:, None], ~orderable(sc), mask=use)


@jit_any_length
def _s2o_segment_of_kernel(slot_ptr, out_ptr, COUNT, NUM_SEGMENTS, SEGMENT, TOTAL, BLOCK: tl.constexpr):
    # the segment (batch * head * g + n) of each slot of the flat list: slot = bh * TOTAL + S * n(n-1)/2 + t
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < COUNT
    slot = tl.load(slot_ptr + i, mask=live, other=0)
    bh = slot // TOTAL
    m = ((slot - bh * TOTAL) // SEGMENT).to(tl.int32)  # n(n-1)/2 <= m < n(n+1)/2
    n = ((1.0 + tl.sqrt(1.0 + 8.0 * m.to(tl.float32))) * 0.5).to(tl.int32)
    n = tl.where(n * (n - 1) // 2 > m, n - 1, n)  # the float root may be one off either way
    n = tl.where((n + 1) * n // 2 <= m, n + 1, n)
    tl.store(out_ptr + i, (bh * NUM_SEGMENTS + n).to(out_ptr.dtype.element_ty), mask=live)


#: the most segments (batch x KV heads x g) whose ids sort as uint8 (1 radix pass) or int16 (2; int32 takes 4)
UINT8_SEGMENT_IDS = 256
INT16_SEGMENT_IDS = 32768


class S2ORanking(NamedTuple):
    """Every segment's ranked causal prefix as two stable sorts of the flat (B, Hkv, TOT) list of slots
    (slot ``S*n*(n-1)/2 + t`` of a (batch, head) = key t of segment n): ``by_score`` (flat slots by ascending key,
    i.e. descending score) and ``by_segment`` (indices into ``by_score``, regrouped by segment, stable). Segment
    n's r-th key is ``by_score[by_segment[s]] - (s - r)`` with s = bh * TOT + S*n*(n-1)/2 + r."""

    by_score: torch.Tensor
    by_segment: torch.Tensor


def s2o_rank_keys(k: torch.Tensor, query_mean: torch.Tensor, segment: int) -> S2ORanking:
    """Every segment's causal prefix ranked by descending <query_mean[n], K[t]>, ties by position (stable).

    ``query_mean`` (B, H, g, D) float32 segment means, H = Hkv (one ranking per KV head) or a multiple of it (the
    kernel then averages each GQA group's heads; slower: every program re-reads the group's means).

    Two stable radix sorts instead of one of packed (segment, score, position) 64-bit keys: the int32 scores of
    every segment at once, then the segment ids (8 or 16 bits) of the result. PyTorch's sort moves int64 indices with
    its keys, so the packed sort paid 8 passes over 16 bytes per entry; these pay 4 over 12 and 1 or 2 over 9 or 10.
    """
    k = launchable(k)
    B, Hkv, N, D = k.shape
    g = query_mean.shape[2]
    group = query_mean.shape[1] // Hkv
    total = segment * g * (g - 1) // 2
    dev = k.device
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return S2ORanking(empty, empty)
    qm = query_mean.float().contiguous()
    keys = torch.empty(B * Hkv * total, dtype=torch.int32, device=dev)
    d_pad = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(g))
    block_t = 16 if interpreting() else 64  # (64 keys x g_pad segments) per program, spill-free
    _s2o_rank_keys_kernel[(triton.cdiv((g - 1) * segment, block_t), B * Hkv)](
        k, *k.stride(), qm, keys, Hkv, g, segment, total, group,
        BLOCK_T=block_t, G_PAD=g_pad, D=D, D_PAD=d_pad, PREC=dot_precision(torch.float32), num_warps=4,
    )
    by_score = torch.sort(keys, stable=True).indices
    del keys
    segments = B * Hkv * g
    seg_dtype = torch.uint8 if segments <= UINT8_SEGMENT_IDS else (
        torch.int16 if segments <= INT16_SEGMENT_IDS else torch.int32)
    seg = torch.empty(by_score.shape, dtype=seg_dtype, device=dev)
    block = 256 if interpreting() else 1024
    _s2o_segment_of_kernel[(triton.cdiv(seg.numel(), block),)](by_score, seg, seg.numel(), g, segment, total,
                                                               BLOCK=block, num_warps=4)
    return S2ORanking(by_score, torch.sort(seg, stable=True).indices)


@jit_any_length
def _s2o_assemble_kernel(by_score_ptr, by_segment_ptr, out_ptr, N, SEGMENT, TOTAL, LENGTH, BLOCK_N,
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
    first = bh.to(tl.int64) * TOTAL + tl.cast(n * (n - 1) // 2, tl.int64) * SEGMENT  # slot of key 0 of segment n
    ranked = live & (s >= intra_pad)
    j = tl.load(by_segment_ptr + first + (s - intra_pad), mask=ranked, other=0)
    pos = (tl.load(by_score_ptr + j, mask=ranked, other=0) - first).to(tl.int32)
    tl.store(out_ptr + bh.to(tl.int64) * LENGTH + base + s, tl.where(s < intra_pad, own, pos), mask=live)


def s2o_assemble(ranking: S2ORanking, batch: int, heads: int, n: int, segment: int, block_n: int,
                 length: int) -> torch.Tensor:
    """The S2O logical key list (B, Hkv, L) int32: per segment its own keys (padded with -1), then its ranking."""
    dev = ranking.by_score.device
    g = cdiv(n, segment)
    total = segment * g * (g - 1) // 2
    out = torch.empty(batch, heads, length, dtype=torch.int32, device=dev)
    block = 256 if not interpreting() else 64
    longest = cdiv(segment, block_n) * block_n + (g - 1) * segment
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    by_score, by_segment = (x if x.numel() else one for x in ranking)
    _s2o_assemble_kernel[(triton.cdiv(longest, block), g, batch * heads)](
        by_score, by_segment, out, n, segment, total, length, block_n, BLOCK=block, num_warps=4,
    )
    return out


@jit_any_length
def _s2o_select_kernel(qidx_ptr, stride_qib, stride_qih, offs_ptr, stride_pb, stride_ph, stride_pi, cnt_ptr, msk_ptr,
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
        qi = tl.load(qidx_ptr + b.to(tl.int64) * stride_qib + h.to(tl.int64) * stride_qih + r, mask=r < N, other=-1)
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
