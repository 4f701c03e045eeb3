"""Block-sparse FlashAttention forward for Hopper (sm_90a) in Gluon: TMA, mbarriers, async wgmma.

The plan contract of the Triton kernel in ``kernels/attention.py`` (``sparse_compile/plan.py`` documents it), for a
subset: masked tiles exclude keys after the query's absolute position and keys ``>= Nk`` (no window / chunk band),
unmasked ones are not masked; base-2 online softmax, scale folded in; rows that see no key write zeros. The output
is (B, Hq, Nq, D) in the input dtype, stored as (B, Nq, Hq, D) memory (the model's layout).

Subset served (anything else raises ``NotImplementedError`` naming it, so that a caller can fall back;
``kernels.attention.block_sparse_attention`` dispatches here on sm_90 GPUs): bf16 / fp16; head dim 64 or 128;
``block_m == 128``; ``block_n`` 64 or 128; ``query_index``; early stop; the P.V skip (per row, branch-free);
``key_index`` with Hkv heads, read through a permuted contiguous K/V copy by TMA or, with ``key_gather`` (the
default for lists over ``GATHER_LIST_RATIO`` x Nk), in place by a 4-warp cp.async load partition; a contiguous last
dim, 16-byte aligned strides; GQA; ``Nq <= Nk``; ``return_visited``; S2O's two passes over one softmax (``lse=``,
``resume=True``, ``skip_masked=True``).

Shape (FlashAttention-3's): one CTA per (batch, query head, 128-row query block), ordered as the Triton kernel's
programs; rank-4 TMA descriptors (no row masks); a ``num_stages``-deep K/V ring guarded by ready / empty mbarriers;
warp-specialised: a load partition (1 warp; 4 when it gathers) and two 4-warp compute warpgroups of 64 rows, each
issuing S(t+1) = Q K^T with O += P(t) V(t). Early stop is a vote of the two warpgroups after each tile (both leave
after the same one); ``PINGPONG`` staggers their start; ``PERSISTENT`` CTAs (short lists: S2O's window pass) take
blocks in turn. The mechanics (vote slots, ring phases across blocks) and what each choice measured: docs/kernels.md
("The Hopper kernel").

Written against the Gluon API of Triton 3.6 (``triton.experimental.gluon``); other versions may differ in it (the
module imports without Gluon and the wrapper then raises NotImplementedError).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .validate import cdiv, validate_passes, validate_qkv

__all__ = ["hopper_block_sparse_attention", "hopper_unsupported", "gathers_by_default", "GLUON_IMPORT_ERROR"]

_LOG2E = 1.4426950408889634

GLUON_IMPORT_ERROR: Optional[str] = None
try:
    import triton  # noqa: F401  (Gluon needs it importable first)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .common import jit_any_length
except Exception as exc:  # pragma: no cover - no Gluon (or a different API) here: the wrapper refuses
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


if GLUON_IMPORT_ERROR is None:

    # -----------------------------------------------------------------------------------------------------------
    # device code
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tile_ptr, stride_tt, t, pred, b, hkv,
                  STAGES: gl.constexpr):
        """TMA loads of plan tile ``t`` into ring slot ``t % STAGES`` (only if ``pred``: the tile exists and the walk
        goes on), signalling its ready bars."""
        s = t % STAGES
        start = gl.load(tile_ptr + t * stride_tt, mask=pred, other=0)
        mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc_k, [b, hkv, start, 0], k_ready.index(s), k_bufs.index(s), pred=pred)
        mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc_v, [b, hkv, start, 0], v_ready.index(s), v_bufs.index(s), pred=pred)

    @gluon.jit
    def _release(t, kv_empty, STAGES: gl.constexpr):
        """Plan tile ``t``'s slot is no longer read (both its MMAs completed in every warp of this partition): hand
        it to the load partition."""
        # thread 0 signals for the whole partition: every warp must have retired its MMAs first
        gl.thread_barrier()
        mbarrier.arrive(kv_empty.index(t % STAGES), count=1)

    @gluon.jit
    def _key_positions(start, N_K, KEY_LEN, kidx_base, stride_kip, HAS_KIDX: gl.constexpr, BLOCK_N: gl.constexpr,
                       s_layout: gl.constexpr):
        """Positions of a masked tile's keys (logical list entries ``start ..``), padding and keys past N_K at a
        position no query reaches. Callers read them before waiting for the tile's S = Q K^T, so the index load's
        latency hides behind the MMA instead of stalling the softmax."""
        k_pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if HAS_KIDX:
            # keys read from the permuted copy or gathered: logical key p sits at position key_index[p] (< 0: padding)
            phys = gl.load(kidx_base + k_pos * stride_kip, mask=k_pos < KEY_LEN, other=-1)
            return gl.where((phys >= 0) & (phys < N_K), phys, 1 << 30)
        else:
            return gl.where(k_pos < N_K, k_pos, 1 << 30)

    @gluon.jit
    def _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, key_pos, MASKED: gl.constexpr,
                     PV_SKIP: gl.constexpr):
        """Online-softmax step on raw scores ``s_acc`` (masked tiles: keys at ``key_pos``, from ``_key_positions``):
        returns (p, alpha, m_new, l_new, gain, l_prev), p in float32; ``gain`` (the tile's share of the denominator)
        and ``l_prev`` (the denominator before it, at the new maximum) are early stop's inputs."""
        s = s_acc
        if MASKED:
            s = gl.where(key_pos[None, :] <= q_pos[:, None], s_acc, float("-inf"))
        # scale > 0: max(s) * scale == max(s * scale) (and -inf stays -inf); one FMA per score
        tile_max = gl.max(s, axis=1) * qk_scale
        m_new = gl.maximum(m_i, tile_max)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        gain = gl.sum(p, axis=1)
        l_prev = l_i * alpha
        l_new = l_prev + gain
        if PV_SKIP:
            # per row, branch-free (as the Triton kernel): a row whose tile maximum is far below its running
            # maximum drops its P.V share; its denominator keeps the gain
            p = gl.where((tile_max - m_new >= pv_lambda)[:, None], p, 0.0)
        return p, alpha, m_new, l_new, gain, l_prev

    @gluon.jit
    def _publish_vote(gain, l_prev, row_ok, es_tau, j, votes, vote_bar, WG: gl.constexpr,
                      VOTE_SLOTS: gl.constexpr, vote_layout: gl.constexpr):
        """Early stop: this warpgroup's vote on the ``j``-th unmasked tile (1: one of its real rows gained at least
        tau of what it had; NaN compares false) into ``votes``, announced on ``vote_bar``. Returns the vote."""
        mine = gl.max(gl.where(row_ok & (gain >= es_tau * l_prev), 1, 0), axis=0)
        slot = j % VOTE_SLOTS
        votes.index(2 * slot + WG).store(gl.full([1], 0, gl.int32, layout=vote_layout) + mine)
        gl.thread_barrier()  # every thread's store before the (one-thread) arrival
        mbarrier.arrive(vote_bar.index(slot), count=1)
        return mine

    @gluon.jit
    def _goes_on(mine, j, votes, vote_bar, WG: gl.constexpr, VOTE_SLOTS: gl.constexpr,
                 vote_layout: gl.constexpr):
        """Whether the block goes on after its ``j``-th unmasked tile: some row of either warpgroup gained. A
        warpgroup with a gaining row decides alone; one without waits for the other's vote (both always vote,
        so both reach the same decision)."""
        slot = j % VOTE_SLOTS
        mbarrier.wait(vote_bar.index(slot), (j // VOTE_SLOTS) & 1, pred=mine == 0)
        other = gl.max(votes.index(2 * slot + 1 - WG).load(vote_layout), axis=0)
        return (mine > 0) | (other > 0)

    @gluon.jit
    def _drain(last, n_tiles, k_ready, v_ready, STAGES: gl.constexpr):
        """After an early stop at plan tile ``last``: the producer issued tiles up to ``last + STAGES - 1`` (it
        sees the stop when it would refill ``last``'s slot); wait for them to land so no TMA outlives the CTA."""
        for x in range(last + 1, gl.minimum(last + STAGES, n_tiles)):
            mbarrier.wait(k_ready.index(x % STAGES), (x // STAGES) & 1)
            mbarrier.wait(v_ready.index(x % STAGES), (x // STAGES) & 1)

    @gluon.jit
    def _row_index(qidx_base, stride_qip, row0, N_Q, ROWS: gl.constexpr, HAS_QIDX: gl.constexpr,
                   row_layout: gl.constexpr):
        """Physical rows of logical rows ``row0 ..`` (through the query index if any) in ``row_layout``, and
        which of them exist (rows past N_Q read row 0, masked)."""
        rows = row0 + gl.arange(0, ROWS, layout=row_layout)
        ok = rows < N_Q
        if HAS_QIDX:
            phys = gl.load(qidx_base + rows * stride_qip, mask=ok, other=0)
        else:
            phys = rows
        return phys, ok

    @gluon.jit
    def _read_query_rows(q_base, stride_qn, phys, ok, HEAD_DIM: gl.constexpr, ld: gl.constexpr):
        """Permuted queries: the Q rows ``phys`` (from ``_row_index`` in ``ld``'s rows; missing rows read zeros)
        into registers, for ``_store_query_rows``. TMA cannot gather rows on Hopper, so ordinary loads."""
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        mask = ok[:, None] & (d[None, :] < HEAD_DIM)
        return gl.load(q_base + phys.to(gl.int64)[:, None] * stride_qn + d[None, :], mask=mask, other=0.0)

    @gluon.jit
    def _store_query_rows(q_smem, x):
        q_smem.store(x)
        fence_async_shared()  # generic-proxy writes before the wgmma (async proxy) reads them
        gl.thread_barrier()

    @gluon.jit
    def _output_rows(o_base, stride_on, phys_o, ok_o, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
        """Pointers and mask of O's physical rows ``phys_o`` (``_row_index`` in the accumulator's row layout).
        Built where used: kept live across the walk they would hold 64 registers."""
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        return (o_base + phys_o.to(gl.int64)[:, None] * stride_on + d_o[None, :],
                ok_o[:, None] & (d_o[None, :] < HEAD_DIM))

    @gluon.jit
    def _consumer(desc_k, desc_v, desc_o, q_all, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, votes, vote_bar,
                  turn, tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                  pv_lambda, es_tau, KEY_LEN, kidx_base, stride_kip,
                  q_base, stride_qn, o_base, stride_on, qidx_base, stride_qip, visited_ptr, lse_base, stride_ln,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  NUM_WARPS: gl.constexpr, ROWS: gl.constexpr, ROW0: gl.constexpr, HAS_KIDX: gl.constexpr,
                  PV_SKIP: gl.constexpr,
                  HAS_QIDX: gl.constexpr, EARLY_STOP: gl.constexpr, VOTE_SLOTS: gl.constexpr,
                  RESUME: gl.constexpr, WRITE_LSE: gl.constexpr, PINGPONG: gl.constexpr, tl_row,
                  TIMELINE: gl.constexpr, g, item_i, q_empty, PERSISTENT: gl.constexpr):
        """Compute partition: one warpgroup, query rows [ROW0, ROW0 + ROWS) of the block.

        ``g``: the ring position of the block's first tile (a persistent CTA's earlier blocks used the ring before
        it; 0 otherwise), ``item_i``: how many blocks this CTA computed before (the parity of Q's barriers)."""
        gl.static_assert(not PERSISTENT or (not HAS_QIDX and not EARLY_STOP and not RESUME),
                         "persistent CTAs: Q by TMA, no early stop, no resume")
        gl.static_assert(ROWS == 16 * NUM_WARPS, "one m16 wgmma atom row per warp: rows = 16 * warps")
        gl.static_assert(not EARLY_STOP or ROWS * 2 == BLOCK_M, "early stop votes between two compute warpgroups")
        WG: gl.constexpr = ROW0 // ROWS
        dtype: gl.constexpr = q_all.dtype
        _stamp(tl_row, 1 + 5 * WG, n_tiles, TIMELINE)
        if TIMELINE:
            if WG == 0:
                smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [n_tiles], dtype=gl.int32,
                                                 is_pure=False, pack=1)
                gl.store(tl_row, smid.to(gl.int64))
                gl.store(tl_row + 14, n_tiles.to(gl.int64))
        q_smem = q_all.slice(ROW0, ROWS, dim=0)
        # wgmma: m16 atoms over the warps along M (two warpgroups x 64 rows), the whole tile width in one instr
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        vote_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                     warps_per_cta=[NUM_WARPS], order=[0])

        # every load of the prologue (query indices, then the rows they name) is issued before any value is used,
        # so that their latencies overlap instead of adding up before the first MMA
        row0 = qblk * BLOCK_M + ROW0
        phys, row_ok = _row_index(qidx_base, stride_qip, row0, N_Q, ROWS, HAS_QIDX, row_s)
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[256 // HEAD_DIM, HEAD_DIM // 8],
                                            warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
        if HAS_QIDX:
            phys_ld, ok_ld = _row_index(qidx_base, stride_qip, row0, N_Q, ROWS, HAS_QIDX, gl.SliceLayout(1, ld))
        if RESUME:
            phys_o, ok_o = _row_index(qidx_base, stride_qip, row0, N_Q, ROWS, HAS_QIDX, row_o)
        if HAS_QIDX:
            q_rows = _read_query_rows(q_base, stride_qn, phys_ld, ok_ld, HEAD_DIM, ld)
        if RESUME:
            # a first pass left each row's normalised output in O and its log2-sum-exp2 in lse: the softmax state
            # (acc = O, m = lse, l = 1); a row that saw nothing (lse = -inf) starts empty
            lse0 = gl.load(lse_base + phys.to(gl.int64) * stride_ln, mask=row_ok, other=float("-inf"))
            o_ptrs, o_mask = _output_rows(o_base, stride_on, phys_o, ok_o, HEAD_DIM, o_layout)
            o_prev = gl.load(o_ptrs, mask=o_mask, other=0.0)
        if HAS_QIDX:
            q_pos = gl.where(row_ok, phys + (N_K - N_Q), -1)
        else:
            q_pos = phys + (N_K - N_Q)
        m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_s)  # finite start: no (-inf) - (-inf)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        if HAS_QIDX:
            _store_query_rows(q_smem, q_rows)
        else:
            mbarrier.wait(q_bar, item_i & 1)
        _stamp(tl_row, 2 + 5 * WG, n_tiles, TIMELINE)
        if RESUME:
            seen = lse0 != float("-inf")
            m_i = gl.where(seen, lse0, m_i)
            l_i = gl.where(seen, l_i + 1.0, l_i)
            acc = o_prev.to(gl.float32)
        else:
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

        # -- unmasked tiles need no mask arithmetic; masked ones (first in the list) are never subject to early
        # stop. With early stop the walk is a while loop that both warpgroups leave after the same tile
        # (``_goes_on``); ``last`` is the last tile computed
        # ring positions are absolute (t = g .. g + n_tiles - 1): plan entry t - g sits at tp + t * stride_tt
        tp = tile_ptr + (0 - g) * stride_tt
        end = g + n_tiles
        masked_end = g + n_masked
        last = end - 1
        # every tile, masked ones included, through the overlapped step: S(t) is issued before O += P(t-1) V(t-1)
        if n_tiles > 0:
            # the first tile's key positions (read only if it is masked) before its S is waited for
            key_pos = _key_positions(gl.load(tile_ptr), N_K, KEY_LEN, kidx_base, stride_kip, HAS_KIDX, BLOCK_N,
                                     s_layout)
            k_first = k_bufs.index(g % STAGES)
            mbarrier.wait(k_ready.index(g % STAGES), (g // STAGES) & 1)
            if PINGPONG > 0:
                if WG == 1:
                    mbarrier.wait(turn.index(1), item_i & 1)
            s_acc = warpgroup_mma(q_smem, k_first.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG == 1:
                if WG == 0:
                    mbarrier.arrive(turn.index(1), count=1)
            s_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, q_smem, k_first))
            _stamp(tl_row, 3 + 5 * WG, n_tiles, TIMELINE)
            if n_masked > 0:
                p, alpha, m_i, l_i, gain, l_prev = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos,
                                                                 key_pos, True, PV_SKIP)
            else:
                p, alpha, m_i, l_i, gain, l_prev = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, 0,
                                                                 False, PV_SKIP)
            if RESUME:
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            # (otherwise acc is still zero: no rescale)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            # each masked tile's start is read one step ahead: its latency would otherwise stall the issue of
            # the tile's key-position load, which itself must land before the softmax
            start = gl.load(tile_ptr + stride_tt, mask=n_masked > 1, other=0)
            for t in range(g + 1, masked_end):
                key_pos = _key_positions(start, N_K, KEY_LEN, kidx_base, stride_kip, HAS_KIDX, BLOCK_N, s_layout)
                start = gl.load(tp + (t + 1) * stride_tt, mask=t + 1 < masked_end, other=0)
                acc, m_i, l_i, p16, gain, l_prev = _overlapped_step(
                    t, key_pos, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, acc, m_i, l_i, p16,
                    qk_scale, pv_lambda, q_pos, True, PV_SKIP, STAGES, row_o, p_layout)
            t1 = gl.maximum(masked_end, g + 1)  # the first unmasked tile not yet computed
            if EARLY_STOP:
                # the vote on tile t-1 runs while S(t) and P(t-1) V(t-1) are on the tensor cores (S(t) is
                # computed before the walk knows it goes on; a stop discards it). Only unmasked tiles vote
                t = t1
                go = t1 < end
                pv_pending = True  # P(last) V(last) not yet issued
                while go:
                    acc, m_i, l_i, p16, gain, l_prev, goes_on = _voting_step(
                        t, masked_end, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, acc, m_i, l_i,
                        p16, gain, l_prev, row_ok, es_tau, votes, vote_bar, qk_scale, pv_lambda, q_pos, PV_SKIP,
                        STAGES, WG, VOTE_SLOTS, row_o, p_layout, vote_layout)
                    t = gl.where(goes_on, t + 1, t)
                    pv_pending = goes_on
                    go = goes_on & (t < end)
                last = t - 1
            else:
                for t in range(t1, end):
                    acc, m_i, l_i, p16, gain, l_prev = _overlapped_step(
                        t, 0, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, acc, m_i, l_i, p16,
                        qk_scale, pv_lambda, q_pos, False, PV_SKIP, STAGES, row_o, p_layout)
            if PERSISTENT:
                # the block's last S = Q K^T has landed: the load partition may bring the next block's Q while
                # this one finishes (its O leaves from registers, not through Q's buffer)
                gl.thread_barrier()
                mbarrier.arrive(q_empty, count=1)
            if not EARLY_STOP or pv_pending:
                sl = last % STAGES
                v_last = v_bufs.index(sl)
                mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
                acc = warpgroup_mma(p16, v_last, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16, v_last))
                _stamp(tl_row, 4 + 5 * WG, n_tiles, TIMELINE)
                if not PERSISTENT:  # (persistent: after O has gone out through its K buffer)
                    _release(last, kv_empty, STAGES)
        elif PERSISTENT:
            # no tile: Q is released at once, and the stagger's barrier keeps its parity (one phase per block)
            if PINGPONG == 1:
                if WG == 0:
                    mbarrier.arrive(turn.index(1), count=1)
                else:
                    mbarrier.wait(turn.index(1), item_i & 1)
            gl.thread_barrier()
            mbarrier.arrive(q_empty, count=1)
        if EARLY_STOP:
            if ROW0 == 0:
                gl.store(visited_ptr, last + 1 - g)

        # -- epilogue: rows that saw nothing have l == 0 and acc == 0 and write zeros
        if WRITE_LSE:
            # log2-sum-exp2 of the row's scaled scores: what a resumed pass starts from
            gl.store(lse_base + phys.to(gl.int64) * stride_ln, m_i + gl.log2(l_i), mask=row_ok)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        if PERSISTENT:
            if n_tiles > 0:
                # Q's buffer already holds the next block's rows: O goes out by TMA through the last tile's K
                # buffer, once both warpgroups' last S has read it (Q's barrier says so); the slot is released
                # after the store has read it
                mbarrier.wait(q_empty, item_i & 1)
                o_smem = k_bufs.index(last % STAGES).slice(ROW0, ROWS, dim=0)
                o_smem.store(out.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(desc_o, [b, h, row0, 0], o_smem)
                tma.store_wait(pendings=0)
                _release(last, kv_empty, STAGES)
            else:
                phys_o, ok_o = _row_index(qidx_base, stride_qip, row0, N_Q, ROWS, HAS_QIDX, row_o)
                o_ptrs, o_mask = _output_rows(o_base, stride_on, phys_o, ok_o, HEAD_DIM, o_layout)
                gl.store(o_ptrs, out.to(dtype), mask=o_mask)
        elif HAS_QIDX:
            # back to the physical rows, straight from registers (no TMA scatter on Hopper)
            phys_o, ok_o = _row_index(qidx_base, stride_qip, row0, N_Q, ROWS, HAS_QIDX, row_o)
            o_ptrs, o_mask = _output_rows(o_base, stride_on, phys_o, ok_o, HEAD_DIM, o_layout)
            gl.store(o_ptrs, out.to(dtype), mask=o_mask)
        else:
            # Q's buffer holds O for the TMA store (rows past Nq are clipped by the descriptor)
            gl.thread_barrier()  # every warpgroup is done reading Q before it is overwritten
            q_smem.store(out.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(desc_o, [b, h, row0, 0], q_smem)
            tma.store_wait(pendings=0)
        if EARLY_STOP:
            # tiles loaded past the stop land in the ring while the epilogue above runs; none may land after the
            # CTA has exited
            _drain(last, end, k_ready, v_ready, STAGES)
        _stamp(tl_row, 5 + 5 * WG, n_tiles, TIMELINE)

    @gluon.jit
    def _issue_step(t, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, p16, STAGES: gl.constexpr):
        """FA3's intra-warpgroup overlap, first half: issue S(t) = Q K(t)^T, then O += P(t-1) V(t-1).
        Returns (S(t) in flight, O in flight, K(t)'s slot, V(t-1)'s slot)."""
        k_buf = k_bufs.index(t % STAGES)
        v_prev = v_bufs.index((t - 1) % STAGES)
        mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index((t - 1) % STAGES), ((t - 1) // STAGES) & 1)
        pv = warpgroup_mma(p16, v_prev, acc, is_async=True)
        return s_next, pv, k_buf, v_prev

    @gluon.jit
    def _stamp(ptr, slot, x, TIMELINE: gl.constexpr):
        """Debug timeline: this SM's clock64 into ``ptr[slot]``."""
        if TIMELINE:
            now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64, is_pure=False,
                                            pack=1)
            gl.store(ptr + slot, now)

    @gluon.jit
    def _finish_step(t, key_pos, s_next, pv, k_buf, v_prev, q_smem, kv_empty, m_i, l_i, p16, qk_scale, pv_lambda,
                     q_pos, MASKED: gl.constexpr, PV_SKIP: gl.constexpr, STAGES: gl.constexpr,
                     row_o: gl.constexpr, p_layout: gl.constexpr):
        """Second half (tile ``t``, masked: its keys at ``key_pos``): softmax(t) while
        P(t-1) V(t-1) is in flight, then release tile t-1's slot and rescale O.
        Returns (acc, m_i, l_i, p16 of tile t, gain, l_prev)."""
        s_acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, q_smem, k_buf))
        p, alpha, m_i, l_i, gain, l_prev = _scores_to_p(s_acc, m_i, l_i, qk_scale, pv_lambda, q_pos, key_pos, MASKED,
                                                         PV_SKIP)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, p16, v_prev))
        _release(t - 1, kv_empty, STAGES)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        return acc, m_i, l_i, p16, gain, l_prev

    @gluon.jit
    def _overlapped_step(t, key_pos, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, acc, m_i, l_i,
                         p16, qk_scale, pv_lambda, q_pos, MASKED: gl.constexpr, PV_SKIP: gl.constexpr,
                         STAGES: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr):
        """FA3's intra-warpgroup overlap, tile ``t`` (masked: keys at ``key_pos``): ``_issue_step`` then
        ``_finish_step``. Returns (acc, m_i, l_i, p16 of tile t, gain, l_prev)."""
        s_next, pv, k_buf, v_prev = _issue_step(t, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, p16,
                                                STAGES)
        return _finish_step(t, key_pos, s_next, pv, k_buf, v_prev, q_smem, kv_empty, m_i, l_i, p16, qk_scale,
                            pv_lambda, q_pos, MASKED, PV_SKIP, STAGES, row_o, p_layout)

    @gluon.jit
    def _voting_step(t, n_masked, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, s_zero, acc, m_i, l_i, p16,
                     gain, l_prev, row_ok, es_tau, votes, vote_bar, qk_scale, pv_lambda, q_pos, PV_SKIP: gl.constexpr,
                     STAGES: gl.constexpr, WG: gl.constexpr, VOTE_SLOTS: gl.constexpr, row_o: gl.constexpr,
                     p_layout: gl.constexpr, vote_layout: gl.constexpr):
        """``_overlapped_step`` for the early-stop walk over unmasked tile ``t``: issue S(t) and O += P(t-1) V(t-1),
        then vote on tile t-1 (if unmasked; ``gain`` / ``l_prev`` are its) while both run. The walk goes on: the
        softmax of t as in ``_overlapped_step``. It stops (tile t-1 was the last): O is complete once P(t-1) V(t-1)
        lands, and S(t) is dropped. Returns (acc, m_i, l_i, p16, gain, l_prev, goes_on)."""
        s_next, pv, k_buf, v_prev = _issue_step(t, q_smem, k_bufs, v_bufs, k_ready, v_ready, s_zero, acc, p16,
                                                STAGES)
        j = t - 1 - n_masked  # tile t-1's rank among the unmasked tiles (< 0: it was masked and does not vote)
        goes_on = True
        if j >= 0:
            mine = _publish_vote(gain, l_prev, row_ok, es_tau, j, votes, vote_bar, WG, VOTE_SLOTS, vote_layout)
            goes_on = _goes_on(mine, j, votes, vote_bar, WG, VOTE_SLOTS, vote_layout)
        if goes_on:
            acc, m_i, l_i, p16, gain, l_prev = _finish_step(
                t, 0, s_next, pv, k_buf, v_prev, q_smem, kv_empty, m_i, l_i, p16, qk_scale, pv_lambda, q_pos, False,
                PV_SKIP, STAGES, row_o, p_layout)
        else:
            acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, p16, v_prev))
            _release(t - 1, kv_empty, STAGES)
        return acc, m_i, l_i, p16, gain, l_prev, goes_on

    @gluon.jit
    def _producer(desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, votes,
                  tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, k_base, v_base, stride_kn, stride_vn,
                  kidx_base, stride_kip, KEY_LEN, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_QIDX: gl.constexpr, EARLY_STOP: gl.constexpr,
                  VOTE_SLOTS: gl.constexpr, GATHER: gl.constexpr, LOAD_WARPS: gl.constexpr,
                  GATHER_ROWS: gl.constexpr, INT32_OFFSETS: gl.constexpr, tl_row, TIMELINE: gl.constexpr,
                  g, item_i, q_empty, PERSISTENT: gl.constexpr):
        """The load partition (``g``, ``item_i``: as ``_consumer``'s; a persistent CTA's next Q waits until both
        compute warpgroups computed their last S of the block before): Q once (unless the consumers gather permuted
        rows), then every K/V tile of the list
        through the ring, by TMA (1 warp) or gathered through the key index (``_gather_kv``, ``LOAD_WARPS``
        warps: one warp cannot issue a tile's 2 x 128 row copies fast enough); with early stop, until the tile
        whose slot it would refill ended the walk."""
        _stamp(tl_row, 11, n_tiles, TIMELINE)
        if not HAS_QIDX and not PERSISTENT:
            mbarrier.expect(q_bar, desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [b, h, qblk * BLOCK_M, 0], q_bar, q_smem)
        if EARLY_STOP:
            vote_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                         warps_per_cta=[LOAD_WARPS if GATHER else 1], order=[0])
            t = 0
            go = t < n_tiles
            while go:
                s = t % STAGES
                if GATHER:
                    phys = _gather_rows(kidx_base, stride_kip, KEY_LEN, tile_ptr, stride_tt, t, BLOCK_N, HEAD_DIM,
                                        LOAD_WARPS, GATHER_ROWS)
                mbarrier.wait(kv_empty.index(s), ((t // STAGES) & 1) ^ 1)
                # the slot's previous tile (t - STAGES) was released by both warpgroups after they voted on it:
                # both voted stop -> the walk ended there, and nothing more is loaded
                j = gl.maximum(t - STAGES - n_masked, 0)
                slot = j % VOTE_SLOTS
                v0 = gl.max(votes.index(2 * slot).load(vote_layout), axis=0)
                v1 = gl.max(votes.index(2 * slot + 1).load(vote_layout), axis=0)
                load = (t - STAGES < n_masked) | (v0 != 0) | (v1 != 0)
                if GATHER:
                    if load:
                        _gather_kv(phys, k_base, v_base, stride_kn, stride_vn, k_bufs, v_bufs, k_ready, v_ready, t,
                                   HEAD_DIM, STAGES, LOAD_WARPS, GATHER_ROWS, INT32_OFFSETS)
                else:
                    _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tile_ptr, stride_tt, t, load, b, hkv,
                              STAGES)
                t += 1
                go = (t < n_tiles) & load
        else:
            tp = tile_ptr + (0 - g) * stride_tt  # absolute ring positions, as in _consumer
            for t in range(g, g + n_tiles):
                if GATHER:
                    phys = _gather_rows(kidx_base, stride_kip, KEY_LEN, tp, stride_tt, t, BLOCK_N, HEAD_DIM,
                                        LOAD_WARPS, GATHER_ROWS)
                # a fresh barrier counts as phase 1 completed
                mbarrier.wait(kv_empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                if GATHER:
                    _gather_kv(phys, k_base, v_base, stride_kn, stride_vn, k_bufs, v_bufs, k_ready, v_ready, t,
                               HEAD_DIM, STAGES, LOAD_WARPS, GATHER_ROWS, INT32_OFFSETS)
                else:
                    _issue_kv(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, tp, stride_tt, t, True, b, hkv,
                              STAGES)
                if PERSISTENT:
                    if t == g:
                        # the block's first K/V tile went out as soon as the previous block freed its slot; Q waits
                        # until both compute warpgroups have computed their last S of that block
                        _issue_q(desc_q, q_smem, q_bar, q_empty, b, h, qblk, item_i, BLOCK_M)
            if PERSISTENT:
                if n_tiles == 0:
                    _issue_q(desc_q, q_smem, q_bar, q_empty, b, h, qblk, item_i, BLOCK_M)
        _stamp(tl_row, 13, n_tiles, TIMELINE)
        if GATHER:  # no copy outlives the partition (the compute partitions also wait for every tile issued)
            async_copy.commit_group()
            async_copy.wait_group(0)

    @gluon.jit
    def _issue_q(desc_q, q_smem, q_bar, q_empty, b, h, qblk, item_i, BLOCK_M: gl.constexpr):
        """A persistent CTA's Q for its ``item_i``-th block, once the previous block's last S has read Q."""
        mbarrier.wait(q_empty, (item_i & 1) ^ 1)
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, h, qblk * BLOCK_M, 0], q_bar, q_smem)

    @gluon.constexpr_function
    def _gather_layout(HEAD_DIM, LOAD_WARPS, GATHER_ROWS):
        """The gathers' register layout: each warp instruction copies 16 bytes per thread from ``GATHER_ROWS`` rows
        (``GATHER_ROWS_PER_COPY``; at least the 256 // HEAD_DIM that 512 bytes fill), each thread its pieces of a
        few rows (a row's address computed once)."""
        rows = max(GATHER_ROWS, 256 // HEAD_DIM)
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[rows, 32 // rows],
                                warps_per_cta=[LOAD_WARPS, 1], order=[1, 0])

    @gluon.jit
    def _gather_rows(kidx_base, stride_kip, KEY_LEN, tile_ptr, stride_tt, t, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, LOAD_WARPS: gl.constexpr, GATHER_ROWS: gl.constexpr):
        """The key positions of plan tile ``t`` (padding: -1), in ``_gather_kv``'s row layout. Loaded before the
        load partition waits for the tile's ring slot, so the index's latency hides behind that wait."""
        ld: gl.constexpr = _gather_layout(HEAD_DIM, LOAD_WARPS, GATHER_ROWS)
        start = gl.load(tile_ptr + t * stride_tt)
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        return gl.load(kidx_base + pos * stride_kip, mask=pos < KEY_LEN, other=-1)

    @gluon.jit
    def _gather_kv(phys, k_base, v_base, stride_kn, stride_vn, k_bufs, v_bufs, k_ready, v_ready, t,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr, GATHER_ROWS: gl.constexpr,
                   INT32_OFFSETS: gl.constexpr):
        """Plan tile ``t``'s keys read in place (rows ``phys``, from ``_gather_rows``; no permuted copy): cp.async
        of 16 bytes per thread into ring slot ``t % STAGES``; each load thread's ready arrivals land when its
        copies have (the barriers count one per load thread). Padding rows read zeros, as TMA past a tensor's
        end does."""
        ld: gl.constexpr = _gather_layout(HEAD_DIM, LOAD_WARPS, GATHER_ROWS)
        s = t % STAGES
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        ok = (phys >= 0)[:, None] & (d[None, :] < HEAD_DIM)
        row = gl.maximum(phys, 0)[:, None]
        if not INT32_OFFSETS:
            row = row.to(gl.int64)
        # int32 offsets (when the host found they fit): one IMAD per address instead of a 64-bit product and add
        async_copy.async_copy_global_to_shared(k_bufs.index(s), (k_base + d[None, :]) + row * stride_kn, mask=ok)
        async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
        async_copy.async_copy_global_to_shared(v_bufs.index(s), (v_base + d[None, :]) + row * stride_vn, mask=ok)
        async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)

    @gluon.jit
    def _plan_row(item, H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts, MaskedCounts,
                  stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                  stride_mb, stride_mh, stride_mq, SKIP_MASKED: gl.constexpr):
        """Work item ``item`` (batch, query head, query block; the query heads of one KV head fastest, query
        blocks last-first) and its plan row: (b, h, hkv, qblk, tile_ptr, n_tiles, n_masked)."""
        n_kv = H_Q // GQA
        h_in = item % GQA
        rest = item // GQA
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
        if SKIP_MASKED:
            # a first pass computed the masked tiles: this one walks the rest of the list, from its start
            tile_ptr = tile_ptr + n_masked * stride_tt
            n_tiles = n_tiles - n_masked
            n_masked = gl.minimum(n_masked, 0)
        return b, h, hkv, qblk, tile_ptr, n_tiles, n_masked

    @gluon.jit
    def _persistent_consumer(desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready,
                             kv_empty, votes, vote_bar, turn, TileOffsets, TileCounts, MaskedCounts,
                             stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                             stride_mb, stride_mh, stride_mq, KeyIndex, stride_kib, stride_kih, stride_kip,
                             Out, stride_ob, stride_oh, stride_on, Lse, stride_lb, stride_lh, stride_ln, Timeline,
                             qk_scale, pv_lambda, es_tau, H_Q, N_Q, N_K, KEY_LEN, N_QBLK, GQA, PLAN_DIV, N_ITEMS,
                             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, ROWS: gl.constexpr, ROW0: gl.constexpr,
                             HAS_KIDX: gl.constexpr, PV_SKIP: gl.constexpr, VOTE_SLOTS: gl.constexpr,
                             WRITE_LSE: gl.constexpr, PINGPONG: gl.constexpr, SKIP_MASKED: gl.constexpr,
                             TIMELINE: gl.constexpr):
        """A compute warpgroup of a persistent CTA: ``_consumer`` for work items pid, pid + grid, ... in turn (each
        next item's plan row read while the current one runs)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        b, h, hkv, qblk, tile_ptr, n_tiles, n_masked = _plan_row(
            pid, H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts, MaskedCounts, stride_tb, stride_th, stride_tq,
            stride_tt, stride_cb, stride_ch, stride_cq, stride_mb, stride_mh, stride_mq, SKIP_MASKED)
        g = pid * 0  # ring position and blocks done: loop-carried int32 tensors, not Python ints
        item_i = pid * 0
        for item in range(pid, N_ITEMS, nprog):
            tl_row = Timeline + item.to(gl.int64) * 16  # TIMELINE: one row per block, as without persistence
            nb, nh, nhkv, nqblk, ntile_ptr, nn_tiles, nn_masked = _plan_row(
                gl.minimum(item + nprog, N_ITEMS - 1), H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts,
                MaskedCounts, stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                stride_mb, stride_mh, stride_mq, SKIP_MASKED)
            b64 = b.to(gl.int64)
            kidx_base = KeyIndex + b64 * stride_kib + hkv.to(gl.int64) * stride_kih
            o_base = Out + b64 * stride_ob + h.to(gl.int64) * stride_oh
            lse_base = Lse + b64 * stride_lb + h.to(gl.int64) * stride_lh
            # Q by TMA, no query index, no early stop, no resume: their pointers are never read (any will do)
            _consumer(desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, votes,
                      vote_bar, turn, tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale, N_Q, N_K,
                      pv_lambda, es_tau, KEY_LEN, kidx_base, stride_kip, o_base, stride_on, o_base, stride_on,
                      TileCounts, 0, TileCounts, lse_base, stride_ln,
                      HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, ROWS, ROW0,
                      HAS_KIDX, PV_SKIP, False, False, VOTE_SLOTS, False, WRITE_LSE, PINGPONG,
                      tl_row, TIMELINE, g, item_i, q_empty, True)
            g += n_tiles
            item_i += 1
            b, h, hkv, qblk, tile_ptr, n_tiles, n_masked = nb, nh, nhkv, nqblk, ntile_ptr, nn_tiles, nn_masked

    @gluon.jit
    def _persistent_producer(desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready,
                             kv_empty, votes, TileOffsets, TileCounts, MaskedCounts,
                             stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                             stride_mb, stride_mh, stride_mq, KeyIndex, stride_kib, stride_kih, stride_kip,
                             K, V, Timeline, H_Q, KEY_LEN, N_QBLK, GQA, PLAN_DIV, N_ITEMS,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, VOTE_SLOTS: gl.constexpr, GATHER_ROWS: gl.constexpr,
                             SKIP_MASKED: gl.constexpr, TIMELINE: gl.constexpr):
        """The load partition of a persistent CTA: ``_producer`` for its work items in turn (the ring and Q's
        barriers run on across them)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        b, h, hkv, qblk, tile_ptr, n_tiles, n_masked = _plan_row(
            pid, H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts, MaskedCounts, stride_tb, stride_th, stride_tq,
            stride_tt, stride_cb, stride_ch, stride_cq, stride_mb, stride_mh, stride_mq, SKIP_MASKED)
        g = pid * 0  # ring position and blocks done: loop-carried int32 tensors, not Python ints
        item_i = pid * 0
        for item in range(pid, N_ITEMS, nprog):
            tl_row = Timeline + item.to(gl.int64) * 16  # TIMELINE: one row per block, as without persistence
            nb, nh, nhkv, nqblk, ntile_ptr, nn_tiles, nn_masked = _plan_row(
                gl.minimum(item + nprog, N_ITEMS - 1), H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts,
                MaskedCounts, stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                stride_mb, stride_mh, stride_mq, SKIP_MASKED)
            kidx_base = KeyIndex + b.to(gl.int64) * stride_kib + hkv.to(gl.int64) * stride_kih
            _producer(desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, votes,
                      tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, K, V, 0, 0, kidx_base, stride_kip,
                      KEY_LEN, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, False, False, VOTE_SLOTS, False, 1, GATHER_ROWS,
                      True, tl_row, TIMELINE, g, item_i, q_empty, True)
            g += n_tiles
            item_i += 1
            b, h, hkv, qblk, tile_ptr, n_tiles, n_masked = nb, nh, nhkv, nqblk, ntile_ptr, nn_tiles, nn_masked

    @jit_any_length(jit=gluon.jit)
    def _hopper_fwd_kernel(
        desc_q, desc_k, desc_v, desc_o, Q, Out,
        TileOffsets, TileCounts, MaskedCounts, KeyIndex, QueryIndex, Visited, Lse, Timeline,
        qk_scale, pv_lambda, es_tau,
        stride_qb, stride_qh, stride_qn,
        stride_ob, stride_oh, stride_on,
        stride_tb, stride_th, stride_tq, stride_tt,
        stride_cb, stride_ch, stride_cq,
        stride_mb, stride_mh, stride_mq,
        stride_kib, stride_kih, stride_kip,
        stride_qib, stride_qih, stride_qip,
        stride_lb, stride_lh, stride_ln,
        K, V, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        H_Q, N_Q, N_K, KEY_LEN, N_QBLK, GQA, PLAN_DIV, QIDX_DIV, N_ITEMS,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, HAS_KIDX: gl.constexpr, PV_SKIP: gl.constexpr,
        HAS_QIDX: gl.constexpr,
        EARLY_STOP: gl.constexpr, GATHER: gl.constexpr, LOAD_WARPS: gl.constexpr, GATHER_ROWS: gl.constexpr,
        INT32_OFFSETS: gl.constexpr, LOAD_REGS: gl.constexpr, SKIP_MASKED: gl.constexpr, RESUME: gl.constexpr,
        WRITE_LSE: gl.constexpr, PINGPONG: gl.constexpr, TIMELINE: gl.constexpr, PERSISTENT: gl.constexpr,
    ):
        gl.static_assert(not GATHER or HAS_KIDX, "gathered keys need a key index")
        gl.static_assert(PINGPONG == 0 or PINGPONG == 1, "issue order: free (0) or staggered start (1)")
        gl.static_assert(not PERSISTENT or (not HAS_QIDX and not EARLY_STOP and not GATHER and not RESUME
                                            and BLOCK_N == BLOCK_M),
                         "persistent CTAs: Q by TMA, no early stop, gather or resume, square tiles (O leaves "
                         "through a K buffer)")
        # -- (batch, query head, query block); a persistent CTA (PERSISTENT) decodes its items in its partitions
        pid = gl.program_id(0)
        b, h, hkv, qblk, tile_ptr, n_tiles, n_masked = _plan_row(
            pid, H_Q, GQA, N_QBLK, PLAN_DIV, TileOffsets, TileCounts, MaskedCounts, stride_tb, stride_th, stride_tq,
            stride_tt, stride_cb, stride_ch, stride_cq, stride_mb, stride_mh, stride_mq, SKIP_MASKED)
        b64 = b.to(gl.int64)
        # key positions of the permuted copy (an index with Hkv heads: one per KV head); read in masked tiles only
        kidx_base = KeyIndex + b64 * stride_kib + hkv.to(gl.int64) * stride_kih
        # permuted queries: rows gathered and scattered by pointer (read only with HAS_QIDX)
        qidx_base = QueryIndex + b64 * stride_qib + (h // QIDX_DIV).to(gl.int64) * stride_qih
        q_base = Q + b64 * stride_qb + h.to(gl.int64) * stride_qh
        o_base = Out + b64 * stride_ob + h.to(gl.int64) * stride_oh
        visited_ptr = Visited + (b64 * H_Q + h) * N_QBLK + qblk  # written only with EARLY_STOP
        tl_row = Timeline + pid.to(gl.int64) * 16  # debug timeline (TIMELINE): 16 int64 per CTA
        lse_base = Lse + b64 * stride_lb + h.to(gl.int64) * stride_lh  # read with RESUME, written with WRITE_LSE

        # -- shared memory: Q (reused for O), the K/V ring, barriers; early stop's votes (module docstring)
        dtype: gl.constexpr = desc_q.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # PERSISTENT: Q read
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # a warpgroup runs at most STAGES tiles ahead of the other, so 2 * STAGES vote slots are never overwritten
        # before both have read them
        VOTE_SLOTS: gl.constexpr = 2 * STAGES if EARLY_STOP else 1
        votes = gl.allocate_shared_memory(gl.int32, [2 * VOTE_SLOTS, 1],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        vote_bar = gl.allocate_shared_memory(gl.int64, [VOTE_SLOTS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG's issue order
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # one arrival per compute warpgroup
        # ready: one TMA arrival with its byte count, or one (copies-landed) arrival per thread that gathers
        READY_ARRIVALS: gl.constexpr = 32 * LOAD_WARPS if GATHER else 1
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=READY_ARRIVALS)
            mbarrier.init(v_ready.index(i), count=READY_ARRIVALS)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrival per compute partition
        for i in gl.static_range(VOTE_SLOTS):
            mbarrier.init(vote_bar.index(i), count=2)  # one vote per compute warpgroup
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)  # one arrival per step of the other warpgroup
        fence_async_shared()

        k_base = K + b64 * stride_kb + hkv.to(gl.int64) * stride_kh  # K/V read in place: only with GATHER
        v_base = V + b64 * stride_vb + hkv.to(gl.int64) * stride_vh
        if PERSISTENT:
            HALF_P: gl.constexpr = BLOCK_M // 2
            gl.warp_specialize([
                (_persistent_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready,
                                        v_ready, kv_empty, votes, vote_bar, turn, TileOffsets, TileCounts,
                                        MaskedCounts, stride_tb, stride_th, stride_tq, stride_tt, stride_cb,
                                        stride_ch, stride_cq, stride_mb, stride_mh, stride_mq, KeyIndex, stride_kib,
                                        stride_kih, stride_kip, Out, stride_ob, stride_oh, stride_on, Lse,
                                        stride_lb, stride_lh, stride_ln, Timeline, qk_scale, pv_lambda, es_tau, H_Q,
                                        N_Q, N_K, KEY_LEN, N_QBLK, GQA, PLAN_DIV, N_ITEMS,
                                        HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, HALF_P, 0, HAS_KIDX, PV_SKIP,
                                        VOTE_SLOTS, WRITE_LSE, PINGPONG, SKIP_MASKED, TIMELINE)),
                (_persistent_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready,
                                        v_ready, kv_empty, votes, vote_bar, turn, TileOffsets, TileCounts,
                                        MaskedCounts, stride_tb, stride_th, stride_tq, stride_tt, stride_cb,
                                        stride_ch, stride_cq, stride_mb, stride_mh, stride_mq, KeyIndex, stride_kib,
                                        stride_kih, stride_kip, Out, stride_ob, stride_oh, stride_on, Lse,
                                        stride_lb, stride_lh, stride_ln, Timeline, qk_scale, pv_lambda, es_tau, H_Q,
                                        N_Q, N_K, KEY_LEN, N_QBLK, GQA, PLAN_DIV, N_ITEMS,
                                        HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, HALF_P, HALF_P, HAS_KIDX,
                                        PV_SKIP, VOTE_SLOTS, WRITE_LSE, PINGPONG, SKIP_MASKED, TIMELINE)),
                (_persistent_producer, (desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready,
                                        v_ready, kv_empty, votes, TileOffsets, TileCounts, MaskedCounts,
                                        stride_tb, stride_th, stride_tq, stride_tt, stride_cb, stride_ch, stride_cq,
                                        stride_mb, stride_mh, stride_mq, KeyIndex, stride_kib, stride_kih,
                                        stride_kip, K, V, Timeline, H_Q, KEY_LEN, N_QBLK, GQA, PLAN_DIV, N_ITEMS,
                                        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, VOTE_SLOTS, GATHER_ROWS, SKIP_MASKED,
                                        TIMELINE)),
            ], [NUM_WARPS, 1], [CONSUMER_REGS, 24])
        else:
            # FA3's layout: two compute warpgroups, each its own partition with 64 query rows, scheduled
            # independently by the hardware (one's softmax overlaps the other's MMAs), plus the load warp
            HALF: gl.constexpr = BLOCK_M // 2
            gl.warp_specialize([
                (_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             votes, vote_bar, turn, tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale,
                             N_Q, N_K, pv_lambda, es_tau, KEY_LEN, kidx_base, stride_kip,
                             q_base, stride_qn, o_base, stride_on, qidx_base, stride_qip, visited_ptr,
                             lse_base, stride_ln,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, HALF, 0,
                             HAS_KIDX, PV_SKIP, HAS_QIDX, EARLY_STOP, VOTE_SLOTS, RESUME, WRITE_LSE, PINGPONG,
                             tl_row, TIMELINE, 0, 0, q_empty, False)),
                (_consumer, (desc_k, desc_v, desc_o, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             votes, vote_bar, turn, tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, qk_scale,
                             N_Q, N_K, pv_lambda, es_tau, KEY_LEN, kidx_base, stride_kip,
                             q_base, stride_qn, o_base, stride_on, qidx_base, stride_qip, visited_ptr,
                             lse_base, stride_ln,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS, HALF, HALF,
                             HAS_KIDX, PV_SKIP, HAS_QIDX, EARLY_STOP, VOTE_SLOTS, RESUME, WRITE_LSE, PINGPONG,
                             tl_row, TIMELINE, 0, 0, q_empty, False)),
                (_producer, (desc_q, desc_k, desc_v, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             votes, tile_ptr, stride_tt, n_tiles, n_masked, b, h, hkv, qblk, k_base, v_base,
                             stride_kn, stride_vn, kidx_base, stride_kip, KEY_LEN, BLOCK_M, BLOCK_N, HEAD_DIM,
                             STAGES, HAS_QIDX, EARLY_STOP, VOTE_SLOTS, GATHER, LOAD_WARPS, GATHER_ROWS,
                             INT32_OFFSETS, tl_row, TIMELINE, 0, 0, q_empty, False)),
            ], [NUM_WARPS, LOAD_WARPS if GATHER else 1], [CONSUMER_REGS, LOAD_REGS if GATHER else 24])

        mbarrier.invalidate(q_bar)
        mbarrier.invalidate(q_empty)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(kv_empty.index(i))
        for i in gl.static_range(VOTE_SLOTS):
            mbarrier.invalidate(vote_bar.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
BLOCK_M = 128
#: warps of each of the two compute partitions (a warpgroup of 64 query rows each); the kernel's ``NUM_WARPS``
PARTITION_WARPS = 4
CONSUMER_REGS = 240  # registers per thread of the compute partitions
# gathered keys (``key_gather``): the load partition's warps and registers, and the list length (x Nk) above
# which "auto" gathers rather than copying (a gathered tile costs about 9% more than one TMA reads from the copy,
# docs/kernels.md; the copy costs a pass over the whole list)
GATHER_LOAD_WARPS = 4
GATHER_LOAD_REGS = 56  # the compute partitions keep 208 (default) and 240: 504 of 512 per lane
#: rows per warp instruction of the gathers' cp.async (32 threads x 16 bytes). 4 at D=128: each row half is one
#: 128-byte line (four lines per instruction) and each thread copies two pieces of each of 8 rows (one address per
#: row). H100, S2O's walk at 64K / 128K: 0.87 / 0.89 of the dense kernel per tile against 0.79 / 0.86 with 2
#: (whole rows, an address per piece) and 0.79 / 0.77 with 8; 16 (32-byte requests) ran 25% slower
#: (docs/kernels.md)
GATHER_ROWS_PER_COPY = 4
#: H100 (4-row gathers): S2O's walk gathered beats copy + TMA by 3% at 16K (list 5 x Nk) and 4.5% at 32K (9 x Nk)
GATHER_LIST_RATIO = 4
def issue_order(early_stop: float) -> int:
    """The two compute warpgroups' issue order, the kernel's ``PINGPONG``: without early stop warpgroup 1 issues
    its first MMAs after warpgroup 0's (1: its S = Q K^T runs during warpgroup 0's first softmax instead of beside
    it), with early stop they run free (0). H100, one loop: 1 runs S2O's window pass 3-4% faster at 16K-64K and the
    dense kernel within 1%; the early-stop walk was not faster with it. (FA3's ping-pong on every step, the
    kernel's 2, slowed the dense kernel by 1-4% and the walk by 1-8%.)"""
    return int(early_stop == 0)


#: persistent CTAs (module docstring) where the call allows them (square tiles, Q by TMA, no early stop, gather or
#: resume), chosen by ``persistent_by_default``. H100, one loop: S2O's window pass (at most 16 tiles per block)
#: 0.78 / 0.78 / 0.75 of the dense kernel per tile at 16K / 32K / 64K, against 0.73 / 0.73 / 0.65 with a CTA per
#: block; the dense kernel 0.97-0.98 (a fixed order over blocks of 1 to N/128 tiles leaves SMs 2.5-3% unbalanced;
#: drawing items from an atomic counter balanced them but cost the window pass 3%)
PERSISTENT_MAX_TILES = 16
#: enough blocks per CTA that the fixed order balances (blocks of 1-16 tiles: 1.5-3% at 16K-64K)
PERSISTENT_MIN_BLOCKS_PER_SM = 8


def _is_16b_aligned(x: torch.Tensor) -> bool:
    es = x.element_size()
    return x.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in x.stride()[:-1])


