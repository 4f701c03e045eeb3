"""Block-sparse FlashAttention forward in Triton: per query block, a list of key tiles.

The host wrapper ``block_sparse_attention`` takes plain tensors and numbers and runs the ``BlockPlan`` contract
(``sparse_compile/plan.py`` documents it; ``plan.execute_plan`` passes a plan's fields here): query block ``i``
visits the tiles ``tile_offsets[b, h, i, t]`` (int32, (B, Ht, n_query_blocks, max_tiles)) for
``t < tile_counts[b, h, i]``, in that order; the first ``masked_counts[b, h, i]`` are masked (causal, padding and
the ``window`` / ``chunk`` band), the others are promised fully visible and are not masked (not checked here:
``plan.check_plan`` does, with host syncs; a table that breaks the promise reads out of range); ``key_index`` /
``query_index`` map logical to physical rows; ``early_stop`` and ``pv_skip`` as the plan defines them (a P.V skip
that cannot show in the output is not run: ``pv_skip_is_negligible``). Rows that see no key write zeros; a row with
a non-finite score writes a non-finite output, as dense attention, and does not decide an early stop.

Shape (FlashAttention-2 style): one program per (batch, query head, query block), ``q`` on chip; ``_fwd_inner``
walks the masked tiles, then the unmasked ones (no mask arithmetic), online softmax in base 2 with the scale folded
into the exponent; a KV head's query heads run together, query blocks last-first; tile offsets load one trip ahead.

Supported: float16 / bfloat16 (fp32 accumulation), float32 (slow: tests, the interpreter); ``D <= 256``;
``block_m`` / ``block_n`` powers of two in [16, 256]; GQA (K/V never repeated); ``Nq <= Nk``; ``key_index`` keys
gathered in the loop or copied once (``key_mode``); TMA loads on Hopper and newer where the strides allow.

``backend="auto"`` hands calls in the Gluon kernel's subset (``kernels/hopper.py``) to it on sm_90 and runs the rest
here; a failure to import or compile that path warns once and falls back here. ``backend="triton"`` (or
``SPARSE_COMPILE_ATTENTION_BACKEND=triton``) forces this kernel, ``backend="hopper"`` the other; ``last_backend`` /
``BACKEND_CALLS`` record which ran. The full interface, the dispatch rules and the measurements behind the design:
docs/kernels.md ("Which kernel runs", "The Triton kernel").
"""

from __future__ import annotations

import logging
import math
import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from .common import interpreting, jit_any_length
from .permute import permute_keys
from .validate import MAX_HEAD_DIM, cdiv, check_kernel_options, validate_qkv

try:  # host-side tensor descriptors (TMA) exist from Triton 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer path only
    TensorDescriptor = None

__all__ = ["block_sparse_attention", "KernelConfig", "default_config", "reads_keys_in_place", "hopper_serves",
           "is_triton_compile_failure"]

log = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
# a running maximum that starts finite keeps exp2(m_old - m_new) and exp2(s - m_new) free of (-inf) - (-inf)
_M_INIT = tl.constexpr(-1.0e30)


