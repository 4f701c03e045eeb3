"""PBS-Attn's reorder stage on the GPU: the last query block's key importance and the in-segment key order.

Two passes over K per query head: the per-row log-sum-exp of the causal scores (in chunks, for parallelism), then
the mean probability each key gets, with the in-segment descending sort fused into the second pass (one segment
per program) when the segment is a power of two <= 1024.

Non-finite scores (a non-finite query row, or a non-finite key) leave the softmax as if masked: such a row gives
no key any importance, such a key gets none from the rows that score it NaN, and every other importance stays
finite, so one NaN does not reorder a whole head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (dot, dot_precision, interpreting, is_finite, jit_any_length, load_head_rows, pow2, runs_in_float32,
                     split_heads)
from .sorting import segmented_argsort_desc
from .validate import cdiv

__all__ = ["pbs_key_importance", "pbs_key_permutation"]

_LOG2E = 1.4426950408889634


@jit_any_length
def _pbs_lse_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    m_ptr, s_ptr,
    HQ, GROUP, NUM_QUERIES, NUM_KEYS, ROWS, NUM_CHUNKS, qk_scale,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk = split_heads(bh, HQ, GROUP)
    rows = tl.arange(0, ROWS_PAD)
    rin = rows < ROWS
    qrow = NUM_QUERIES - ROWS + rows
    qpos = qrow + (NUM_KEYS - NUM_QUERIES)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = load_head_rows(q_ptr, b, h, qrow, rin, d, dmask, stride_qb, stride_qh, stride_qn, stride_qd)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    m = tl.full([ROWS_PAD], -1.0e30, tl.float32)
    s = tl.zeros([ROWS_PAD], tl.float32)
    for n0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, NUM_KEYS), BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kin = keys < NUM_KEYS
        kt = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                     mask=kin[:, None] & dmask[None, :], other=0.0)
        z = dot(q, tl.trans(kt), PREC) * qk_scale
        ok = (keys[None, :] <= qpos[:, None]) & kin[None, :] & is_finite(z)
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(z - m_new[:, None]), 1)
        m = m_new
    out = (bh.to(tl.int64) * ROWS_PAD + rows) * NUM_CHUNKS + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)


@jit_any_length
def _pbs_importance_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, stride_qd,
    k_ptr, stride_kb, stride_kh, stride_kn, stride_kd,
    m_ptr, s_ptr, imp_ptr, perm_ptr,
    HKV, GROUP, NUM_QUERIES, NUM_KEYS, ROWS, NUM_CHUNKS, SEGMENTS_END, qk_scale, count,
    BLOCK_N: tl.constexpr, ROWS_PAD: tl.constexpr, ROW_BLOCK: tl.constexpr, NUM_CHUNKS_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr, WRITE_IMPORTANCE: tl.constexpr, SORT: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b, hk, _ = split_heads(bh, HKV, 1)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    keys = c * BLOCK_N + tl.arange(0, BLOCK_N)
    kin = keys < NUM_KEYS
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    kt = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_kn + d[None, :] * stride_kd,
                 mask=kin[:, None] & dmask[None, :], other=0.0)
    ch = tl.arange(0, NUM_CHUNKS_PAD)
    # scores are computed transposed, (keys, rows): the sum over query rows runs along axis 1, inside threads and
    # warps, and the probabilities of every head and row chunk accumulate elementwise before one final reduction
    acc = tl.zeros([BLOCK_N, ROW_BLOCK], tl.float32)
    for p in range(GROUP):  # the group's query heads share the key order (one permutation per KV head)
        h = hk * GROUP + p
        for r0 in range(0, ROWS_PAD, ROW_BLOCK):
            rows = r0 + tl.arange(0, ROW_BLOCK)
            rin = rows < ROWS
            qrow = NUM_QUERIES - ROWS + rows
            qpos = qrow + (NUM_KEYS - NUM_QUERIES)
            q = load_head_rows(q_ptr, b, h, qrow, rin, d, dmask, stride_qb, stride_qh, stride_qn, stride_qd)
            # this head's rows' base-2 log-sum-exp from the lse pass's per-chunk (max, sum) partials
            pb = ((b.to(tl.int64) * (HKV * GROUP) + h) * ROWS_PAD + rows[None, :]) * NUM_CHUNKS + ch[:, None]
            pm = tl.load(m_ptr + pb, mask=(ch < NUM_CHUNKS)[:, None], other=-1.0e30)
            ps = tl.load(s_ptr + pb, mask=(ch < NUM_CHUNKS)[:, None], other=0.0)
            mx = tl.max(pm, 0)
            lse = mx + tl.log2(tl.sum(ps * tl.exp2(pm - mx[None, :]), 0))
            zt = dot(kt, tl.trans(q), PREC) * qk_scale  # (BLOCK_N, ROW_BLOCK)
            ok = (keys[:, None] <= qpos[None, :]) & kin[:, None] & rin[None, :] & is_finite(zt)
            acc += tl.where(ok, tl.exp2(zt - lse[None, :]), 0.0)
    imp = tl.sum(acc, 1) / count
    if WRITE_IMPORTANCE:
        tl.store(imp_ptr + bh.to(tl.int64) * NUM_KEYS + keys, imp, mask=kin)
    if SORT:
        # this program's keys are one segment: sort them by descending importance (ties: lower index first,
        # as a stable sort) with packed (value bits, inverted index) 64-bit keys; importances are finite and
        # >= 0, so their bit patterns order like the values
        loc = tl.arange(0, BLOCK_N)
        key = (imp.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)
        srt = tl.sort(key, descending=True)
        perm = c * BLOCK_N + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
        # keys past the last whole segment keep their order (PBS Sec. 3.2)
        perm = tl.where(c * BLOCK_N + BLOCK_N <= SEGMENTS_END, perm, keys)
        tl.store(perm_ptr + bh.to(tl.int64) * NUM_KEYS + keys, perm, mask=kin)


def _pbs_lse(q, k, scale, rows, prec):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    d_pad = max(16, triton.next_power_of_2(D))
    rows_pad = max(16, triton.next_power_of_2(rows))
    block_n = 16 if interpreting() else 64
    # GPU: about 16 chunks per head for parallelism; interpreter: one (it pays per program)
    chunk = pow2(Nk) if interpreting() else max(block_n, min(4096, pow2(cdiv(Nk, 16))))
    num_chunks = triton.cdiv(Nk, chunk)
    m = torch.empty(B, Hq, rows_pad, num_chunks, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    _pbs_lse_kernel[(num_chunks, B * Hq)](
        q, *q.stride(), k, *k.stride(), m, s, Hq, Hq // Hkv, Nq, Nk, rows, num_chunks, scale * _LOG2E,
        CHUNK=chunk, BLOCK_N=block_n, ROWS_PAD=rows_pad, D=D, D_PAD=d_pad, PREC=prec,
        num_warps=4 if rows_pad <= 64 else 8, num_stages=3,
    )
    # the importance pass combines the chunks' partial (max, sum) itself: no small torch ops on the hot path
    return m, s, rows_pad, num_chunks


def pbs_key_importance(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """``sparse_compile.methods.pbs.pbs_key_importance``: (B, Hkv, Nk) float32."""
    return _importance_pass(q, k, scale, rows, segment=0, want_importance=True)[0]


def pbs_key_permutation(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, segment: int) -> torch.Tensor:
    """PBS reorder: int32 (B, Hkv, Nk) key order, descending importance inside each whole segment."""
    return _importance_pass(q, k, scale, rows, segment=segment, want_importance=False)[1]


def _importance_pass(q, k, scale, rows, *, segment, want_importance):
    if runs_in_float32(q.dtype):
        q, k = q.float(), k.float()
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    rows = min(rows, Nq)
    prec = dot_precision(q.dtype)
    m, s, rows_pad, num_chunks = _pbs_lse(q, k, scale, rows, prec)
    d_pad = max(16, triton.next_power_of_2(D))
    fuse = segment > 0 and segment & (segment - 1) == 0 and segment <= 1024 and not want_importance
    block_n = segment if fuse else (16 if interpreting() else 128)
    importance = (torch.empty(B, Hkv, Nk, dtype=torch.float32, device=q.device)
                  if (want_importance or not fuse) else None)
    perm = torch.empty(B, Hkv, Nk, dtype=torch.int32, device=q.device) if fuse else None
    row_block = rows_pad if interpreting() else min(rows_pad, max(16, (64 * 256) // block_n))
    dummy_f = torch.empty(1, dtype=torch.float32, device=q.device)
    dummy_i = torch.empty(1, dtype=torch.int32, device=q.device)
    _pbs_importance_kernel[(triton.cdiv(Nk, block_n), B * Hkv)](
        q, *q.stride(), k, *k.stride(), m, s, importance if importance is not None else dummy_f,
        perm if perm is not None else dummy_i,
        Hkv, Hq // Hkv, Nq, Nk, rows, num_chunks, (Nk // segment) * segment if segment else 0, scale * _LOG2E,
        float((Hq // Hkv) * rows),
        BLOCK_N=block_n, ROWS_PAD=rows_pad, ROW_BLOCK=row_block,
        NUM_CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), D=D, D_PAD=d_pad, PREC=prec,
        WRITE_IMPORTANCE=importance is not None, SORT=fuse,
        num_warps=8 if block_n * row_block >= 128 * 128 else 4, num_stages=2,
    )
    if segment and not fuse:
        perm = segmented_argsort_desc(importance, segment, Nk // segment)
    return importance, perm