#: an H100's shared memory per block (227 KiB)
SHARED_MEMORY_LIMIT = 227 * 1024


def shared_memory_bytes(head_dim: int, block_n: int, num_stages: int, element_size: int = 2) -> int:
    """Q (and the output staging in its buffer) plus ``num_stages`` K and V tiles, plus the ring's and the turn
    barriers and 1 KiB for the compiler's scratch (votes, layout conversions: 16-300 B in every compiled variant)."""
    return element_size * head_dim * (BLOCK_M + 2 * num_stages * block_n) + 8 * (3 * num_stages + 4) + 1024


#: the K/V ring depth when the caller names none: 3 is the most that fits at D=128 / block_n=128, and 4-6 stages
#: did not help elsewhere (H100)
DEFAULT_NUM_STAGES = 3
MAX_STAGES = 6


def persistent_by_default(tile_offsets, n_items: int) -> bool:
    """Whether a call that allows persistent CTAs gets them when ``persistent`` is None: short lists (at most
    ``PERSISTENT_MAX_TILES`` tiles per block, e.g. S2O's window pass), where a block's fixed costs weigh, and enough
    blocks per SM (``PERSISTENT_MIN_BLOCKS_PER_SM``) that the fixed order pid, pid + grid, ... balances."""
    return (tile_offsets.shape[-1] <= PERSISTENT_MAX_TILES
            and n_items >= PERSISTENT_MIN_BLOCKS_PER_SM * _sm_count(tile_offsets.device))


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def gathers_by_default(key_index, num_keys: int) -> bool:
    """Whether ``key_gather=None`` reads the keys through ``key_index`` in place: lists longer than
    ``GATHER_LIST_RATIO`` x Nk, where copying the whole list costs more than gathering the visited tiles."""
    return key_index is not None and key_index.shape[-1] > GATHER_LIST_RATIO * num_keys