# ---------------------------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, rows, stride_row, stride_d, offs_d, row_mask,
               MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               INT64_ROWS: tl.constexpr):
    """Load ``[len(rows), HEAD_DIM_PAD]`` from ``base`` (rows past a false ``row_mask`` and pad columns read 0)."""
    if INT64_ROWS:
        rows = rows.to(tl.int64)
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :] * stride_d
    if HEAD_DIM_PAD != HEAD_DIM:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _tile_start(tile_ptr, j, j_end, stride_tt, TILE_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """First logical key of kernel tile ``j`` (plan tile ``j // TILE_SPLIT``); clamped to the last tile so that a
    prefetch one past the end reads inside the list."""
    j = tl.maximum(tl.minimum(j, j_end - 1), 0)
    return tl.load(tile_ptr + (j // TILE_SPLIT) * stride_tt, mask=j_end > 0, other=0) + (j % TILE_SPLIT) * BLOCK_N


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, q_pos, row_ok, start,
    k_base, v_base, desc_k, desc_v, kidx_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kip,
    k_row0, k_col0, v_row0, v_col0,
    qk_scale, pv_lambda, N_K, KEY_LEN, WINDOW, CHUNK,
    offs_d,
    MASKED: tl.constexpr, HAS_KIDX: tl.constexpr, KEY_GATHER: tl.constexpr, USE_TMA: tl.constexpr,
    PV_SKIP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PREC: tl.constexpr, INT64_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
):
    """One key tile ``[start, start + BLOCK_N)`` (logical keys) folded into the online softmax."""
    offs_n = start + tl.arange(0, BLOCK_N)
    # -- where the keys are (physical row, validity): masked tiles need positions, gathered loads need rows
    if MASKED:
        in_range = offs_n < KEY_LEN
        if HAS_KIDX:
            phys = tl.load(kidx_base + offs_n * stride_kip, mask=in_range, other=-1)
            valid = (phys >= 0) & (phys < N_K)
        else:
            phys = offs_n
            valid = in_range
    else:
        if KEY_GATHER:
            phys = tl.load(kidx_base + offs_n * stride_kip)  # promised valid: no mask
        else:
            phys = offs_n
        valid = offs_n >= 0  # unused: unmasked tiles are promised fully visible
    # -- K tile and scores
    rows = phys
    if KEY_GATHER:
        if MASKED:
            rows = tl.where(valid, phys, 0)
        k = _load_rows(k_base, rows, stride_kn, stride_kd, offs_d, valid, MASKED, HEAD_DIM, HEAD_DIM_PAD,
                       INT64_ROWS)
    elif USE_TMA:
        k = desc_k.load([k_row0 + start, k_col0])
    else:
        k = _load_rows(k_base, offs_n, stride_kn, stride_kd, offs_d, valid, MASKED, HEAD_DIM, HEAD_DIM_PAD,
                       INT64_ROWS)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        visible = valid[None, :] & (phys[None, :] <= q_pos[:, None])
        # the band (sliding window, chunks) in masked tiles only: the plan lists a tile with a key outside it as
        # masked, so unmasked tiles keep their mask-free arithmetic. Constexpr flags: causal plans compile as before
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - phys[None, :] < WINDOW)
        if HAS_CHUNK:
            visible = visible & (phys[None, :] // CHUNK == q_pos[:, None] // CHUNK)
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        tile_max = tl.max(s, 1)
        m_new = tl.maximum(m_i, tile_max)
        p = tl.math.exp2(s - m_new[:, None])
    else:
        # scale > 0, so max(qk) * scale == max(qk * scale); one FMA per score below
        tile_max = tl.max(qk, 1) * qk_scale
        m_new = tl.maximum(m_i, tile_max)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    gain = tl.sum(p, 1)
    l_prev = l_i * alpha
    l_i = l_prev + gain
    acc = acc * alpha[:, None]
    # -- V tile and P.V
    if KEY_GATHER:
        v = _load_rows(v_base, rows, stride_vn, stride_vd, offs_d, valid, MASKED, HEAD_DIM, HEAD_DIM_PAD,
                       INT64_ROWS)
    elif USE_TMA:
        v = desc_v.load([v_row0 + start, v_col0])
        if MASKED:
            # a TMA tile past a head's end reads the neighbour's rows: P is 0 there, but 0 * non-finite is not
            v = tl.where(valid[:, None], v, 0.0)
    else:
        v = _load_rows(v_base, offs_n, stride_vn, stride_vd, offs_d, valid, MASKED, HEAD_DIM, HEAD_DIM_PAD,
                       INT64_ROWS)
    if PV_SKIP:
        # per row: a row whose tile maximum is far below its running maximum drops its P.V share (its
        # denominator keeps the gain). A select, not a branch: a block-wide decision needs a cross-warp reduction
        # and a branch around the MMA, which together cost a quarter of the loop (docs/kernels.md); a NaN
        # compares false and drops too, but its l is already NaN
        p = tl.where((tile_max - m_new >= pv_lambda)[:, None], p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new, gain, l_prev


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, q_pos, row_ok,
    tile_ptr, stride_tt, t_begin, t_end,
    k_base, v_base, desc_k, desc_v, kidx_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kip,
    k_row0, k_col0, v_row0, v_col0,
    qk_scale, es_tau, pv_lambda, N_K, KEY_LEN, WINDOW, CHUNK,
    offs_d,
    MASKED: tl.constexpr, EARLY_STOP: tl.constexpr, NUM_STAGES: tl.constexpr, TILE_SPLIT: tl.constexpr,
    HAS_KIDX: tl.constexpr, KEY_GATHER: tl.constexpr, USE_TMA: tl.constexpr, PV_SKIP: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
    INT64_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
):
    """Plan tiles ``t_begin .. t_end`` of the list at ``tile_ptr`` (each split into TILE_SPLIT kernel tiles)
    folded into (acc, l, m). Returns them and the plan tile where the walk ended (``t_end`` unless it stopped
    early)."""
    tl.static_assert(not (EARLY_STOP and (MASKED or TILE_SPLIT > 1)), "early stop: unmasked plan tiles only")
    if EARLY_STOP:
        # one tile per trip; stop once no real row gains at least tau of what it had (the stopping tile counts;
        # a non-finite row compares false and does not keep the walk going)
        t = t_begin
        go = t < t_end
        while go:
            start = tl.load(tile_ptr + t * stride_tt)
            acc, l_i, m_i, gain, l_prev = _fwd_tile(
                acc, l_i, m_i, q, q_pos, row_ok, start, k_base, v_base, desc_k, desc_v, kidx_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kip, k_row0, k_col0, v_row0, v_col0,
                qk_scale, pv_lambda, N_K, KEY_LEN, WINDOW, CHUNK, offs_d,
                MASKED, HAS_KIDX, KEY_GATHER, USE_TMA, PV_SKIP, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PREC,
                INT64_ROWS, HAS_WINDOW, HAS_CHUNK)
            t += 1
            still = tl.max(tl.where(row_ok & (gain >= es_tau * l_prev), 1, 0), 0)
            go = (t < t_end) & (still > 0)
        t_stop = t
    else:
        # the next tile's offset is loaded one trip ahead (loop-carried), not in front of its own K/V load: an
        # in-loop load that feeds the TMA coordinate is pipelined as a stage of its own, which costs one K/V
        # buffer (docs/kernels.md)
        j_begin = t_begin * TILE_SPLIT
        j_end = t_end * TILE_SPLIT
        nxt = _tile_start(tile_ptr, j_begin, j_end, stride_tt, TILE_SPLIT, BLOCK_N)
        for j in tl.range(j_begin, j_end, num_stages=NUM_STAGES):
            start = nxt
            nxt = _tile_start(tile_ptr, j + 1, j_end, stride_tt, TILE_SPLIT, BLOCK_N)
            acc, l_i, m_i, gain, l_prev = _fwd_tile(
                acc, l_i, m_i, q, q_pos, row_ok, start, k_base, v_base, desc_k, desc_v, kidx_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kip, k_row0, k_col0, v_row0, v_col0,
                qk_scale, pv_lambda, N_K, KEY_LEN, WINDOW, CHUNK, offs_d,
                MASKED, HAS_KIDX, KEY_GATHER, USE_TMA, PV_SKIP, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PREC,
                INT64_ROWS, HAS_WINDOW, HAS_CHUNK)
        t_stop = t_end
    return acc, l_i, m_i, t_stop


@jit_any_length
def _block_sparse_attn_fwd(
    Q, K, V, Out, desc_k, desc_v,
    TileOffsets, TileCounts, MaskedCounts, KeyIndex, QueryIndex, Visited, Lse, BlockRows,
    qk_scale, es_tau, pv_lambda, WINDOW, CHUNK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_tb, stride_th, stride_tq, stride_tt,
    stride_cb, stride_ch, stride_cq,
    stride_mb, stride_mh, stride_mq,
    stride_kib, stride_kih, stride_kip,
    stride_qib, stride_qih, stride_qip,
    stride_lb, stride_lh, stride_ln,
    k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
    H_Q, N_Q, N_K, KEY_LEN, N_QBLK, N_PBLK,
    GQA, PLAN_DIV, KIDX_DIV, QIDX_DIV,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_SPLIT: tl.constexpr, TILE_SPLIT: tl.constexpr,
    HAS_KIDX: tl.constexpr, HAS_QIDX: tl.constexpr, KEY_GATHER: tl.constexpr, USE_TMA: tl.constexpr,
    EARLY_STOP: tl.constexpr, PV_SKIP: tl.constexpr, WRITE_VISITED: tl.constexpr, DOT_PREC: tl.constexpr,
    INT64_ROWS: tl.constexpr, STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr,
    SKIP_MASKED: tl.constexpr, RESUME: tl.constexpr, WRITE_LSE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, PACKED: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(not (RESUME and WRITE_LSE), "a resumed pass reads the row statistics, it does not write them")
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD)
    tl.static_assert(not (KEY_GATHER and USE_TMA), "TMA cannot gather rows")
    tl.static_assert(not (KEY_GATHER and not HAS_KIDX), "gathered keys need a key_index")
    # early stop decides per plan tile and per plan query block, the P.V skip per row and plan tile: no sub-tiles
    tl.static_assert(not ((EARLY_STOP or PV_SKIP) and TILE_SPLIT > 1))
    tl.static_assert(not (EARLY_STOP and Q_SPLIT > 1))

    # -- which (batch, query head, query block) this program computes: the query heads of one KV head fastest,
    # then its query blocks (last-first), then the next KV head, so the ~132 programs resident at a time all read
    # one KV head's K/V (16 MB at 32K), which stays in L2
    pid = tl.program_id(0)
    n_kv = H_Q // GQA
    h_in = pid % GQA
    rest = pid // GQA
    qblk = N_QBLK - 1 - rest % N_QBLK
    bkv = rest // N_QBLK
    b = bkv // n_kv
    hkv = bkv % n_kv
    h = hkv * GQA + h_in
    pid_bh = b * H_Q + h
    pblk = qblk // Q_SPLIT
    b64 = b.to(tl.int64)

    # -- the query block: logical rows, physical rows, absolute positions
    if PACKED:
        # packed sequences: the plan block's own first row, row end, key end and query-to-key offset (its
        # sequence's queries are the last positions of its keys); tiles list packed key rows
        row0 = tl.load(BlockRows + pblk * 4)
        rows = row0 + (qblk % Q_SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(BlockRows + pblk * 4 + 1)
        key_len = tl.load(BlockRows + pblk * 4 + 2)
        q_pos = rows + tl.load(BlockRows + pblk * 4 + 3)
        phys_rows = rows
    else:
        rows = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N_Q
        key_len = KEY_LEN
        if HAS_QIDX:
            qidx_base = QueryIndex + b64 * stride_qib + (h // QIDX_DIV).to(tl.int64) * stride_qih
            phys_rows = tl.load(qidx_base + rows * stride_qip, mask=row_ok, other=0)
        else:
            phys_rows = rows
        q_pos = phys_rows + (N_K - N_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    q = _load_rows(q_base, phys_rows, stride_qm, stride_qd, offs_d, row_ok, True, HEAD_DIM, HEAD_DIM_PAD, INT64_ROWS)

    # -- the tile list of this (batch, head, plan block)
    hp = (h // PLAN_DIV).to(tl.int64)
    tile_ptr = TileOffsets + b64 * stride_tb + hp * stride_th + pblk.to(tl.int64) * stride_tq
    n_tiles = tl.load(TileCounts + b64 * stride_cb + hp * stride_ch + pblk * stride_cq)
    n_masked = tl.minimum(tl.load(MaskedCounts + b64 * stride_mb + hp * stride_mh + pblk * stride_mq), n_tiles)

    k_base = K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    if HAS_KIDX:
        kidx_base = KeyIndex + b64 * stride_kib + (h // KIDX_DIV).to(tl.int64) * stride_kih
    else:
        kidx_base = KeyIndex
    # tensor-descriptor coordinates of this head's first K/V row (rows and columns of a 2-D view)
    k_row0 = b * k_rb + hkv * k_rh
    k_col0 = hkv * k_ch
    v_row0 = b * v_rb + hkv * v_rh
    v_col0 = hkv * v_ch

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _M_INIT
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    o_base = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh
    lse_ptrs = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + phys_rows.to(tl.int64) * stride_ln
    if RESUME:
        # a first pass left each row's normalised output in Out and its log2-sum-exp2 in Lse: the same softmax
        # state as (acc = O, m = lse, l = 1); a row that saw nothing (lse = -inf) starts empty
        lse0 = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        seen = lse0 != float("-inf")
        m_i = tl.where(seen, lse0, m_i)
        l_i = tl.where(seen, 1.0, l_i)
        acc = _load_rows(o_base, phys_rows, stride_om, stride_od, offs_d, row_ok, True, HEAD_DIM, HEAD_DIM_PAD,
                         INT64_ROWS).to(tl.float32)

    # -- stage 1: masked tiles (listed first); never subject to early stop. Few trips, so fewer stages: its V
    # passes through registers for the padding mask, and its buffers would otherwise set the shared memory.
    # SKIP_MASKED: a first pass computed them (the resumed state)
    if not SKIP_MASKED:
        acc, l_i, m_i, _ = _fwd_inner(
            acc, l_i, m_i, q, q_pos, row_ok, tile_ptr, stride_tt, 0, n_masked,
            k_base, v_base, desc_k, desc_v, kidx_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_kip,
            k_row0, k_col0, v_row0, v_col0, qk_scale, es_tau, pv_lambda, N_K, key_len, WINDOW, CHUNK, offs_d,
            True, False, MASKED_STAGES, TILE_SPLIT, HAS_KIDX, KEY_GATHER, USE_TMA, PV_SKIP, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, DOT_PREC, INT64_ROWS, HAS_WINDOW, HAS_CHUNK)
    # -- stage 2: unmasked tiles, fully visible by the plan's promise: no mask arithmetic
    acc, l_i, m_i, n_visited = _fwd_inner(
        acc, l_i, m_i, q, q_pos, row_ok, tile_ptr, stride_tt, n_masked, n_tiles,
        k_base, v_base, desc_k, desc_v, kidx_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_kip,
        k_row0, k_col0, v_row0, v_col0, qk_scale, es_tau, pv_lambda, N_K, key_len, WINDOW, CHUNK, offs_d,
        False, EARLY_STOP, STAGES, TILE_SPLIT, HAS_KIDX, KEY_GATHER, USE_TMA, PV_SKIP, BLOCK_N, HEAD_DIM,
        HEAD_DIM_PAD, DOT_PREC, INT64_ROWS, HAS_WINDOW, HAS_CHUNK)

    # -- epilogue: rows that saw no key have l == 0 and acc == 0 and write zeros; a NaN l (the row met a
    # non-finite score) stays in the division, so the row writes NaN as dense attention would
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_rows = phys_rows
    if INT64_ROWS:
        o_rows = phys_rows.to(tl.int64)
    o_ptrs = o_base + o_rows[:, None] * stride_om + offs_d[None, :] * stride_od
    if HEAD_DIM_PAD != HEAD_DIM:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        # log2-sum-exp2 of the row's scaled scores (log2 e / sqrt(D) units): what a resumed pass starts from
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=row_ok)
    if WRITE_VISITED:
        if SKIP_MASKED:
            n_visited -= n_masked  # the tiles this pass computed
        tl.store(Visited + pid_bh.to(tl.int64) * N_PBLK + pblk, n_visited)


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. ``block_m`` divides the tables' ``block_m`` (ratio 1 or 2); ``block_n`` divides their
    ``block_n``.

    ``num_stages``: software-pipelining depth of the loop over unmasked tiles (K/V buffers = num_stages);
    ``masked_stages``: the same for the short loop over masked tiles (None: min(num_stages, 2)).
    ``use_tma``: None = when possible (GPU of compute capability >= 9, 16-byte aligned layout).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    use_tma: Optional[bool] = None
    masked_stages: Optional[int] = None


def default_config(block_m: int, block_n: int, *, head_dim_pad: int, dtype: torch.dtype, device: torch.device,
                   exact: bool, band: bool = False) -> KernelConfig:
    """Launch parameters for tiles of ``block_m`` x ``block_n``, a head dim and dtype (see docs/kernels.md).

    ``exact``: early stop or P.V skip is on, whose decisions are per table tile: no sub-tiles then. ``band``: a
    sliding window or chunks bound the keys (a few tiles per query block, the first and last of them masked).
    Shared memory was checked for each branch by compiling for sm_90a (Triton 3.6): every choice fits 227 KiB.
    """
    bm, bn = block_m, block_n
    if interpreting() or device.type != "cuda":
        return KernelConfig(bm, bn, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        # IEEE fp32 dots run on CUDA cores with large register tiles: small tiles, no pipeline buffers
        if exact:
            return KernelConfig(bm, bn, num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=1)
        return KernelConfig(bm // 2 if bm > 64 else bm, min(bn, 32), num_warps=4, num_stages=1)
    if head_dim_pad > 128:
        if exact:  # 128-row blocks with D=256 fit only without pipeline buffers
            return KernelConfig(bm, bn, num_warps=8 if bm >= 128 else 4, num_stages=1 if bm * bn >= 128 * 128 else 2)
        if bm == 128:  # H200, D=256 band at 32K: 128x64 with 8 warps 0.90 ms, 64x64 with 4 warps 1.19 ms
            return KernelConfig(bm, min(bn, 64), num_warps=8, num_stages=2)
        return KernelConfig(bm // 2 if bm > 128 else bm, min(bn, 64), num_warps=8 if bm >= 256 else 4, num_stages=2)
    if band and not exact and bm == 128 and bn == 128:
        # H200, a 4,096-key window at 32K (D=128, docs/kernels.md): 128x64 with 4 warps and 2 stages 4.80-4.88 ms,
        # the causal choice below 5.10-5.17 ms (short walks gain less from a 3-deep pipeline than from more programs)
        return KernelConfig(128, 64, num_warps=4, num_stages=2)
    kernel_bm = bm if (exact or bm <= 128) else bm // 2
    kernel_bn = bn if (exact or bn <= 128) else 128
    # two warpgroups of 64 rows each for 128-row blocks (wgmma is m64 per warpgroup). Measured on the H100
    # (docs/kernels.md): 128x128, 8 warps, 3 stages (3-deep K/V, 224 KiB) was the fastest of 10 configs at
    # 32K and 128K, rho 1 and 0.1; 2 stages +5-13%, 128x64 +18-71%, 64x64 with two programs per SM +7-19%.
    return KernelConfig(kernel_bm, kernel_bn, num_warps=8 if kernel_bm >= 128 else 4, num_stages=3)


# ---------------------------------------------------------------------------------------------------------------
# host wrapper
# ---------------------------------------------------------------------------------------------------------------


def _fail(msg: str) -> None:
    raise ValueError(f"block_sparse_attention: {msg}")


def _is_pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


def _check_table(name: str, t, rank: int, batch: int, heads: tuple, device, dim2: Optional[int] = None,
                 dim2_name: str = "") -> None:
    """An int32 table on ``device`` of ``rank`` dims: (B, one of ``heads``, ``dim2``, ...)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        _fail(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, inputs on {device}")
    if t.dim() != rank:
        _fail(f"{name} must be {rank}-D, got shape {tuple(t.shape)}")
    if t.shape[0] != batch or t.shape[1] not in heads or (dim2 is not None and t.shape[2] != dim2):
        expected = f"B={batch}, Hq={heads[0]} or Hkv={heads[1]}" + (f", {dim2} {dim2_name}" if dim2 is not None else "")
        _fail(f"{name} has shape {tuple(t.shape)}; expected ({expected}, ...)")


def _validate(q, k, v, tile_offsets, tile_counts, masked_counts, block_m, block_n, key_index, query_index,
              early_stop, pv_skip, block_rows=None, passes=None) -> None:
    # packed sequences each hold at most as many queries as keys; their totals need not
    validate_qkv(q, k, v, who="block_sparse_attention", longer_queries_ok=block_rows is not None, passes=passes)
    if q.device.type != "cuda" and not interpreting():
        _fail(f"inputs on {q.device}: the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    batch, heads_q, num_queries, dim = q.shape
    heads = (heads_q, k.shape[1])
    if dim > MAX_HEAD_DIM:
        _fail(f"head dim {dim} unsupported (at most {MAX_HEAD_DIM})")
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if not _is_pow2(val) or not 16 <= val <= 256:
            _fail(f"{name} must be a power of two in [16, 256], got {val!r}")
    blocks = cdiv(num_queries, block_m)
    if block_rows is not None:
        if not isinstance(block_rows, torch.Tensor) or block_rows.dtype != torch.int32 or block_rows.dim() != 2 \
                or block_rows.shape[1] != 4 or not block_rows.is_contiguous():
            _fail("block_rows must be a contiguous int32 (query blocks, 4) tensor (first row, row end, key end, "
                  f"query-to-key offset), got {getattr(block_rows, 'dtype', type(block_rows).__name__)} "
                  f"{tuple(getattr(block_rows, 'shape', ()))}")
        if block_rows.device != q.device:
            _fail(f"block_rows is on {block_rows.device}, inputs on {q.device}")
        if batch != 1 or key_index is not None or query_index is not None:
            _fail("block_rows (packed sequences) takes batch 1 and no key_index / query_index")
        blocks = block_rows.shape[0]
    for name, table, rank in (("tile_offsets", tile_offsets, 4), ("tile_counts", tile_counts, 3),
                              ("masked_counts", masked_counts, 3)):
        _check_table(name, table, rank, batch, heads, q.device, blocks, "query blocks")
    if tile_counts.shape != tile_offsets.shape[:3] or masked_counts.shape != tile_counts.shape:
        _fail("tile_offsets, tile_counts and masked_counts disagree in shape")
    if key_index is not None:
        _check_table("key_index", key_index, 3, batch, heads, q.device)
    if query_index is not None:
        _check_table("query_index", query_index, 3, batch, heads, q.device, num_queries, "queries")
    if not isinstance(early_stop, (int, float)) or not early_stop >= 0:
        _fail(f"early_stop must be a number >= 0, got {early_stop!r}")
    if pv_skip is not None and (not isinstance(pv_skip, (int, float)) or not pv_skip < 0):
        _fail(f"pv_skip must be None or a negative number, got {pv_skip!r}")


def _tma_view(x: torch.Tensor, block_rows: int, head_dim: int):
    """A 2-D (rows, columns) view of ``x`` (B, H, N, D) for a tensor descriptor, or None when TMA can't read it.

    Row ``b * rb + h * rh + n``, column ``h * ch`` holds ``x[b, h, n, 0]``: (B, H, N, D) contiguous has heads in
    rows, a transposed (B, N, H, D) tensor has heads in columns. Returns (descriptor, rb, rh, ch).
    """
    if TensorDescriptor is None:
        return None
    B, H, N, D = x.shape
    sb, sh, sn, sd = x.stride()
    es = x.element_size()
    if sd != 1 or D != head_dim or sn <= 0 or (sn * es) % 16 or x.data_ptr() % 16 or N == 0:
        return None
    if (D * es) < 16:
        return None

    def split(stride, count):  # (row step, column step) for one step along a dim of ``count`` entries
        if count == 1:
            return 0, 0
        if stride % sn == 0:
            return stride // sn, 0
        return None

    rb = split(sb, B)
    rh = split(sh, H)
    ch = 0
    if rh is None:  # heads side by side inside a row
        if H > 1 and (sh * es) % 16 == 0 and sh >= D and (H - 1) * sh + D <= sn:
            rh, ch = (0, 0), sh
        else:
            return None
    if rb is None:
        return None
    rb, rh = rb[0], rh[0]
    rows = (B - 1) * rb + (H - 1) * rh + N
    cols = (H - 1) * ch + D
    desc = TensorDescriptor(x, [rows, cols], [sn, 1], [block_rows, D])
    return desc, rb, rh, ch


_CAPABILITY: dict = {}


def _supports_tma(device: torch.device) -> bool:
    if TensorDescriptor is None or interpreting() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index][0] >= 9


def pv_skip_is_negligible(pv_skip: float, num_keys: int, dtype: torch.dtype) -> bool:
    """Whether a P.V skip of ``pv_skip`` (lambda < 0, natural log) changes an output of ``dtype`` by less than
    1/16 of its epsilon, relative to max|v|, over ``num_keys`` keys (docs/kernels.md): then it is not run."""
    return num_keys * math.exp(pv_skip) <= torch.finfo(dtype).eps / 16


def _key_layout(k, v, key_index, key_mode: str, head_dim_pad: int):
    """(K, V as the loop reads them, gather?): the permuted copy, gathered rows, or K/V themselves."""
    if key_mode not in ("auto", "gather", "copy"):
        _fail(f"key_mode must be 'auto', 'gather' or 'copy', got {key_mode!r}")
    if key_index is None:
        return k, v, False
    num_kv_heads = k.shape[1]
    copyable = key_index.shape[1] == num_kv_heads  # a per-query-head index cannot share one copy per KV head
    if key_mode == "copy" and not copyable:
        _fail(f"key_mode='copy' needs a key_index with Hkv={num_kv_heads} heads, got {key_index.shape[1]}")
    # "auto" copies whenever it can: one pass over K/V, amortised over every query head and tile (gathered loads
    # were 11-29% slower in every measured cell, docs/kernels.md)
    if key_mode == "gather" or not copyable:
        return k, v, True
    kp, vp = permute_keys(k, v, key_index, head_dim_pad)
    return kp, vp, False


_BACKENDS = ("auto", "triton", "hopper")
BACKEND_ENV = "SPARSE_COMPILE_ATTENTION_BACKEND"  # "triton": the "auto" backend never picks the Hopper kernel
# which kernel served the last call ("hopper" / "triton") and how often each did (tests, benchmarks)
last_backend: Optional[str] = None
BACKEND_CALLS = {"hopper": 0, "triton": 0}
# Hopper-kernel failures (compile / launch errors), per specialisation: such calls go to the Triton kernel
_HOPPER_FAILED: dict = {}
_HOPPER_IMPORT: list = []  # [None] once kernels.hopper imported, [reason] if it failed


_ENV_BACKENDS = ("auto", "triton")


def env_backend() -> str:
    """``SPARSE_COMPILE_ATTENTION_BACKEND``: "auto" (unset or empty) or "triton"; any other value is an error
    naming the valid ones (a typo must not silently keep the Hopper kernel on)."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value:
        return "auto"
    if value not in _ENV_BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r}: unknown value; valid: "
                         f"{', '.join(_ENV_BACKENDS)} (or unset)")
    return value


try:  # what a failing Triton/Gluon compile raises (CompilationError, OutOfResources, PTXASError)
    from triton.errors import TritonError as _TritonError
except ImportError:  # pragma: no cover - older Triton
    from triton.compiler.errors import CompilationError as _TritonError


def is_triton_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a Triton kernel failing to compile (Triton's compile errors, out of resources, ptxas, an
    MLIR pass failure): the call can run dense instead. Out of memory and every other error are not."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(exc, _TritonError) or (isinstance(exc, RuntimeError) and "PassManager" in str(exc))


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a missing or failing compile of the Gluon Hopper kernel raises: an import error,
    NotImplementedError, Triton's compile errors, an MLIR pass failure. Out of memory is not: it propagates."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(exc, (ImportError, NotImplementedError, _TritonError)):
        return True
    return isinstance(exc, RuntimeError) and "PassManager" in str(exc)  # MLIR's pass pipeline failed


def _hopper_unsupported(q, k, v, tile_offsets, block_m, block_n, key_index, query_index, early_stop, pv_skip,
                        key_mode, config, window: int = 0, chunk: int = 0, packed: bool = False) -> Optional[str]:
    """Why the Gluon Hopper kernel does not serve this call (a sentence), or None when it does. No host sync."""
    if config is not None:
        return "an explicit config= or options= tunes (and so selects) the Triton kernel"
    if packed:  # the Gluon kernel's programs index one sequence's query blocks; packed rows are not taught to it
        return "packed sequences (block_rows=): the Hopper kernel runs one sequence per batch row"
    if window > 0 or chunk > 0:
        # the Gluon kernel's masked tiles apply causal and padding only; teaching it the band is unmeasured on a
        # GPU (no H100 to test it here), so such calls run the Triton kernel, whose masked tiles apply it
        return "a sliding window or chunks (window=/chunk=): the Hopper kernel does not mask them"
    if interpreting():
        return "TRITON_INTERPRET=1 (the Triton interpreter)"
    if q.device.type != "cuda":
        return f"inputs on {q.device}"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    if _CAPABILITY[index] != (9, 0):
        return f"a GPU of compute capability {_CAPABILITY[index]}, not (9, 0)"
    if not _HOPPER_IMPORT:  # first call on an H100-class GPU: import the Gluon module once, warn once if it fails
        try:
            from . import hopper

            reason = hopper.GLUON_IMPORT_ERROR
            if reason is not None:
                reason = f"Gluon (Triton {triton.__version__}) unavailable: {reason}"
        except Exception as exc:  # pragma: no cover - depends on the installed Triton
            reason = f"kernels.hopper failed to import: {type(exc).__name__}: {exc}"
        _HOPPER_IMPORT.append(reason)
        if reason is not None:
            log.warning("block_sparse_attention: %s; the Triton kernel serves every call", reason)
    if _HOPPER_IMPORT[0] is not None:
        return _HOPPER_IMPORT[0]
    from . import hopper

    return hopper.hopper_unsupported(q, k, v, tile_offsets, block_m=block_m, block_n=block_n, key_index=key_index,
                                     query_index=query_index, early_stop=early_stop, pv_skip=pv_skip)


def _hopper_spec(q, block_n, key_index, query_index, early_stop, pv_skip, key_mode, passes=(False, False)) -> tuple:
    """The Hopper kernel's specialisation of a call: the key of ``_HOPPER_FAILED`` (``passes``: whether it writes
    the row statistics, whether it resumes from them)."""
    return (q.dtype, q.shape[-1], block_n, key_index is not None, pv_skip is not None, query_index is not None,
            early_stop > 0, key_mode, *passes)


def hopper_serves(q, k, v, tile_offsets, *, block_m: int, block_n: int) -> bool:
    """Whether ``block_sparse_attention`` (backend "auto") runs a plan in identity order without early stop, P.V
    skip or band on the Gluon Hopper kernel (a packed launch, which it does not take, would give that up). No host
    sync."""
    if env_backend() == "triton":
        return False
    if _hopper_unsupported(q, k, v, tile_offsets, block_m, block_n, None, None, 0.0, None, "auto", None) is not None:
        return False
    return _hopper_spec(q, block_n, None, None, 0.0, None, "auto") not in _HOPPER_FAILED


def reads_keys_in_place(q, k, v, tile_offsets, *, block_m: int, block_n: int, key_index, query_index=None,
                        early_stop: float = 0.0, pv_skip=None, window: int = 0, chunk: int = 0) -> bool:
    """Whether ``block_sparse_attention`` (key_mode and backend "auto") runs the Hopper kernel with the keys read
    through ``key_index`` in place (lists much longer than Nk: ``hopper.gathers_by_default``). No permuted K/V
    copy is then made, so a caller with such a list (S2O) need not cut it into chunks to bound the copy's memory.
    No host sync."""
    if key_index is None or env_backend() == "triton":
        return False
    from . import hopper

    if not hopper.gathers_by_default(key_index, k.shape[2]):
        return False
    if pv_skip is not None and pv_skip_is_negligible(pv_skip, k.shape[2], q.dtype):
        pv_skip = None
    if _hopper_unsupported(q, k, v, tile_offsets, block_m, block_n, key_index, query_index, early_stop, pv_skip,
                           "gather", None, window, chunk) is not None:
        return False
    return _hopper_spec(q, block_n, key_index, query_index, early_stop, pv_skip, "auto") not in _HOPPER_FAILED


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_offsets: torch.Tensor,
    tile_counts: torch.Tensor,
    masked_counts: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    key_index: Optional[torch.Tensor] = None,
    query_index: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    early_stop: float = 0.0,
    pv_skip: Optional[float] = None,
    return_visited: bool = False,
    key_mode: str = "auto",
    config: Optional[KernelConfig] = None,
    backend: str = "auto",
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    resume: bool = False,
    skip_masked: bool = False,
    window: int = 0,
    chunk: int = 0,
    block_rows: Optional[torch.Tensor] = None,
    options: Optional[Mapping] = None,
):
    """Block-sparse causal attention over tile lists (module docstring): q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D)
    -> out (B, Hq, Nq, D), and with ``return_visited`` the int32 (B, Hq, n_query_blocks) tiles each block
    computed.

    ``scale`` defaults to 1/sqrt(D). ``key_mode`` (with ``key_index``): "gather", "copy" (needs an index with Hkv
    heads) or "auto". ``config`` overrides the launch parameters of the Triton kernel (tuning and tests; it also
    selects the Triton kernel); ``options`` (names of ``KERNEL_OPTIONS``) set some of them over the default choice,
    and select the Triton kernel too. ``backend``: "auto" (the Gluon Hopper kernel where it serves the call, module
    docstring; the environment variable ``SPARSE_COMPILE_ATTENTION_BACKEND=triton`` turns it off), "triton" or
    "hopper" (ValueError naming why when the Hopper kernel cannot serve the call). Raises ValueError naming the
    first problem with the inputs. ``sparse_compile.plan.execute_plan`` calls this with a plan's fields.

    Two passes over one softmax (S2O's intra-segment window, then its ranked prefix): ``out`` (q's shape and
    dtype) receives the output; ``lse``, a float32 (B, Hq, Nq) tensor, receives each row's log2-sum-exp2 of its
    scaled scores (log2(e) * scale units; -inf for a row that saw no key). ``resume=True`` continues from such a
    pass instead: each row starts from ``out`` and ``lse`` (as if it had already attended to the first pass's keys)
    and the combined output replaces ``out``; ``lse`` is then only read. ``skip_masked=True`` runs only the
    unmasked tiles of each list (the first pass computed the masked ones); the visited counts are then this pass's.

    ``window`` / ``chunk`` (ints, 0: none): masked tiles also exclude keys outside a sliding window of that many
    positions or outside the query's chunk (``sparse_compile/plan.py``); the plan must list any tile that holds such
    a key among its masked tiles (``sparse_compile.plan.local_plan`` / ``restrict_to_local`` build such plans).
    Served by this Triton kernel only (``backend="hopper"`` refuses them).

    ``block_rows`` (int32 (n_blocks, 4), batch 1, no ``key_index`` / ``query_index`` / ``chunk``): packed sequences
    in one launch. Plan block ``i`` is the query rows ``[block_rows[i, 0], min(+block_m, block_rows[i, 1]))``, its
    keys end at ``block_rows[i, 2]`` (past it: padding) and a row ``r`` sits at key position ``r + block_rows[i, 3]``;
    its tiles list key rows of the packed k/v (``sparse_compile/packed.py`` builds such tables). The Triton kernel
    only.
    """
    global last_backend
    _validate(q, k, v, tile_offsets, tile_counts, masked_counts, block_m, block_n, key_index, query_index,
              early_stop, pv_skip, block_rows, passes=(out, lse, resume))
    if block_rows is not None and chunk:
        _fail("chunk= counts positions from key 0, which packed sequences (block_rows=) do not share")
    for name, value in (("window", window), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**31:
            _fail(f"{name} must be an int in [0, 2^31) (0: none), got {value!r}")
    if pv_skip is not None and pv_skip_is_negligible(pv_skip, k.shape[2], q.dtype):
        pv_skip = None
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb = cdiv(Nq, block_m) if block_rows is None else block_rows.shape[0]
    head_dim_pad = max(16, triton.next_power_of_2(D))
    exact = early_stop > 0 or pv_skip is not None
    band = bool(window or chunk)
    if options:  # some launch parameters over the default choice: a config of the Triton kernel, as config= is
        check_kernel_options(options, "block_sparse_attention: options")
        config = dataclasses.replace(config or default_config(block_m, block_n, head_dim_pad=head_dim_pad,
                                                              dtype=q.dtype, device=q.device, exact=exact,
                                                              band=band),
                                     **options)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        _fail(f"scale must be a positive finite number, got {scale!r}")

    if backend not in _BACKENDS:
        _fail(f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    if key_mode not in ("auto", "gather", "copy"):
        _fail(f"key_mode must be 'auto', 'gather' or 'copy', got {key_mode!r}")
    if backend == "auto" and env_backend() == "triton":
        backend = "triton"
    if backend != "triton":
        why = _hopper_unsupported(q, k, v, tile_offsets, block_m, block_n, key_index, query_index, early_stop,
                                  pv_skip, key_mode, config, window, chunk, block_rows is not None)
        if backend == "hopper" and why is not None:
            _fail(f"backend='hopper' cannot serve this call: {why}")
        if why is None:
            spec = _hopper_spec(q, block_n, key_index, query_index, early_stop, pv_skip, key_mode,
                                (lse is not None and not resume, resume))
            failed = _HOPPER_FAILED.get(spec) if backend == "auto" else None
            if failed is None:
                from . import hopper

                try:
                    result = hopper.hopper_block_sparse_attention(
                        q, k, v, tile_offsets, tile_counts, masked_counts, block_n=block_n, scale=scale,
                        block_m=block_m, key_index=key_index, query_index=query_index, early_stop=early_stop,
                        pv_skip=pv_skip, return_visited=return_visited,
                        key_gather={"gather": True, "copy": False}.get(key_mode), out=out, lse=lse,
                        resume=resume, skip_masked=skip_masked)
                except Exception as exc:
                    # a compile that fails (or a Gluon API this Triton lacks): the Triton kernel serves such calls.
                    # Anything else (out of memory, a device fault, a bug) is not the Hopper path's to hide
                    if backend == "hopper" or not is_compile_failure(exc):
                        raise
                    _HOPPER_FAILED[spec] = f"{type(exc).__name__}: {exc}"
                    log.warning("block_sparse_attention: the Hopper kernel failed for %s (%s: %s); using the "
                                "Triton kernel for such calls from now on", spec, type(exc).__name__,
                                str(exc)[:500])
                else:
                    last_backend = "hopper"
                    BACKEND_CALLS["hopper"] += 1
                    return result
    last_backend = "triton"
    BACKEND_CALLS["triton"] += 1

    cfg = config or default_config(block_m, block_n, head_dim_pad=head_dim_pad, dtype=q.dtype, device=q.device,
                                   exact=exact, band=band)
    if block_m % cfg.block_m or block_m // cfg.block_m not in (1, 2) or cfg.block_m < 16:
        _fail(f"config.block_m={cfg.block_m} must be block_m ({block_m}) or half of it")
    if block_n % cfg.block_n or cfg.block_n < 16:
        _fail(f"config.block_n={cfg.block_n} must divide block_n ({block_n}) and be >= 16")
    if early_stop > 0 and (cfg.block_m != block_m or cfg.block_n != block_n):
        _fail("early stop decides per table tile and query block: config block sizes must equal block_m, block_n")
    if pv_skip is not None and cfg.block_n != block_n:
        _fail("the P.V skip decides per table tile: config.block_n must equal block_n")

    kk, vv, gather = _key_layout(k, v, key_index, key_mode, head_dim_pad)
    if out is None:
        out = torch.empty_like(q)
    visited = torch.empty(B, Hq, nqb, dtype=torch.int32, device=q.device) if return_visited else None

    use_tma = cfg.use_tma
    tma_ok = (not gather) and D == head_dim_pad and _supports_tma(q.device) and q.dtype != torch.float32
    if use_tma is None:
        use_tma = tma_ok
    elif use_tma and not tma_ok:
        _fail("config.use_tma=True but TMA is unavailable here (needs a Hopper+ GPU, 16-bit dtype, "
              "power-of-two head dim, contiguous keys)")
    desc_k = desc_v = None
    k_geo = v_geo = (0, 0, 0)
    if use_tma:
        kt, vt = _tma_view(kk, cfg.block_n, D), _tma_view(vv, cfg.block_n, D)
        if kt is None or vt is None:
            log.debug("block_sparse_attention: K/V layout %s / %s not readable by TMA; pointer loads",
                      tuple(kk.stride()), tuple(vv.stride()))
            use_tma = False
        else:
            desc_k, k_geo = kt[0], kt[1:]
            desc_v, v_geo = vt[0], vt[1:]

    has_kidx = key_index is not None
    key_len = key_index.shape[-1] if has_kidx else Nk
    kidx = key_index if has_kidx else tile_counts  # any int32 tensor: never read without HAS_KIDX
    qidx = query_index if query_index is not None else tile_counts
    ki_strides = key_index.stride() if has_kidx else (0, 0, 0)
    qi_strides = query_index.stride() if query_index is not None else (0, 0, 0)
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    q_split = block_m // cfg.block_m
    # trailing kernel blocks past Nq do nothing but must not exist: trim the last plan block's halves
    n_qblk = min(nqb * q_split, cdiv(Nq, cfg.block_m)) if block_rows is None else nqb * q_split
    if B * Hq * n_qblk >= 2**31:  # one grid dimension: CUDA allows 2^31 - 1 programs along it
        _fail(f"{B * Hq * n_qblk} programs exceed the launch grid (2^31 - 1): use a larger block_m")
    grid = (B * Hq * n_qblk,)
    _block_sparse_attn_fwd[grid](
        q, kk, vv, out, desc_k, desc_v,
        tile_offsets, tile_counts, masked_counts, kidx, qidx, visited if visited is not None else tile_counts,
        lse if lse is not None else out, block_rows if block_rows is not None else tile_counts,
        scale * _LOG2E, float(early_stop), (pv_skip or 0.0) * _LOG2E, max(int(window), 1), max(int(chunk), 1),
        *q.stride(), *kk.stride(), *vv.stride(), *out.stride(),
        *tile_offsets.stride(), *tile_counts.stride(), *masked_counts.stride(),
        *ki_strides, *qi_strides, *lse_strides,
        *k_geo, *v_geo,
        Hq, Nq, Nk, key_len, n_qblk, nqb,
        Hq // Hkv, Hq // tile_offsets.shape[1],
        Hq // key_index.shape[1] if has_kidx else 1,
        Hq // query_index.shape[1] if query_index is not None else 1,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_SPLIT=q_split, TILE_SPLIT=block_n // cfg.block_n,
        HAS_KIDX=has_kidx, HAS_QIDX=query_index is not None, KEY_GATHER=gather, USE_TMA=bool(use_tma),
        EARLY_STOP=early_stop > 0, PV_SKIP=pv_skip is not None, WRITE_VISITED=visited is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        INT64_ROWS=max(q.shape[2] * q.stride(2), out.shape[2] * out.stride(2), kk.shape[2] * kk.stride(2),
                       vv.shape[2] * vv.stride(2)) >= 2**31,
        STAGES=cfg.num_stages,
        MASKED_STAGES=cfg.masked_stages if cfg.masked_stages is not None else min(cfg.num_stages, 2),
        SKIP_MASKED=bool(skip_masked), RESUME=bool(resume), WRITE_LSE=lse is not None and not resume,
        HAS_WINDOW=window > 0, HAS_CHUNK=chunk > 0, PACKED=block_rows is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (out, visited) if return_visited else out
