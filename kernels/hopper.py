"""Block-sparse FlashAttention forward for Hopper (sm_90a) in Gluon: TMA, mbarriers, async wgmma (issue 13).

The same plan contract as the Triton kernel in ``kernels/attention.py`` (``sparse_compile/plan.py`` documents it),
for a subset of it: query block ``i`` visits ``tile_offsets[b, h, i, t]`` for ``t < tile_counts[b, h, i]``; the first
``masked_counts[b, h, i]`` tiles are masked (keys after the query's absolute position, and keys ``>= Nk``, are
excluded), the others are promised fully visible and are not masked; the online softmax runs in base 2 with the
scale folded into the exponent; rows that see no key write zeros. The output is (B, Hq, Nq, D) in the input
dtype, stored as (B, Nq, Hq, D) memory (the model's layout) viewed as (B, Hq, Nq, D).

Subset served (anything else raises ``NotImplementedError`` naming it, so that a caller can fall back;
``kernels.attention.block_sparse_attention`` dispatches here automatically on sm_90 GPUs):
bf16 / fp16; head dim 64 or 128; ``block_m == 128``; ``block_n`` 64 or 128; no early stop, no ``query_index``;
the P.V skip (per row, branch-free, as the Triton kernel: after a tile's denominator update, a row whose tile
maximum is below its running maximum by more than |lambda| zeroes its P for the P.V MMA); ``key_index`` with Hkv
heads (PBS-style permuted keys: the Triton kernel's "copy" key mode, a permuted contiguous K/V copy that TMA reads
like ordinary keys, its logical length may exceed Nk; masked tiles load the tile's key positions from the index
with ordinary loads for the causal / padding mask); any strides whose last dim is contiguous and whose other
strides are 16-byte aligned (TMA); GQA (Hq a multiple of Hkv), tables with Hq or Hkv heads; ``Nq <= Nk``.
``return_visited`` gives the tile counts (no early stop: every block computes its whole list).

Shape of the kernel (FlashAttention-3 style): one CTA per (batch, query head, 128-row query block), ordered as the
Triton kernel orders its programs (the query heads of one KV head fastest, query blocks last-first). Q, K, V and O
move through rank-4 TMA descriptors over the (B, H, N, D) views, so a tile past a head's last row reads zeros and
a store past it is clipped: no row masks anywhere. K/V tiles go through a ``num_stages``-deep shared-memory ring
guarded by mbarriers (ready: the TMA landed; empty: both MMAs that read the slot completed). Two warpgroups
(8 warps) compute, 64 query rows each: S = Q K^T by ``warpgroup_mma`` from shared memory, the softmax in
registers, O += P V with P from registers (dot-operand layout) and V from shared memory.

Variants (``variant=``), one kernel specialised by two constexprs:

* ``"tma"``: no warp specialisation; the compute warps issue the TMA loads themselves, ``num_stages`` tiles
  ahead (a tile's slot is refilled as soon as its P.V has completed);
* ``"tma_ov"``: as "tma", with FA3's intra-warpgroup overlap in the loop over unmasked tiles: S(t+1) = Q K(t+1)^T
  and O += P(t) V(t) are issued back to back, and the softmax of tile t+1 runs while P(t) V(t) is in flight;
* ``"ws"``: warp-specialised (``gl.warp_specialize``): a 1-warp producer partition (24 registers) issues every
  TMA load and waits on the ring's empty barriers; the 8 compute warps only wait, compute and release;
* ``"ws_ov"``: "ws" with the intra-warpgroup overlap;
* ``"ws2"`` / ``"ws2_ov"``: as "ws" / "ws_ov" but with two 4-warp compute partitions of 64 query rows each (FA3's
  two consumer warpgroups, scheduled independently; a ring slot is free once both have arrived on its empty bar).

Default: ``"ws2_ov"`` with 3 stages, the fastest on the H100 (benchmarks/NOTES_hopper.md: 1.08-1.18x cuDNN's
speed at rho=1, 16K-64K, D=128); with 2 stages the overlap variants wait on the slot they have not yet released.

Masked tiles (listed first; usually only the diagonal) run one at a time, without the overlap.

Written against the Gluon API of Triton 3.6 (``triton.experimental.gluon``); other versions may differ in it (the
module imports without Gluon and the wrapper then raises NotImplementedError).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .validate import cdiv, validate_qkv

__all__ = ["hopper_block_sparse_attention", "HOPPER_VARIANTS", "hopper_unsupported", "GLUON_IMPORT_ERROR"]

HOPPER_VARIANTS = ("tma", "tma_ov", "ws", "ws_ov", "ws2", "ws2_ov")
_LOG2E = 1.4426950408889634

GLUON_IMPORT_ERROR: Optional[str] = None
try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception as exc:  # pragma: no cover - no Gluon (or a different API) here: the wrapper refuses
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


if GLUON_IMPORT_ERROR is None:

    # -----------------------------------------------------------------------------------------------------------
    # device code
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tile_ptr, stride_tt, t, n_tiles, b, hkv,
                  STAGES: gl.constexpr):
        """TMA loads of plan tile ``t`` (if it exists) into ring slot ``t % STAGES``, signalling its ready bars."""
        s = t % STAGES
        pred = t < n_tiles
        start = gl.load(tile_ptr + t * stride_tt, mask=pred, other=0)
        mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc_k, [b, hkv, start, 0], k_ready.index(s), k_bufs.index(s), pred=pred)
        mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc_v, [b, hkv, start, 0], v_ready.index(s), v_bufs.index(s), pred=pred)

    @gluon.jit
    def _release(t, desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, kv_empty, tile_ptr, stride_tt, n_tiles, b, hkv,
                 STAGES: gl.constexpr, WARP_SPEC: gl.constexpr):
        """Plan tile ``t``'s slot is no longer read (both its MMAs completed in every warpgroup of this partition):
        hand it to the producer partition, or (no producer) refill it with tile ``t + STAGES`` ourselves."""
        # thread 0 signals / issues for the whole partition: every warpgroup must have retired its MMAs first
        gl.thread_barrier()
        if WARP_SPEC:
            mbarrier.arrive(kv_empty.index(t % STAGES), count=1)
        else:
            _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tile_ptr, stride_tt, t + STAGES, n_tiles, b,
                      hkv, STAGES)

    @gluon.jit
    def _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, start, N_K, KEY_LEN, kidx_base, stride_kip,
                     MASKED: gl.constexpr, HAS_KIDX: gl.constexpr, PV_SKIP: gl.constexpr, BLOCK_N: gl.constexpr,
                     s_layout: gl.constexpr):
        """Online-softmax step on raw scores ``s_acc``: returns (p, alpha, m_new, l_new), p in float32."""
        if MASKED:
            k_pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if HAS_KIDX:
                # keys read from the permuted copy: logical key p sits at position key_index[p] (< 0: padding)
                phys = gl.load(kidx_base + k_pos * stride_kip, mask=k_pos < KEY_LEN, other=-1)
                valid = (phys >= 0) & (phys < N_K)
                visible = valid[None, :] & (phys[None, :] <= q_pos[:, None])
            else:
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < N_K)
            s = gl.where(visible, s_acc * qk_scale, float("-inf"))
            tile_max = gl.max(s, axis=1)
            m_new = gl.maximum(m_i, tile_max)
            p = gl.exp2(s - m_new[:, None])
        else:
            # scale > 0: max(s) * scale == max(s * scale); one FMA per score
            tile_max = gl.max(s_acc, axis=1) * qk_scale
            m_new = gl.maximum(m_i, tile_max)
            p = gl.exp2(s_acc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        if PV_SKIP:
            # per row, branch-free (as the Triton kernel): a row whose tile maximum is far below its running
            # maximum drops its P.V share; its denominator keeps the gain
            p = gl.where((tile_max - m_new >= pv_lambda)[:, None], p, 0.0)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _attend_tile(t, start, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, m_i, l_i, qk_scale, pv_lambda,
                     q_pos, N_K, KEY_LEN, kidx_base, stride_kip, MASKED: gl.constexpr, HAS_KIDX: gl.constexpr,
                     PV_SKIP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                     row_o: gl.constexpr, p_layout: gl.constexpr):
        """Plan tile ``t`` (ring slot ``t % STAGES``) without overlap: S = Q K^T, softmax, O += P V.
        Returns (acc, m_i, l_i); the caller releases the slot."""
        s = t % STAGES
        ph = (t // STAGES) & 1
        k_buf = k_bufs.index(s)
        v_buf = v_bufs.index(s)
        mbarrier.wait(k_ready.index(s), ph)
        s_acc = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, q_smem, k_buf))
        p, alpha, m_i, l_i = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, start, N_K, KEY_LEN,
                                           kidx_base, stride_kip, MASKED, HAS_KIDX, PV_SKIP, BLOCK_N, s_layout)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        mbarrier.wait(v_ready.index(s), ph)
        acc = warpgroup_mma(p16, v_buf, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16, v_buf))
        return acc, m_i, l_i

    @gluon.jit
    def _consumer(desc_k, desc_v, desc_o, q_all, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                  tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                  pv_lambda, KEY_LEN, kidx_base, stride_kip,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  WARP_SPEC: gl.constexpr, OVERLAP: gl.constexpr, NUM_WARPS: gl.constexpr,
                  ROWS: gl.constexpr, ROW0: gl.constexpr, HAS_KIDX: gl.constexpr, PV_SKIP: gl.constexpr):
        """Compute partition: query rows [ROW0, ROW0 + ROWS) of the block (all 128, or one warpgroup's 64)."""
        gl.static_assert(ROWS == 16 * NUM_WARPS, "one m16 wgmma atom row per warp: rows = 16 * warps")
        dtype: gl.constexpr = q_all.dtype
        if ROWS == BLOCK_M:
            q_smem = q_all
        else:
            q_smem = q_all.slice(ROW0, ROWS, dim=0)
        # wgmma: m16 atoms over the warps along M (two warpgroups x 64 rows), the whole tile width in one instr
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_pos = qblk * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=row_s) + (N_K - N_Q)
        m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_s)  # finite start: no (-inf) - (-inf)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)

        # -- masked tiles (first in the list): one at a time
        for t in range(0, n_masked):
            start = gl.load(tile_ptr + t * stride_tt)
            acc, m_i, l_i = _attend_tile(t, start, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, m_i, l_i,
                                         qk_scale, pv_lambda, q_pos, N_K, KEY_LEN, kidx_base, stride_kip, True,
                                         HAS_KIDX, PV_SKIP, BLOCK_N, STAGES, s_layout, row_o, p_layout)
            _release(t, desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, kv_empty, tile_ptr, stride_tt, n_tiles, b,
                     hkv, STAGES, WARP_SPEC)

        # -- unmasked tiles: no mask arithmetic
        if OVERLAP:
            if n_masked < n_tiles:
                t0 = n_masked
                s0 = t0 % STAGES
                k_buf = k_bufs.index(s0)
                mbarrier.wait(k_ready.index(s0), (t0 // STAGES) & 1)
                s_acc = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, q_smem, k_buf))
                p, alpha, m_i, l_i = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, 0, N_K, KEY_LEN,
                                                  kidx_base, stride_kip, False, HAS_KIDX, PV_SKIP, BLOCK_N,
                                                  s_layout)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                for t in range(t0 + 1, n_tiles):
                    # issue S(t) = Q K(t)^T, then O += P(t-1) V(t-1); softmax(t) overlaps the second
                    s = t % STAGES
                    sp = (t - 1) % STAGES
                    k_buf = k_bufs.index(s)
                    v_prev = v_bufs.index(sp)
                    mbarrier.wait(k_ready.index(s), (t // STAGES) & 1)
                    s_acc = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    mbarrier.wait(v_ready.index(sp), ((t - 1) // STAGES) & 1)
                    acc = warpgroup_mma(p16, v_prev, acc, is_async=True)
                    s_acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s_acc, q_smem, k_buf))
                    p, alpha, m_i, l_i = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, 0, N_K, KEY_LEN,
                                                  kidx_base, stride_kip, False, HAS_KIDX, PV_SKIP, BLOCK_N,
                                                  s_layout)
                    acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16, v_prev))
                    _release(t - 1, desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, kv_empty, tile_ptr, stride_tt,
                             n_tiles, b, hkv, STAGES, WARP_SPEC)
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    p16 = gl.convert_layout(p.to(dtype), p_layout)
                tl_ = n_tiles - 1
                sl = tl_ % STAGES
                v_last = v_bufs.index(sl)
                mbarrier.wait(v_ready.index(sl), (tl_ // STAGES) & 1)
                acc = warpgroup_mma(p16, v_last, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16, v_last))
                _release(tl_, desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, kv_empty, tile_ptr, stride_tt,
                         n_tiles, b, hkv, STAGES, WARP_SPEC)
        else:
            for t in range(n_masked, n_tiles):
                acc, m_i, l_i = _attend_tile(t, 0, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, m_i, l_i,
                                             qk_scale, pv_lambda, q_pos, N_K, KEY_LEN, kidx_base, stride_kip, False,
                                             HAS_KIDX, PV_SKIP, BLOCK_N, STAGES, s_layout, row_o, p_layout)
                _release(t, desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, kv_empty, tile_ptr, stride_tt,
                         n_tiles, b, hkv, STAGES, WARP_SPEC)

        # -- epilogue: rows that saw nothing have l == 0 and acc == 0 and write zeros; Q's buffer holds O for the
        # TMA store (rows past Nq are clipped by the descriptor)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        gl.thread_barrier()  # every warpgroup is done reading Q before it is overwritten
        q_smem.store(out.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc_o, [b, h, qblk * BLOCK_M + ROW0, 0], q_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _producer(desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                  tile_ptr, stride_tt, n_tiles, b, h, hkv, qblk, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The 1-warp load partition: Q once, then every K/V tile of the list through the ring."""
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, h, qblk * BLOCK_M, 0], q_bar, q_smem)
        for t in range(0, n_tiles):
            s = t % STAGES
            ph = (t // STAGES) & 1
            mbarrier.wait(kv_empty.index(s), ph ^ 1)  # a fresh barrier counts as phase 1 completed
            start = gl.load(tile_ptr + t * stride_tt)
            mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_k, [b, hkv, start, 0], k_ready.index(s), k_bufs.index(s))
            mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_v, [b, hkv, start, 0], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _hopper_fwd_kernel(
        desc_q, desc_k, desc_v, desc_o,
        TileOffsets, TileCounts, MaskedCounts, KeyIndex,
        qk_scale, pv_lambda,
        stride_tb, stride_th, stride_tq, stride_tt,
        stride_cb, stride_ch, stride_cq,
        stride_mb, stride_mh, stride_mq,
        stride_kib, stride_kih, stride_kip,
        H_Q, N_Q, N_K, KEY_LEN, N_QBLK, GQA, PLAN_DIV,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        WARP_SPEC: gl.constexpr, OVERLAP: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, HAS_KIDX: gl.constexpr, PV_SKIP: gl.constexpr,
    ):
        gl.static_assert(not SPLIT or WARP_SPEC, "two compute partitions need the producer partition")
        # -- (batch, query head, query block): the query heads of one KV head fastest, query blocks last-first
        pid = gl.program_id(0)
        n_kv = H_Q // GQA
        h_in = pid % GQA
        rest = pid // GQA
        qblk = N_QBLK - 1 - rest % N_QBLK
        bkv = rest // N_QBLK
        b = bkv // n_kv
        hkv = bkv % n_kv
        h = hkv * GQA + h_in
        b64 = b.to(gl.int64)
        hp = (h // PLAN_DIV).to(gl.int64)
        tile_ptr = TileOffsets + b64 * stride_tb + hp * stride_th + qblk.to(gl.int64) * stride_tq
        n_tiles = gl.load(TileCounts + b64 * stride_cb + hp * stride_ch + qblk * stride_cq)
        n_masked = gl.minimum(gl.load(MaskedCounts + b64 * stride_mb + hp * stride_mh + qblk * stride_mq), n_tiles)
        # key positions of the permuted copy (an index with Hkv heads: one per KV head); read in masked tiles only
        kidx_base = KeyIndex + b64 * stride_kib + hkv.to(gl.int64) * stride_kih

        # -- shared memory: Q (reused for O), the K/V ring, barriers
        dtype: gl.constexpr = desc_q.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2 if SPLIT else 1)  # one arrival per compute partition
        fence_async_shared()

        if SPLIT:
            # FA3's layout: two compute warpgroups, each its own partition with 64 query rows, scheduled
            # independently by the hardware (one's softmax overlaps the other's MMAs), plus the load warp
            HALF: gl.constexpr = BLOCK_M // 2
            gl.warp_specialize([
                (_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                             pv_lambda, KEY_LEN, kidx_base, stride_kip,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, WARP_SPEC, OVERLAP, NUM_WARPS, HALF, 0,
                             HAS_KIDX, PV_SKIP)),
                (_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                             pv_lambda, KEY_LEN, kidx_base, stride_kip,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, WARP_SPEC, OVERLAP, NUM_WARPS, HALF, HALF,
                             HAS_KIDX, PV_SKIP)),
                (_producer, (desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             tile_ptr, stride_tt, n_tiles, b, h, hkv, qblk, BLOCK_M, STAGES)),
            ], [NUM_WARPS, 1], [CONSUMER_REGS, 24])
        elif WARP_SPEC:
            gl.warp_specialize([
                (_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                             pv_lambda, KEY_LEN, kidx_base, stride_kip,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, WARP_SPEC, OVERLAP, NUM_WARPS, BLOCK_M, 0,
                             HAS_KIDX, PV_SKIP)),
                (_producer, (desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             tile_ptr, stride_tt, n_tiles, b, h, hkv, qblk, BLOCK_M, STAGES)),
            ], [1], [24])
        else:
            mbarrier.expect(q_bar, desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [b, h, qblk * BLOCK_M, 0], q_bar, q_smem)
            for i in gl.static_range(STAGES):
                _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tile_ptr, stride_tt, i, n_tiles, b, hkv,
                          STAGES)
            _consumer(desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                      tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                      pv_lambda, KEY_LEN, kidx_base, stride_kip,
                      HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, WARP_SPEC, OVERLAP, NUM_WARPS, BLOCK_M, 0,
                      HAS_KIDX, PV_SKIP)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(kv_empty.index(i))


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# variant -> (warp-specialised, intra-warpgroup overlap, one compute partition per warpgroup)
_VARIANT_FLAGS = {"tma": (False, False, False), "tma_ov": (False, True, False), "ws": (True, False, False),
                  "ws_ov": (True, True, False), "ws2": (True, False, True), "ws2_ov": (True, True, True)}
BLOCK_M = 128
NUM_WARPS = 8  # two consumer warpgroups of 64 rows
CONSUMER_REGS = 240  # registers per thread of the second compute partition (split variants)


def _is_16b_aligned(x: torch.Tensor) -> bool:
    es = x.element_size()
    return x.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in x.stride()[:-1])


#: an H100's shared memory per block (227 KiB)
SHARED_MEMORY_LIMIT = 227 * 1024


def shared_memory_bytes(head_dim: int, block_n: int, num_stages: int, element_size: int = 2) -> int:
    """Q (and the output staging in its buffer) plus ``num_stages`` K and V tiles, plus the ring's barriers."""
    return element_size * head_dim * (BLOCK_M + 2 * num_stages * block_n) + 8 * (3 * num_stages + 1)


def hopper_unsupported(q, k, v, tile_offsets=None, *, block_m: int = 128, block_n: int = 128,
                       key_index=None, query_index=None, early_stop: float = 0.0, pv_skip=None,
                       num_stages: int = 3, variant: str = "ws2_ov") -> Optional[str]:
    """Why the Hopper kernel cannot run this call (a sentence), or None when it can. Checks no plan values."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon (triton.experimental.gluon, Triton 3.6 API) unavailable: {GLUON_IMPORT_ERROR}"
    if variant not in _VARIANT_FLAGS:
        return f"variant {variant!r} unknown (one of {', '.join(HOPPER_VARIANTS)})"
    if key_index is not None:
        if key_index.dim() != 3 or key_index.shape[1] != k.shape[1]:
            return (f"key_index with {key_index.shape[1] if key_index.dim() == 3 else '?'} heads: the permuted copy "
                    f"needs one per KV head ({k.shape[1]})")
        if key_index.shape[-1] == 0:
            return "an empty key_index"
    if query_index is not None:
        return "query_index (permuted queries) is not supported"
    if early_stop and early_stop > 0:
        return "early stop is not supported"
    if pv_skip is not None and not (pv_skip < 0 and math.isfinite(pv_skip)):
        return f"pv_skip={pv_skip!r} is not supported (a finite negative number)"
    if not q.is_cuda:
        return f"inputs on {q.device}: needs a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"needs an sm_90 GPU, got sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype} is not supported (bfloat16, float16)"
    D = q.shape[-1]
    if D not in (64, 128):
        return f"head dim {D} is not supported (64 or 128)"
    if block_m != BLOCK_M:
        return f"block_m={block_m} is not supported (128)"
    if block_n not in (64, 128):
        return f"block_n={block_n} is not supported (64 or 128)"
    if num_stages not in (2, 3, 4):
        return f"num_stages={num_stages} is not supported (2, 3 or 4)"
    smem = shared_memory_bytes(D, block_n, num_stages, q.element_size())
    if smem > SHARED_MEMORY_LIMIT:
        return (f"num_stages={num_stages} needs {smem // 1024} KiB of shared memory at D={D}, block_n={block_n} "
                f"(limit {SHARED_MEMORY_LIMIT // 1024} KiB)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            return f"{name} has a non-contiguous last dim (stride {x.stride(-1)})"
        if not _is_16b_aligned(x):
            return f"{name} is not 16-byte aligned in its pointer or strides {tuple(x.stride())} (TMA)"
    return None


def _desc(x: torch.Tensor, rows: int, layout_cache: dict):
    """Rank-4 TMA descriptor over (B, H, N, D) with boxes of one head's ``rows`` x D rows (zero fill past N)."""
    B, H, N, D = x.shape
    key = (x.dtype, rows, D)
    if key not in layout_cache:
        layout_cache[key] = gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], getattr(gl, _GL_DTYPES[x.dtype]))
    return TensorDescriptor(x, [B, H, N, D], list(x.stride()), [1, 1, rows, D], layout_cache[key])


_LAYOUTS: dict = {}


def hopper_block_sparse_attention(q, k, v, tile_offsets, tile_counts, masked_counts, *, block_n: int,
                                  scale: Optional[float] = None, num_stages: Optional[int] = None,
                                  variant: str = "ws2_ov",
                                  block_m: int = 128, key_index=None, query_index=None, early_stop: float = 0.0,
                                  pv_skip=None, return_visited: bool = False):
    """Block-sparse causal attention over tile lists (the plan contract, module docstring) on an H100.

    q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q's dtype, stored as (B, Nq, Hq, D) memory.
    ``num_stages``: K/V ring depth, 2 to 4 where shared memory allows (None: 3; at D=128, block_n=128 that is
    224 KiB, the most that fits).
    ``pv_skip`` lambda < 0 (natural-log units) drops a row's P.V share of a tile as the Triton kernel does;
    ``key_index`` (Hkv heads) is served by a permuted contiguous K/V copy read by TMA, the index itself read in
    masked tiles for positions. ``return_visited``: also the int32 (B, Hq, n_query_blocks) tiles each block
    computed (without early stop, its tile count).
    Raises NotImplementedError naming the first unsupported feature (the caller falls back to the Triton kernel)
    and ValueError for malformed inputs. ``variant``: one of HOPPER_VARIANTS (module docstring).
    """
    if num_stages is None:
        num_stages = 3
    why = hopper_unsupported(q, k, v, tile_offsets, block_m=block_m, block_n=block_n, key_index=key_index,
                             query_index=query_index, early_stop=early_stop, pv_skip=pv_skip, num_stages=num_stages,
                             variant=variant)
    if why is not None:
        raise NotImplementedError(f"hopper_block_sparse_attention: {why}")
    validate_qkv(q, k, v, who="hopper_block_sparse_attention")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb = cdiv(Nq, BLOCK_M)
    for name, t, rank in (("tile_offsets", tile_offsets, 4), ("tile_counts", tile_counts, 3),
                          ("masked_counts", masked_counts, 3)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != rank or t.device != q.device:
            raise ValueError(f"hopper_block_sparse_attention: {name} must be an int32 {rank}-D tensor on {q.device}")
        if t.shape[0] != B or t.shape[1] not in (Hq, Hkv) or t.shape[2] != nqb:
            raise ValueError(f"hopper_block_sparse_attention: {name} has shape {tuple(t.shape)}; expected "
                             f"({B}, {Hq} or {Hkv}, {nqb}, ...)")
    if tile_counts.shape != tile_offsets.shape[:3] or masked_counts.shape != tile_counts.shape:
        raise ValueError("hopper_block_sparse_attention: tile_offsets, tile_counts and masked_counts disagree")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"hopper_block_sparse_attention: scale must be positive and finite, got {scale!r}")

    if key_index is not None:
        if not isinstance(key_index, torch.Tensor) or key_index.dtype != torch.int32 or key_index.device != q.device \
                or key_index.shape[0] != B:
            raise ValueError(f"hopper_block_sparse_attention: key_index must be an int32 (B={B}, Hkv={Hkv}, L) "
                             f"tensor on {q.device}")

    out = torch.empty(B, Nq, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    visited = None
    if return_visited:
        # no early stop: every block computes its whole list (a copy, one column per query head)
        g = Hq // tile_counts.shape[1]
        visited = tile_counts[:, :, None, :].expand(B, tile_counts.shape[1], g, nqb).reshape(B, Hq, nqb).clone()
    if out.numel() == 0:
        return (out, visited) if return_visited else out
    warp_spec, overlap, split = _VARIANT_FLAGS[variant]
    if key_index is not None:
        # the Triton kernel's "copy" key mode: K/V rows in key_index order, contiguous; TMA reads the copy like
        # ordinary keys (boxes past its end read zeros: those logical keys are padding, masked by position)
        from .attention import _permute_keys

        kk, vv = _permute_keys(k, v, key_index, D)
        key_len = key_index.shape[-1]
        kidx, ki_strides = key_index, tuple(key_index.stride())
    else:
        kk, vv, key_len = k, v, Nk
        kidx, ki_strides = tile_counts, (0, 0, 0)  # any int32 tensor: never read without HAS_KIDX
    desc_q = _desc(q, BLOCK_M, _LAYOUTS)
    desc_o = _desc(out, BLOCK_M // 2 if split else BLOCK_M, _LAYOUTS)  # each compute partition stores its rows
    desc_k = _desc(kk, block_n, _LAYOUTS)
    desc_v = _desc(vv, block_n, _LAYOUTS)
    grid = (B * Hq * nqb,)
    kwargs = dict(num_warps=4 if split else NUM_WARPS)
    if warp_spec:
        # 8 compute warps + 1 load warp, allocated by warpgroup: 12 warps x 168 registers fit the 64K register
        # file; the load warp's group gives up all but 24 and the compute warps take the rest
        kwargs["maxnreg"] = 168
    _hopper_fwd_kernel[grid](
        desc_q, desc_k, desc_v, desc_o,
        tile_offsets, tile_counts, masked_counts, kidx,
        scale * _LOG2E, float(pv_skip if pv_skip is not None else 0.0) * _LOG2E,
        *tile_offsets.stride(), *tile_counts.stride(), *masked_counts.stride(), *ki_strides,
        Hq, Nq, Nk, key_len, nqb, Hq // Hkv, Hq // tile_offsets.shape[1],
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=num_stages,
        WARP_SPEC=warp_spec, OVERLAP=overlap, NUM_WARPS=4 if split else NUM_WARPS, SPLIT=split,
        CONSUMER_REGS=CONSUMER_REGS, HAS_KIDX=key_index is not None, PV_SKIP=pv_skip is not None,
        **kwargs,
    )
    return (out, visited) if return_visited else out