def hopper_unsupported(q, k, v, tile_offsets=None, *, block_m: int = 128, block_n: int = 128,
                       key_index=None, query_index=None, early_stop: float = 0.0, pv_skip=None,
                       num_stages: Optional[int] = None, key_gather: Optional[bool] = None) -> Optional[str]:
    """Why the Hopper kernel cannot run this call (a sentence), or None when it can. Checks no plan values."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon (triton.experimental.gluon, Triton 3.6 API) unavailable: {GLUON_IMPORT_ERROR}"
    if key_index is not None:
        if key_index.dim() != 3 or key_index.shape[1] != k.shape[1]:
            return (f"key_index with {key_index.shape[1] if key_index.dim() == 3 else '?'} heads: the permuted copy "
                    f"needs one per KV head ({k.shape[1]})")
        if key_index.shape[-1] == 0:
            return "an empty key_index"
    if query_index is not None and (query_index.dim() != 3 or q.shape[1] % max(query_index.shape[1], 1)):
        return f"query_index of shape {tuple(query_index.shape)}: needs (B, H, Nq) with H dividing Hq={q.shape[1]}"
    if key_gather and key_index is None:
        return "gathered keys need a key_index"
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
    if num_stages is None:
        num_stages = DEFAULT_NUM_STAGES
    if not 2 <= num_stages <= MAX_STAGES:
        return f"num_stages={num_stages} is not supported (2 to {MAX_STAGES})"
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
                                  block_m: int = 128, key_index=None, query_index=None, early_stop: float = 0.0,
                                  pv_skip=None, return_visited: bool = False, key_gather: Optional[bool] = None,
                                  out=None, lse=None, resume: bool = False, skip_masked: bool = False,
                                  persistent: Optional[bool] = None, timeline: Optional[torch.Tensor] = None):
    """Block-sparse causal attention over tile lists (the plan contract, module docstring) on an H100.

    q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q's dtype, stored as (B, Nq, Hq, D) memory.
    ``num_stages``: K/V ring depth, 2 to ``MAX_STAGES`` where shared memory allows (None: ``DEFAULT_NUM_STAGES``,
    3; at D=128, block_n=128 that is 224 KiB, the most that fits).
    ``pv_skip`` lambda < 0 (natural-log units) drops a row's P.V share of a tile as the Triton kernel does;
    ``key_index`` (Hkv heads) is served by a permuted contiguous K/V copy read by TMA, the index itself read in
    masked tiles for positions; ``key_gather=True`` reads the keys in place through the index instead (a 4-warp
    load partition gathers rows with cp.async), None picks it for lists longer than
    ``GATHER_LIST_RATIO`` x Nk (S2O's per-segment prefixes, whose copy is ~N^2/2S rows). ``return_visited``: also
    the int32 (B, Hq, n_query_blocks) tiles each block computed (without early stop, its tile count).
    ``out`` / ``lse`` / ``resume`` / ``skip_masked``: two passes over one softmax, as
    ``kernels.attention.block_sparse_attention`` documents them (``out`` needs TMA-compatible strides).
    ``persistent``: persistent CTAs where the call allows them (True / False; None: ``persistent_by_default``).
    ``timeline`` (debugging): an int64 (B * Hq * n_query_blocks, 16) tensor; each block writes its row: 0 the SM, 14
    its tile count;
    1-5 (compute warpgroup 0) and 6-10 (warpgroup 1) clock64 at its start, Q ready, first S landed, last P V
    landed, end; 11 / 13 the load partition's start / end. None: the stamps are compiled out.
    Raises NotImplementedError naming the first unsupported feature (the caller falls back to the Triton kernel)
    and ValueError for malformed inputs.
    """
    if num_stages is None:
        num_stages = DEFAULT_NUM_STAGES
    why = hopper_unsupported(q, k, v, tile_offsets, block_m=block_m, block_n=block_n, key_index=key_index,
                             query_index=query_index, early_stop=early_stop, pv_skip=pv_skip, num_stages=num_stages,
                             key_gather=key_gather)
    if why is not None:
        raise NotImplementedError(f"hopper_block_sparse_attention: {why}")
    validate_qkv(q, k, v, who="hopper_block_sparse_attention")
    validate_passes(q, out, lse, resume, who="hopper_block_sparse_attention")
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
    if query_index is not None:
        if not isinstance(query_index, torch.Tensor) or query_index.dtype != torch.int32 \
                or query_index.device != q.device or query_index.shape[0] != B or query_index.shape[2] != Nq:
            raise ValueError(f"hopper_block_sparse_attention: query_index must be an int32 (B={B}, H, Nq={Nq}) "
                             f"tensor on {q.device}")
    early_stop = float(early_stop or 0.0)
    if not (early_stop >= 0 and math.isfinite(early_stop)):
        raise ValueError(f"hopper_block_sparse_attention: early_stop must be a finite number >= 0, got {early_stop!r}")

    if out is None:
        out = torch.empty(B, Nq, Hq, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    elif out.stride(-1) != 1 or not _is_16b_aligned(out):
        raise NotImplementedError("hopper_block_sparse_attention: out's strides are not TMA-compatible")
    visited = None
    if early_stop > 0:
        # the kernel writes how far each block walked (both when asked and as its scratch otherwise)
        visited = torch.empty(B, Hq, nqb, dtype=torch.int32, device=q.device)
    elif return_visited:
        # no early stop: every block computes its whole list (a copy, one column per query head)
        g = Hq // tile_counts.shape[1]
        counts = tile_counts - torch.minimum(masked_counts, tile_counts) if skip_masked else tile_counts
        visited = counts[:, :, None, :].expand(B, tile_counts.shape[1], g, nqb).reshape(B, Hq, nqb).clone()
    if out.numel() == 0:
        return (out, visited) if return_visited else out
    if key_gather is None:
        key_gather = gathers_by_default(key_index, Nk)
    if key_gather:
        kk, vv, key_len = k, v, key_index.shape[-1]  # the descriptors below go unused: keys are gathered
        kidx, ki_strides = key_index, tuple(key_index.stride())
    elif key_index is not None:
        # the Triton kernel's "copy" key mode: K/V rows in key_index order, contiguous; TMA reads the copy like
        # ordinary keys (boxes past its end read zeros: those logical keys are padding, masked by position)
        from .permute import permute_keys

        kk, vv = permute_keys(k, v, key_index, D)
        key_len = key_index.shape[-1]
        kidx, ki_strides = key_index, tuple(key_index.stride())
    else:
        kk, vv, key_len = k, v, Nk
        kidx, ki_strides = tile_counts, (0, 0, 0)  # any int32 tensor: never read without HAS_KIDX
    desc_q = _desc(q, BLOCK_M, _LAYOUTS)
    desc_o = _desc(out, BLOCK_M // 2, _LAYOUTS)  # each compute partition stores its rows
    desc_k = _desc(kk, block_n, _LAYOUTS)
    desc_v = _desc(vv, block_n, _LAYOUTS)
    n_items = B * Hq * nqb
    allowed = query_index is None and early_stop == 0 and not key_gather and not resume and block_n == BLOCK_M
    if allowed:
        persistent = persistent_by_default(tile_offsets, n_items) if persistent is None else bool(persistent)
    else:
        persistent = False
    grid = (min(n_items, _sm_count(q.device)) if persistent else n_items,)
    if timeline is not None and not (isinstance(timeline, torch.Tensor) and timeline.dtype == torch.int64
                                     and timeline.device == q.device and timeline.is_contiguous()
                                     and timeline.numel() >= 16 * n_items):
        raise ValueError(f"hopper_block_sparse_attention: timeline must be a contiguous int64 tensor on {q.device} "
                         f"with 16 entries per block ({16 * n_items})")
    qidx = query_index if query_index is not None else tile_counts  # any int32 tensor: never read without it
    qi_strides = tuple(query_index.stride()) if query_index is not None else (0, 0, 0)
    _hopper_fwd_kernel[grid](
        desc_q, desc_k, desc_v, desc_o, q, out,
        tile_offsets, tile_counts, masked_counts, kidx, qidx, visited if visited is not None else tile_counts,
        lse if lse is not None else tile_counts, timeline if timeline is not None else tile_counts,
        scale * _LOG2E, float(pv_skip if pv_skip is not None else 0.0) * _LOG2E, early_stop,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *tile_offsets.stride(), *tile_counts.stride(), *masked_counts.stride(), *ki_strides, *qi_strides,
        *(lse.stride() if lse is not None else (0, 0, 0)),
        k, v, *k.stride()[:3], *v.stride()[:3],
        Hq, Nq, Nk, key_len, nqb, Hq // Hkv, Hq // tile_offsets.shape[1],
        Hq // query_index.shape[1] if query_index is not None else 1, n_items,
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=num_stages,
        NUM_WARPS=PARTITION_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, HAS_KIDX=key_index is not None, PV_SKIP=pv_skip is not None,
        HAS_QIDX=query_index is not None, EARLY_STOP=early_stop > 0, GATHER=bool(key_gather),
        LOAD_WARPS=GATHER_LOAD_WARPS, GATHER_ROWS=GATHER_ROWS_PER_COPY, LOAD_REGS=GATHER_LOAD_REGS,
        INT32_OFFSETS=(Nk - 1) * max(k.stride(2), v.stride(2)) + D < 2**31,
        SKIP_MASKED=bool(skip_masked), RESUME=bool(resume), WRITE_LSE=lse is not None and not resume,
        PINGPONG=issue_order(early_stop), TIMELINE=timeline is not None, PERSISTENT=persistent,
        # 8 compute warps + 1 load warp, allocated by warpgroup: 12 warps x 168 registers fit the 64K register
        # file; the load warp's group gives up all but 24 and the compute warps take the rest
        num_warps=PARTITION_WARPS, maxnreg=168,
    )
    return (out, visited) if return_visited else out
