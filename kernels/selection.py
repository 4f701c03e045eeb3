"""Triton kernels of the selection front half (reorder + select stages), and their launch wrappers.

The PyTorch references in ``sparse_compile.methods`` are the specification; these kernels compute the same
quantities in fewer passes over memory and without N x N tensors, host synchronisation or per-head Python loops:

* ``block_pool``: one pass over Q or K (optionally through a logical -> physical key index): per block of rows the
  mean, SpargeAttn's mean cosine self-similarity, the min/max original key position and a padding flag (the
  visibility inputs of a permuted tiling), and a per-row dot product with a per-KV-head "guide" vector (S2O).
* ``pooled_logits``: pooled-query x pooled-key scores, per GQA group without repeating keys, only in the causal
  region (tiles no query of a block can see are never computed, and never read).
* ``mass_select``: per (batch, head, query block) row: visibility from original positions, candidates and
  forced tiles of the method, masked softmax, the cumulative-mass rule (``top_mass``) and the plan row itself,
  written directly in the plan's order (partially visible tiles first, then fully visible ones, then the rest,
  each ascending): no boolean tile table, no argsort.
* ``bfla_block_scores`` / ``bfla_tiles``: BFLA's flatten-g max-over-group-pairs scores as one tensor-core matmul
  with a max epilogue; the tile stage (expansion, band, sink, hash rescues) fused with the plan row.
* ``pbs_key_permutation``: PBS's last-query-block key importance (two passes: log-sum-exp, then the mean
  probability) with the in-segment descending sort fused into the second pass.
* ``segmented_argsort_desc``: stable descending argsort inside segments, one segment per program (bitonic sort
  of packed 64-bit keys in registers).
* ``s2o_rank_keys`` / ``s2o_assemble`` / ``s2o_select``: S2O's per-segment causal-prefix ranking as one sort
  of packed (segment, score, position) keys, the logical key list, and the plan.

The cumulative-mass rule without a sort
---------------------------------------
``top_mass`` keeps candidate ``j`` (stable descending order) iff the mass before it is below ``T = tau * total``.
The mass strictly above a value ``x``, ``M(x) = sum(p_i for p_i > x)``, is non-increasing in ``x``, so the kept set
is ``{p_j > v*}`` plus the first members (in index order) of the tie group ``p_j == v*``, where ``v*`` is the
smallest value with ``head + M(v*) < T``. Non-negative float32 values are ordered like their bit patterns, so
``v*`` is found by a 31-step bisection on the bit pattern (31 row reductions instead of a bitonic sort of
packed 64-bit keys: about 4x fewer instructions). Equal to the sorted rule in exact arithmetic; in floating
point only the summation order of the prefix masses differs (tests compare with a tolerance-aware rule).

Numerics: selection math is float32; block means and sums are accumulated in float32 from the input dtype;
bf16/fp16 matmuls use tensor cores with float32 accumulation (the products are exact), float32 inputs use
``tf32x3`` on the GPU (float32-level accuracy) and IEEE float32 under the interpreter.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = [
    "interpreting",
    "block_pool",
    "pooled_logits",
    "mass_select",
    "bfla_block_scores",
    "bfla_tiles",
    "pbs_key_importance",
    "pbs_key_permutation",
    "segmented_argsort_desc",
    "s2o_rank_keys",
    "s2o_assemble",
    "s2o_select",
    "row_buckets",
    "plan_buckets",
]

_INT32_MAX = 2147483647
_NEG = -3.4028234663852886e38  # float32 min: the references' masked_softmax fill value
_LOG2E = 1.4426950408889634
_TINY = 1.1754943508222875e-38  # float32 tiny: the references' clamp of a row norm
#: XOR-ed into BFLA's random-rescue seed (sparse_compile.methods.bfla.RANDOM_SALT)
_RANDOM_SALT = 0x5851F42D


# read once, like @triton.jit itself reads it when the kernels are defined (and it is on the host hot path)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    return _INTERPRETING


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _f32_prec(dtype: torch.dtype) -> str:
    # float32 operands: tf32x3 keeps float32 accuracy on tensor cores; the interpreter is IEEE anyway
    if dtype != torch.float32:
        return "none"
    return "ieee" if interpreting() else "tf32x3"


def _launchable(x: torch.Tensor) -> torch.Tensor:
    # bf16 tl.dot is wrong under the interpreter (DESIGN.md): run those small CPU cases in float32
    if interpreting() and x.dtype == torch.bfloat16:
        return x.float()
    return x


# ---------------------------------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    if PREC == "none":
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _tile_limit(qmax, SEGB, BN, NKT):
    """Exclusive bound of the logical key tiles that can hold a key visible to absolute position ``qmax``.

    Keys are either in order (SEGB = 1) or permuted inside segments of SEGB keys (PBS), so a logical key p holds
    an original position >= (p // SEGB) * SEGB.
    """
    lim = (qmax // SEGB + 1) * SEGB
    return tl.minimum((lim + BN - 1) // BN, NKT)


@triton.jit
def _mix32(x):
    # lowbias32 finaliser on uint32 (wrapping multiplies), = sparse_compile.methods._common._mix32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr, kbase, Nk,
                    BN: tl.constexpr, HAS_KIDX: tl.constexpr):
    """(visible, partial, kmin) of logical key tiles ``j`` (W,) for query blocks spanning [qmin, qmax] (ROWS,).

    = plan.block_visibility: NONE when the tile's earliest valid key is after qmax, FULL when its latest valid
    key is at or before qmin and it holds no padding, PARTIAL otherwise. Returns (ROWS, W) masks.
    """
    if HAS_KIDX:
        kmin = tl.load(kmin_ptr + kbase + j, mask=jin, other=2147483647)
        kmax = tl.load(kmax_ptr + kbase + j, mask=jin, other=-1)
        kpad = tl.load(kpad_ptr + kbase + j, mask=jin, other=1) != 0
    else:
        kmin = j * BN
        kmax = tl.minimum(j * BN + BN, Nk) - 1
        kpad = j * BN + BN > Nk
    vis = jin[None, :] & (kmin[None, :] <= qmax[:, None])
    full = (kmax[None, :] <= qmin[:, None]) & (kpad[None, :] == 0)
    return vis, vis & (full == 0), kmin


@triton.jit
def _top_mass(p, cand, T, head):
    """Keep mask of ``sparse_compile.methods._common.top_mass`` for each row of (ROWS, W) (module docstring)."""
    hi = tl.max(p, 1).to(tl.int32, bitcast=True)
    some = head < T  # M(max p) = 0: does even the top candidate fit?
    lo = hi * 0 - 1
    for _ in range(31):
        active = hi - lo > 1
        mid = tl.where(active, lo + (hi - lo) // 2, hi)
        x = mid.to(tl.float32, bitcast=True)
        ok = head + tl.sum(tl.where(p > x[:, None], p, 0.0), 1) < T
        hi = tl.where(active & ok, mid, hi)
        lo = tl.where(active & (ok == 0), mid, lo)
    v = hi.to(tl.float32, bitcast=True)[:, None]
    mv = head + tl.sum(tl.where(p > v, p, 0.0), 1)
    tie = cand & (p == v)
    ti = tie.to(tl.int32)
    before = tl.cumsum(ti, 1) - ti
    keep = cand & ((p > v) | (tie & (mv[:, None] + before.to(tl.float32) * v < T[:, None])))
    return keep & some[:, None]


@triton.jit
def _store_plan_rows(keep, part, j, jin, rin, obase, s_row, cnt_ptr, msk_ptr, row, NKT, BN: tl.constexpr,
                     W: tl.constexpr):
    """Write plan rows: kept partial tiles, kept full tiles, then every other tile, each ascending.

    The same complete order as ``plan.plan_from_block_mask`` (so whole tile_offsets rows are identical), built
    with three prefix sums instead of two int64 argsorts. Tiles >= W are invisible by construction of the
    launch buckets; they keep their own position. ``obase`` (ROWS,) row pointers, ``rin`` (ROWS,) live rows.
    """
    g0 = keep & part
    g1 = keep & (part == 0)
    g2 = jin[None, :] & (keep == 0)
    i0 = g0.to(tl.int32)
    i1 = g1.to(tl.int32)
    i2 = g2.to(tl.int32)
    n0 = tl.sum(i0, 1)
    n1 = tl.sum(i1, 1)
    pos = tl.where(g0, tl.cumsum(i0, 1) - 1,
                   tl.where(g1, n0[:, None] + tl.cumsum(i1, 1) - 1, (n0 + n1)[:, None] + tl.cumsum(i2, 1) - 1))
    live = rin[:, None] & jin[None, :]
    tl.store(obase[:, None] + pos, (j * BN)[None, :] + pos * 0, mask=live)
    for t0 in range(W, NKT, W):
        jj = t0 + tl.arange(0, W)
        tl.store(obase[:, None] + jj[None, :], (jj * BN)[None, :] + rin[:, None].to(tl.int32) * 0,
                 mask=rin[:, None] & (jj < NKT)[None, :])
    tl.store(cnt_ptr + row, n0 + n1, mask=rin)
    tl.store(msk_ptr + row, n0, mask=rin)


# ---------------------------------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _pool_kernel(
    x_ptr, s_xb, s_xh, s_xn, s_xd,
    idx_ptr, s_ib, s_ih, s_in,
    g_ptr, s_gb, s_gh,
    mean_ptr, sim_ptr, kmin_ptr, kmax_ptr, kpad_ptr, gdot_ptr, order_ptr,
    H, L, N, NB, G_DIV,
    BLOCK: tl.constexpr, NBP: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    HAS_IDX: tl.constexpr, WANT_MEAN: tl.constexpr, WANT_SIM: tl.constexpr, WANT_POS: tl.constexpr,
    WANT_GDOT: tl.constexpr, SORT_GDOT: tl.constexpr,
):
    # NBP blocks per program, each read CHUNK rows at a time: tiles (NBP, CHUNK, D_PAD)
    blk = tl.program_id(0) * NBP + tl.arange(0, NBP)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    d3 = offs_d[None, None, :]
    x_base = x_ptr + b.to(tl.int64) * s_xb + h.to(tl.int64) * s_xh
    i_base = idx_ptr + b.to(tl.int64) * s_ib + h.to(tl.int64) * s_ih
    if WANT_GDOT:
        gvec = tl.load(g_ptr + b.to(tl.int64) * s_gb + (h // G_DIV).to(tl.int64) * s_gh + offs_d,
                       mask=dmask, other=0.0)
    acc = tl.zeros([NBP, D_PAD], tl.float32)
    accu = tl.zeros([NBP, D_PAD], tl.float32)
    cnt = tl.zeros([NBP, CHUNK], tl.int32)
    kmin = tl.full([NBP, CHUNK], 2147483647, tl.int32)
    kmax = tl.full([NBP, CHUNK], -1, tl.int32)
    pad = tl.zeros([NBP, CHUNK], tl.int32)
    for r0 in range(0, BLOCK, CHUNK):
        loc = r0 + tl.arange(0, CHUNK)
        rows = blk[:, None] * BLOCK + loc[None, :]
        in_blk = (loc < BLOCK)[None, :] & (blk < NB)[:, None]  # a block that is not a power of two ends early
        inb = in_blk & (rows < L)
        if HAS_IDX:
            phys = tl.load(i_base + rows.to(tl.int64) * s_in, mask=inb, other=-1)
            valid = inb & (phys >= 0) & (phys < N)
        else:
            phys = rows
            valid = inb
        ptrs = x_base + phys.to(tl.int64)[:, :, None] * s_xn + d3 * s_xd
        x = tl.load(ptrs, mask=valid[:, :, None] & (d3 < D), other=0.0).to(tl.float32)
        if WANT_MEAN:
            acc += tl.sum(x, 1)
        cnt += valid.to(tl.int32)
        if WANT_SIM:
            # one reciprocal per row instead of a division per element
            inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 2)), 1.1754943508222875e-38)
            accu += tl.sum(x * inv[:, :, None], 1)
        if WANT_POS:
            kmin = tl.minimum(kmin, tl.where(valid, phys, 2147483647))
            kmax = tl.maximum(kmax, tl.where(valid, phys, -1))
            pad = pad | (in_blk & (valid == 0)).to(tl.int32)  # rows past L are padding too (block_visibility)
        if WANT_GDOT:
            tl.store(gdot_ptr + bh.to(tl.int64) * L + rows, tl.sum(x * gvec[None, None, :], 2), mask=inb)
    n = tl.sum(cnt, 1)
    live = blk < NB
    out = bh.to(tl.int64) * NB + blk
    if WANT_MEAN:
        tl.store(mean_ptr + out[:, None] * D + offs_d[None, :], acc / tl.maximum(n, 1).to(tl.float32)[:, None],
                 mask=live[:, None] & dmask[None, :])
    if WANT_SIM:
        nf = n.to(tl.float32)
        tl.store(sim_ptr + out, tl.sum(accu * accu, 1) / tl.maximum(nf * nf, 1.0), mask=live)
    if WANT_POS:
        tl.store(kmin_ptr + out, tl.min(kmin, 1), mask=live)
        tl.store(kmax_ptr + out, tl.max(kmax, 1), mask=live)
        tl.store(kpad_ptr + out, tl.max(pad, 1), mask=live)
    if SORT_GDOT:
        # S2O's query sort, fused: this program (NBP = 1, BLOCK a power of two) holds one whole segment, whose
        # row scores it has just written; read them back (the barrier orders the CTA's global stores and loads)
        # and sort them descending, ties by lower index (a stable sort), with packed 64-bit keys
        tl.debug_barrier()
        loc = tl.arange(0, BLOCK)
        rows = blk * BLOCK + loc  # NBP == 1: blk has one entry
        inb = rows < L
        x = tl.load(gdot_ptr + bh.to(tl.int64) * L + rows, mask=inb, other=0.0)
        key = (_orderable(x).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)
        key = tl.where(inb, key, -9223372036854775807)  # rows past the end sort last
        srt = tl.sort(key, descending=True)
        seg0 = tl.sum(blk, 0) * BLOCK
        idx = seg0 + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
        tl.store(order_ptr + bh.to(tl.int64) * L + rows, idx, mask=inb)


def block_pool(x: torch.Tensor, block: int, *, key_index: Optional[torch.Tensor] = None, want_mean: bool = True,
               want_sim: bool = False, want_pos: bool = False, guide: Optional[torch.Tensor] = None,
               sort_guide: bool = False) -> dict:
    """One pass over ``x`` (B, H, N, D) in blocks of ``block`` logical rows.

    ``key_index`` (B, H, L) int32 reads logical row p from physical row key_index[p] (< 0: padding).
    Returns a dict with ``mean`` (B, H, nb, D) float32 (over the block's valid rows), ``sim`` (B, H, nb)
    (``block_self_similarity``), ``kmin``/``kmax``/``kpad`` (B, H, nb) int32 (min/max valid original position,
    INT32_MAX/-1 when none; 1 when the block holds padding or rows past the end) and ``gdot`` (B, H, L) float32,
    the dot product of each row with ``guide[b, h // (H / guide.shape[1])]`` (rows past L are not written).
    ``sort_guide`` adds ``order`` (B, H, L) int32: inside each block, the rows by descending ``gdot`` (stable),
    i.e. ``segmented_argsort_desc(gdot, block, nb)``, sorted by the same program (block a power of two <= 4096).
    """
    x = _launchable(x)
    B, H, N, D = x.shape
    L = key_index.shape[-1] if key_index is not None else N
    nb = -(-L // block)
    dev = x.device
    f32 = torch.float32
    out = {}
    mean = torch.empty(B, H, nb, D, dtype=f32, device=dev) if want_mean else None
    sim = torch.empty(B, H, nb, dtype=f32, device=dev) if want_sim else None
    kmin = kmax = kpad = None
    if want_pos:
        kmin, kmax, kpad = (torch.empty(B, H, nb, dtype=torch.int32, device=dev) for _ in range(3))
    gdot = torch.empty(B, H, L, dtype=f32, device=dev) if guide is not None else None
    fuse_sort = sort_guide and guide is not None and block & (block - 1) == 0 and block <= 4096
    order = torch.empty(B, H, L, dtype=torch.int32, device=dev) if fuse_sort else None
    dummy = torch.empty(1, dtype=f32, device=dev)
    idx = key_index if key_index is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=dev)
    g = guide.float().contiguous() if guide is not None else torch.empty(1, 1, 1, dtype=f32, device=dev)
    d_pad = max(16, triton.next_power_of_2(D))
    budget = (1 << 16) if interpreting() else 8192  # elements per tile; the interpreter pays per program
    chunk = min(_pow2(block), max(16, budget // d_pad))
    nbp = 1
    if chunk >= block and not fuse_sort:  # small blocks: several per program (full, one chunk each)
        nbp = max(1, min(_pow2(nb), budget // (chunk * d_pad)))
    _pool_kernel[(triton.cdiv(nb, nbp), B * H)](
        x, *x.stride(), idx, *idx.stride(), g, g.stride(0), g.stride(1),
        mean if mean is not None else dummy, sim if sim is not None else dummy,
        kmin if kmin is not None else dummy, kmax if kmax is not None else dummy,
        kpad if kpad is not None else dummy, gdot if gdot is not None else dummy,
        order if order is not None else dummy,
        H, L, N, nb, max(1, H // g.shape[1]) if guide is not None else 1,
        BLOCK=block, NBP=nbp, CHUNK=chunk, D=D, D_PAD=d_pad, HAS_IDX=key_index is not None, WANT_MEAN=want_mean,
        WANT_SIM=want_sim, WANT_POS=want_pos, WANT_GDOT=guide is not None, SORT_GDOT=fuse_sort, num_warps=4,
    )
    if sort_guide and guide is not None and order is None:
        order = segmented_argsort_desc(gdot, block, nb)
    out.update(mean=mean, sim=sim, kmin=kmin, kmax=kmax, kpad=kpad, gdot=gdot, order=order)
    return out


# ---------------------------------------------------------------------------------------------------------------
# pooled scores
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _pooled_logits_kernel(
    qm_ptr, km_ptr, out_ptr,
    HQ, GROUP, NQB, NKT, Nq, Nk, SEGB,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
):
    jt = tl.program_id(0)
    it = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    off = Nk - Nq
    last = tl.minimum(it * R + R, NQB) - 1
    qmax = off + tl.minimum(last * BM + BM, Nq) - 1
    # causal skip: nothing in this column block is visible to the row block's last (latest) query block
    if jt * C < _tile_limit(qmax, SEGB, BN, NKT):
        i = it * R + tl.arange(0, R)
        j = jt * C + tl.arange(0, C)
        d = tl.arange(0, D_PAD)
        a = tl.load(qm_ptr + (bh.to(tl.int64) * NQB + i[:, None]) * D + d[None, :],
                    mask=(i[:, None] < NQB) & (d[None, :] < D), other=0.0)
        kb = (b.to(tl.int64) * (HQ // GROUP) + hk) * NKT
        bt = tl.load(km_ptr + (kb + j[:, None]) * D + d[None, :], mask=(j[:, None] < NKT) & (d[None, :] < D),
                     other=0.0)
        z = _dot(a, tl.trans(bt), PREC)
        tl.store(out_ptr + (bh.to(tl.int64) * NQB + i[:, None]) * NKT + j[None, :], z,
                 mask=(i[:, None] < NQB) & (j[None, :] < NKT))


def pooled_logits(qbar: torch.Tensor, kbar: torch.Tensor, *, block_m: int, block_n: int, num_queries: int,
                  num_keys: int, seg_bound: int = 1) -> torch.Tensor:
    """``qbar @ kbar^T`` per GQA group (B, Hq, nqb, nkt) float32, unscaled; entries of tiles that no query of the
    row's block can see (from ``seg_bound``, see ``_tile_limit``) are left unwritten: selection never reads them.
    """
    B, Hq, nqb, D = qbar.shape
    Hkv, nkt = kbar.shape[1], kbar.shape[2]
    out = torch.empty(B, Hq, nqb, nkt, dtype=torch.float32, device=qbar.device)
    d_pad = max(16, triton.next_power_of_2(D))
    r = c = 16 if interpreting() else 64
    grid = (triton.cdiv(nkt, c), triton.cdiv(nqb, r), B * Hq)
    _pooled_logits_kernel[grid](
        qbar.contiguous(), kbar.contiguous(), out, Hq, Hq // Hkv, nqb, nkt, num_queries, num_keys, seg_bound,
        BM=block_m, BN=block_n, D=D, D_PAD=d_pad, R=r, C=c, PREC=_f32_prec(torch.float32), num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# per-row mass selection -> plan rows
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _mass_select_kernel(
    logit_ptr, s_lb, s_lh, s_li,
    kmin_ptr, kmax_ptr, kpad_ptr,
    ksim_ptr, qsim_ptr,
    offs_ptr, s_pb, s_ph, s_pi,
    cnt_ptr, msk_ptr, keep_ptr,
    H, KV_DIV, NQB, NKT, Nq, Nk, ROW0, ROW1,
    scale, tau, theta,
    BM: tl.constexpr, BN: tl.constexpr, SEG: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    MODE: tl.constexpr, HAS_KIDX: tl.constexpr, EXCL_DIAG: tl.constexpr, FORCE_DIAG: tl.constexpr,
    FORCE_FIRST: tl.constexpr, JUDGE: tl.constexpr, KEEP_ALL: tl.constexpr, WRITE_PLAN: tl.constexpr,
    WRITE_KEEP: tl.constexpr,
):
    # ROWS query blocks of one (batch, head) per program: every reduction serves ROWS rows at once
    i = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < ROW1
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // KV_DIV
    row = bh.to(tl.int64) * NQB + i
    off = Nk - Nq
    qmin = off + i * BM
    qmax = off + tl.minimum(i * BM + BM, Nq) - 1
    j = tl.arange(0, W)
    jin = j < NKT
    kbase = (b.to(tl.int64) * (H // KV_DIV) + hk) * NKT
    vis, part, kmin = _row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr, kbase, Nk, BN, HAS_KIDX)
    vis = vis & rin[:, None]
    # the diagonal: the query block's own segment under a segmented key permutation, else the partial tiles
    if SEG > 0:
        tseg = (j * BN) // SEG
        diag = vis & (tseg[None, :] >= (qmin // SEG)[:, None]) & (tseg[None, :] <= (qmax // SEG)[:, None])
    else:
        diag = part
    if HAS_KIDX:
        first = vis & (kmin == 0)[None, :]  # the logical tile that holds original key 0 (the sink)
    else:
        first = vis & (j == 0)[None, :]
    forced = vis & (j < 0)[None, :]
    if FORCE_DIAG:
        forced = forced | diag
    if FORCE_FIRST:
        forced = forced | first
    cand = vis
    if EXCL_DIAG:
        cand = cand & (diag == 0)
    if JUDGE:  # SpargeAttn: non-self-similar key tiles leave the softmax and are kept, as are such query rows
        kodd = tl.load(ksim_ptr + kbase + j, mask=jin, other=0.0) < theta
        qodd = tl.load(qsim_ptr + row, mask=rin, other=1.0) < theta
        cand = cand & (kodd == 0)[None, :]
        forced = forced | kodd[None, :] | qodd[:, None]
    if MODE == 1:
        cand = cand & (forced == 0)
    if KEEP_ALL:
        keep = vis
    else:
        lrow = b.to(tl.int64) * s_lb + h.to(tl.int64) * s_lh + i.to(tl.int64) * s_li
        x = tl.load(logit_ptr + lrow[:, None] + j[None, :], mask=vis, other=0.0)
        if MODE == 0:
            z = tl.where(cand, x * scale, -3.4028234663852886e38)
            e = tl.where(cand, tl.exp(z - tl.max(z, 1)[:, None]), 0.0)
            den = tl.sum(e, 1)
            p = e / tl.where(den > 0, den, 1.0)[:, None]
            total = tl.sum(p, 1)
            head = total * 0.0
        else:  # XAttention: block scores given, the forced tiles' mass counts first
            sv = tl.where(vis, x, 0.0)
            total = tl.sum(sv, 1)
            head = tl.sum(tl.where(forced, sv, 0.0), 1)
            p = tl.where(cand, sv, 0.0)
        keep = _top_mass(p, cand, tau * total, head)
    keep = (keep | forced) & vis
    if WRITE_PLAN:
        obase = offs_ptr + b.to(tl.int64) * s_pb + h.to(tl.int64) * s_ph + i.to(tl.int64) * s_pi
        _store_plan_rows(keep, part, j, jin, rin, obase, s_pi, cnt_ptr, msk_ptr, row, NKT, BN, W)
    if WRITE_KEEP:
        tl.store(keep_ptr + row[:, None] * NKT + j[None, :], keep.to(tl.int8), mask=rin[:, None] & jin[None, :])


def _rows_per_program(width: int, rows: int) -> int:
    # GPU: one warp per program holding up to 2048 elements, so that the 31 bisection reductions and the prefix
    # sums of a row stay inside the warp (shuffles, no shared memory or barriers; v1 spread a row over 4-8 warps
    # and was barrier-bound, see NOTES_selection.md). Interpreter: every reduction is a slow Python call, so take
    # as many rows as possible.
    per = 64 if interpreting() else max(1, _ROW_ELEMS // width)
    return max(1, min(_pow2(per), _pow2(rows)))


#: elements of a (ROWS, W) row tile per warp: 32 per thread keeps the bisection's working set in registers
#: (64 per thread spilled: 255 registers and a stack frame, seen in the compiler's resource report)
_ROW_ELEMS = 1024


def _row_warps(rows: int, width: int) -> int:
    return max(1, rows * width // _ROW_ELEMS)


@functools.lru_cache(maxsize=256)
def plan_buckets(nqb: int, nkt: int, block_m: int, block_n: int, num_queries: int, num_keys: int, seg_bound: int,
                 max_launches: int = 2) -> tuple:
    """``row_buckets`` of the rows' visible-tile bounds; cached per shape (host work, paid once per shape)."""
    return tuple(row_buckets(_row_limits(nqb, nkt, block_m, block_n, num_queries, num_keys, seg_bound),
                             max_launches))


def row_buckets(limits: list[int], max_launches: int = 2) -> list[tuple[int, int, int]]:
    """Split rows with non-decreasing visible-tile bounds into launches ``(row0, row1, width)``.

    A row's width is the power of two >= its bound (>= 16); the narrowest widths are merged so that at most
    ``max_launches`` launches remain (each extra launch costs host time, each doubling of width row work).
    """
    if not limits:
        return []
    widths = [max(16, _pow2(x)) for x in limits]
    floor = max(16, max(widths) >> (max_launches - 1))
    widths = [max(w, floor) for w in widths]
    out = []
    r0 = 0
    for r in range(1, len(widths) + 1):
        if r == len(widths) or widths[r] != widths[r0]:
            out.append((r0, r, widths[r0]))
            r0 = r
    return out


def _row_limits(nqb: int, nkt: int, block_m: int, block_n: int, num_queries: int, num_keys: int,
                seg_bound: int) -> list[int]:
    off = num_keys - num_queries
    lims = []
    for i in range(nqb):
        qmax = off + min((i + 1) * block_m, num_queries) - 1
        lims.append(min(nkt, -(-((qmax // seg_bound + 1) * seg_bound) // block_n)))
    return lims


def mass_select(
    logits: Optional[torch.Tensor],
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    num_query_blocks: int,
    num_key_tiles: int,
    num_queries: int,
    num_keys: int,
    block_m: int,
    block_n: int,
    scale: float = 1.0,
    tau: float = 1.0,
    segment: int = 0,
    tile_pos: Optional[dict] = None,
    mode: int = 0,
    exclude_diag: bool = False,
    force_diag: bool = False,
    force_first: bool = False,
    judge: Optional[tuple] = None,
    keep_all: bool = False,
    write_plan: bool = True,
    write_keep: bool = False,
    device=None,
):
    """Per (batch, head, query block): visibility, candidates, softmax, cumulative mass, forced tiles -> plan rows.

    ``logits`` (B, heads, nqb, nkt) float32 (unscaled pooled scores in mode 0, block scores in mode 1; only the
    causal region is read). ``tile_pos``: ``block_pool`` positions (kmin/kmax/kpad, (B, kv_heads, nkt)) of a
    permuted key order, None for the identity. ``segment``: the PBS segment (0: no segmented permutation).
    ``judge``: (key tile sim (B, kv_heads, nkt), query block sim (B, heads, nqb), theta) for SpargeAttn.
    Returns ``(tile_offsets, tile_counts, masked_counts)`` (int32) and, with ``write_keep``, an int8 keep table
    (B, heads, nqb, nkt) (zero past each row's bucket width).
    """
    B, H, nqb, nkt = batch, heads, num_query_blocks, num_key_tiles
    dev = device
    i32 = torch.int32
    offs = torch.empty(B, H, nqb, nkt, dtype=i32, device=dev) if write_plan else None
    cnt = torch.empty(B, H, nqb, dtype=i32, device=dev) if write_plan else None
    msk = torch.empty(B, H, nqb, dtype=i32, device=dev) if write_plan else None
    keep = torch.zeros(B, H, nqb, nkt, dtype=torch.int8, device=dev) if write_keep else None
    dummy_i = torch.empty(1, 1, 1, 1, dtype=i32, device=dev)
    dummy_f = torch.empty(1, dtype=torch.float32, device=dev)
    lg = logits if logits is not None else dummy_f.view(1, 1, 1, 1)
    tp = tile_pos or {}
    kmin, kmax, kpad = tp.get("kmin", dummy_i), tp.get("kmax", dummy_i), tp.get("kpad", dummy_i)
    ksim, qsim, theta = judge if judge is not None else (dummy_f, dummy_f, 0.0)
    o = offs if offs is not None else dummy_i
    seg_bound = segment if (segment and tile_pos is not None) else 1
    for r0, r1, w in plan_buckets(nqb, nkt, block_m, block_n, num_queries, num_keys, seg_bound):
        rows = _rows_per_program(w, r1 - r0)
        _mass_select_kernel[(triton.cdiv(r1 - r0, rows), B * H)](
            lg, lg.stride(0), lg.stride(1), lg.stride(2),
            kmin, kmax, kpad,
            ksim, qsim,
            o, o.stride(0), o.stride(1), o.stride(2),
            cnt if cnt is not None else dummy_i, msk if msk is not None else dummy_i,
            keep if keep is not None else dummy_i,
            H, H // kv_heads, nqb, nkt, num_queries, num_keys, r0, r1,
            float(scale), float(tau), float(theta),
            BM=block_m, BN=block_n, SEG=int(segment), W=w, ROWS=rows, MODE=mode, HAS_KIDX=tile_pos is not None,
            EXCL_DIAG=exclude_diag, FORCE_DIAG=force_diag, FORCE_FIRST=force_first, JUDGE=judge is not None,
            KEEP_ALL=keep_all, WRITE_PLAN=write_plan, WRITE_KEEP=write_keep,
            num_warps=_row_warps(rows, w),
        )
    return offs, cnt, msk, keep


# ---------------------------------------------------------------------------------------------------------------
# BFLA
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _bfla_scores_kernel(
    q_ptr, s_qb, s_qh, s_qn, s_qd,
    k_ptr, s_kb, s_kh, s_kn, s_kd,
    idx_ptr, s_ib, s_ih, s_in,
    out_ptr,
    HQ, GROUP, Nq, Nk, L, LQ, LK, SEGB,
    CB: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    R: tl.constexpr, C: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HAS_IDX: tl.constexpr,
    PREC: tl.constexpr,
):
    bh = tl.program_id(0)
    jt = tl.program_id(1)
    it = tl.program_id(2)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    off = Nk - Nq
    qmax = off + tl.minimum((it * QB + QB) * CB, Nq) - 1
    # causal skip (the lower bound of any original position in the column block, see _tile_limit)
    if (jt * KB * CB) // SEGB * SEGB <= qmax:
        u = it * R + tl.arange(0, R)  # query groups (flatten-g rows)
        v = jt * C + tl.arange(0, C)  # key groups
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q_base = q_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh
        k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
        i_base = idx_ptr + b.to(tl.int64) * s_ib + hk.to(tl.int64) * s_ih
        acc = tl.zeros([R, C], tl.float32)
        klive = v < 0
        # <flatten(Q_u), flatten(K_v)> = sum over the offset t inside the group of <Q[u*G+t], K[v*G+t]>
        for t in range(G):
            qrow = u * G + t
            qa = tl.load(q_base + qrow.to(tl.int64)[:, None] * s_qn + d[None, :] * s_qd,
                         mask=(qrow[:, None] < Nq) & dmask[None, :], other=0.0)
            krow = v * G + t
            kin = krow < L
            if HAS_IDX:
                phys = tl.load(i_base + krow.to(tl.int64) * s_in, mask=kin, other=-1)
                kval = kin & (phys >= 0) & (phys < Nk)
            else:
                phys = krow
                kval = kin
            klive = klive | kval
            ka = tl.load(k_base + phys.to(tl.int64)[:, None] * s_kn + d[None, :] * s_kd,
                         mask=kval[:, None] & dmask[None, :], other=0.0)
            acc += _dot(qa, tl.trans(ka), PREC)
        qlive = u * G < Nq
        acc = tl.where(qlive[:, None] & klive[None, :], acc, -3.4028234663852886e38)
        # max over the group pairs of each (coarse query block, coarse key block)
        m = tl.max(tl.max(tl.reshape(acc, (QB, NG, KB, NG)), 3), 1)
        a = it * QB + tl.arange(0, QB)
        c = jt * KB + tl.arange(0, KB)
        tl.store(out_ptr + (bh.to(tl.int64) * LQ + a[:, None]) * LK + c[None, :], m,
                 mask=(a[:, None] < LQ) & (c[None, :] < LK))


def bfla_block_scores(q: torch.Tensor, k: torch.Tensor, block: int, group: int,
                      key_index: Optional[torch.Tensor] = None, seg_bound: int = 1) -> torch.Tensor:
    """``sparse_compile.methods.bfla.bfla_block_scores`` (unscaled), causal region only: (B, Hq, LQ, LK) float32."""
    q, k = _launchable(q), _launchable(k)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = key_index.shape[-1] if key_index is not None else Nk
    LQ, LK = -(-Nq // block), -(-L // block)
    ng = block // group
    out = torch.empty(B, Hq, LQ, LK, dtype=torch.float32, device=q.device)
    d_pad = max(16, triton.next_power_of_2(D))
    if interpreting():
        rows = 16
    else:
        rows = 64 if LQ * ng <= 256 else 128
    rows = max(rows, ng)
    qb = kb = rows // ng
    idx = key_index if key_index is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
    grid = (B * Hq, triton.cdiv(LK, kb), triton.cdiv(LQ, qb))
    _bfla_scores_kernel[grid](
        q, *q.stride(), k, *k.stride(), idx, *idx.stride(), out,
        Hq, Hq // Hkv, Nq, Nk, L, LQ, LK, seg_bound,
        CB=block, G=group, NG=ng, QB=qb, KB=kb, R=qb * ng, C=kb * ng, D=D, D_PAD=d_pad,
        HAS_IDX=key_index is not None,
        PREC=_f32_prec(q.dtype), num_warps=8 if rows >= 128 else 4, num_stages=3,
    )
    return out


@triton.jit
def _bfla_tiles_kernel(
    mass_ptr,
    kmin_ptr, kmax_ptr, kpad_ptr,
    offs_ptr, s_pb, s_ph, s_pi, cnt_ptr, msk_ptr,
    HKV, GROUP, NQT, NKT, LQ, LK, Nq, Nk, ROW0, ROW1,
    local_tiles, sink_tiles, stride, seed_s, seed_r, rr_thr,
    TQ: tl.constexpr, TK: tl.constexpr, CB: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
    HAS_KIDX: tl.constexpr, STRIDE_ON: tl.constexpr, RANDOM_ON: tl.constexpr, KEEP_ALL: tl.constexpr,
):
    i = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < ROW1
    bh = tl.program_id(1)  # (batch, KV head): the tile mask is shared by the GQA group
    b = bh // HKV
    hk = bh % HKV
    row = bh.to(tl.int64) * NQT + i
    off = Nk - Nq
    qmin = off + i * TQ
    qmax = off + tl.minimum(i * TQ + TQ, Nq) - 1
    j = tl.arange(0, W)
    jin = j < NKT
    vis, part, kmin = _row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr, bh.to(tl.int64) * NKT,
                                      Nk, TK, HAS_KIDX)
    vis = vis & rin[:, None]
    if KEEP_ALL:
        keep = vis
    else:
        ci = (i * TQ) // CB
        cj = (j * TK) // CB
        keep = vis & (j < 0)[None, :]
        for p in range(GROUP):  # OR of the group's query heads (Eq. 14: the tile mask is per KV head)
            mrow = ((b.to(tl.int64) * HKV + hk) * GROUP + p) * LQ + ci
            m = tl.load(mass_ptr + mrow[:, None] * LK + cj[None, :], mask=vis & (cj < LK)[None, :], other=0)
            keep = keep | (m != 0)
        first = (off + i * TQ) // TK - local_tiles
        last = (off + tl.minimum(i * TQ + TQ, Nq) - 1) // TK
        keep = keep | ((j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])) | (j < sink_tiles)[None, :]
        if STRIDE_ON:
            hi = _mix32(tl.cast(seed_s, tl.uint32) ^ i.to(tl.uint32))
            chi = _mix32(hi[:, None] ^ j.to(tl.uint32)[None, :])
            keep = keep | (vis & (keep == 0) & (chi % tl.cast(stride, tl.uint32) == 0))
        if RANDOM_ON:
            hh = _mix32(_mix32(tl.cast(seed_r, tl.uint32) ^ hk.to(tl.uint32)) ^ i.to(tl.uint32))
            psi = _mix32(hh[:, None] ^ j.to(tl.uint32)[None, :])
            keep = keep | (vis & (keep == 0) & (psi.to(tl.int64) < rr_thr))
        keep = keep & vis
    obase = offs_ptr + b.to(tl.int64) * s_pb + hk.to(tl.int64) * s_ph + i.to(tl.int64) * s_pi
    _store_plan_rows(keep, part, j, jin, rin, obase, s_pi, cnt_ptr, msk_ptr, row, NKT, TK, W)


def _mix32_host(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def bfla_tiles(mass: Optional[torch.Tensor], *, batch: int, kv_heads: int, group: int, num_queries: int,
               num_keys: int, key_len: int, coarse: int, tile_q: int, tile_k: int, local_tiles: int,
               sink_tiles: int, stride: int, random_rescue: float, seed: int, tile_pos: Optional[dict] = None,
               keep_all: bool = False, segment: int = 0, device=None):
    """BFLA stage 2 on the tile grid, per (batch, KV head, query tile), straight into plan rows.

    ``mass`` int8 (B, Hq, LQ, LK) per query head (OR-ed over the group here). Returns (offsets, counts, masked).
    """
    nqt, nkt = -(-num_queries // tile_q), -(-key_len // tile_k)
    LQ, LK = -(-num_queries // coarse), -(-key_len // coarse)
    i32 = torch.int32
    offs = torch.empty(batch, kv_heads, nqt, nkt, dtype=i32, device=device)
    cnt = torch.empty(batch, kv_heads, nqt, dtype=i32, device=device)
    msk = torch.empty(batch, kv_heads, nqt, dtype=i32, device=device)
    dummy = torch.empty(1, dtype=i32, device=device)
    tp = tile_pos or {}
    m = mass if mass is not None else torch.empty(1, dtype=torch.int8, device=device)
    seed_s = _mix32_host(int(seed) & 0xFFFFFFFF)
    seed_r = _mix32_host((int(seed) ^ _RANDOM_SALT) & 0xFFFFFFFF)
    seg_bound = segment if (segment and tile_pos is not None) else 1
    for r0, r1, w in plan_buckets(nqt, nkt, tile_q, tile_k, num_queries, num_keys, seg_bound):
        rows = _rows_per_program(w, r1 - r0)
        _bfla_tiles_kernel[(triton.cdiv(r1 - r0, rows), batch * kv_heads)](
            m, tp.get("kmin", dummy), tp.get("kmax", dummy), tp.get("kpad", dummy),
            offs, offs.stride(0), offs.stride(1), offs.stride(2), cnt, msk,
            kv_heads, group, nqt, nkt, LQ, LK, num_queries, num_keys, r0, r1,
            int(local_tiles), int(sink_tiles), max(1, int(stride)), seed_s, seed_r,
            int(random_rescue * 2**32),
            TQ=tile_q, TK=tile_k, CB=coarse, W=w, ROWS=rows, HAS_KIDX=tile_pos is not None, STRIDE_ON=stride > 0,
            RANDOM_ON=random_rescue > 0, KEEP_ALL=keep_all, num_warps=_row_warps(rows, w),
        )
    return offs, cnt, msk


# ---------------------------------------------------------------------------------------------------------------
# PBS key importance and permutation
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _pbs_lse_kernel(
    q_ptr, s_qb, s_qh, s_qn, s_qd,
    k_ptr, s_kb, s_kh, s_kn, s_kd,
    m_ptr, s_ptr,
    HQ, GROUP, Nq, Nk, R, NCH, qk_scale,
    CH: tl.constexpr, BN: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    rows = tl.arange(0, R_PAD)
    rin = rows < R
    qrow = Nq - R + rows
    qpos = qrow + (Nk - Nq)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + qrow.to(tl.int64)[:, None] * s_qn
                + d[None, :] * s_qd, mask=rin[:, None] & dmask[None, :], other=0.0)
    k_base = k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    m = tl.full([R_PAD], -1.0e30, tl.float32)
    s = tl.zeros([R_PAD], tl.float32)
    for n0 in range(c * CH, tl.minimum(c * CH + CH, Nk), BN):
        keys = n0 + tl.arange(0, BN)
        kin = keys < Nk
        kt = tl.load(k_base + keys.to(tl.int64)[:, None] * s_kn + d[None, :] * s_kd,
                     mask=kin[:, None] & dmask[None, :], other=0.0)
        z = _dot(q, tl.trans(kt), PREC) * qk_scale
        ok = (keys[None, :] <= qpos[:, None]) & kin[None, :]
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(z - m_new[:, None]), 1)
        m = m_new
    out = (bh.to(tl.int64) * R_PAD + rows) * NCH + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)


@triton.jit
def _pbs_importance_kernel(
    q_ptr, s_qb, s_qh, s_qn, s_qd,
    k_ptr, s_kb, s_kh, s_kn, s_kd,
    m_ptr, s_ptr, imp_ptr, perm_ptr,
    HKV, GROUP, Nq, Nk, R, NCH, SEG_END, qk_scale, count,
    BN: tl.constexpr, R_PAD: tl.constexpr, RB: tl.constexpr, NCH_PAD: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, PREC: tl.constexpr, WRITE_IMP: tl.constexpr, SORT: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    d = tl.arange(0, D_PAD)
    dmask = d < D
    keys = c * BN + tl.arange(0, BN)
    kin = keys < Nk
    kt = tl.load(k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh + keys.to(tl.int64)[:, None] * s_kn
                 + d[None, :] * s_kd, mask=kin[:, None] & dmask[None, :], other=0.0)
    ch = tl.arange(0, NCH_PAD)
    # scores are computed transposed, (keys, rows): the sum over query rows runs along axis 1, inside threads and
    # warps, and the probabilities of every head and row chunk accumulate elementwise before one final reduction
    acc = tl.zeros([BN, RB], tl.float32)
    for p in range(GROUP):  # the group's query heads share the key order (one permutation per KV head)
        h = hk * GROUP + p
        for r0 in range(0, R_PAD, RB):
            rows = r0 + tl.arange(0, RB)
            rin = rows < R
            qrow = Nq - R + rows
            qpos = qrow + (Nk - Nq)
            q = tl.load(q_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + qrow.to(tl.int64)[:, None] * s_qn
                        + d[None, :] * s_qd, mask=rin[:, None] & dmask[None, :], other=0.0)
            # this head's rows' base-2 log-sum-exp from the lse pass's per-chunk (max, sum) partials
            pb = ((b.to(tl.int64) * (HKV * GROUP) + h) * R_PAD + rows[None, :]) * NCH + ch[:, None]
            pm = tl.load(m_ptr + pb, mask=(ch < NCH)[:, None], other=-1.0e30)
            ps = tl.load(s_ptr + pb, mask=(ch < NCH)[:, None], other=0.0)
            mx = tl.max(pm, 0)
            lse = mx + tl.log2(tl.sum(ps * tl.exp2(pm - mx[None, :]), 0))
            zt = _dot(kt, tl.trans(q), PREC) * qk_scale  # (BN, RB)
            ok = (keys[:, None] <= qpos[None, :]) & kin[:, None] & rin[None, :]
            acc += tl.where(ok, tl.exp2(zt - lse[None, :]), 0.0)
    imp = tl.sum(acc, 1) / count
    if WRITE_IMP:
        tl.store(imp_ptr + bh.to(tl.int64) * Nk + keys, imp, mask=kin)
    if SORT:
        # this program's keys are one segment: sort them by descending importance (ties: lower index first,
        # as a stable sort) with packed (value bits, inverted index) 64-bit keys; importances are >= 0, so
        # their bit patterns order like the values
        loc = tl.arange(0, BN)
        key = (imp.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)
        srt = tl.sort(key, descending=True)
        perm = c * BN + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
        # keys past the last whole segment keep their order (PBS Sec. 3.2)
        perm = tl.where(c * BN + BN <= SEG_END, perm, keys)
        tl.store(perm_ptr + bh.to(tl.int64) * Nk + keys, perm, mask=kin)


def _pbs_lse(q, k, scale, r, prec):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    d_pad = max(16, triton.next_power_of_2(D))
    r_pad = max(16, triton.next_power_of_2(r))
    bn = 16 if interpreting() else 64
    # GPU: about 16 chunks per head for parallelism; interpreter: one (it pays per program)
    ch = _pow2(Nk) if interpreting() else max(bn, min(4096, _pow2(-(-Nk // 16))))
    nch = triton.cdiv(Nk, ch)
    m = torch.empty(B, Hq, r_pad, nch, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    _pbs_lse_kernel[(nch, B * Hq)](
        q, *q.stride(), k, *k.stride(), m, s, Hq, Hq // Hkv, Nq, Nk, r, nch, scale * _LOG2E,
        CH=ch, BN=bn, R_PAD=r_pad, D=D, D_PAD=d_pad, PREC=prec, num_warps=4 if r_pad <= 64 else 8, num_stages=3,
    )
    # the importance pass combines the chunks' partial (max, sum) itself: no small torch ops on the hot path
    return m, s, r_pad, nch


def pbs_key_importance(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """``sparse_compile.methods.reorder.pbs_key_importance``: (B, Hkv, Nk) float32."""
    return _pbs_pass2(q, k, scale, rows, segment=0, want_imp=True)[0]


def pbs_key_permutation(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, segment: int):
    """PBS reorder: int32 (B, Hkv, Nk) key order, descending importance inside each whole segment."""
    return _pbs_pass2(q, k, scale, rows, segment=segment, want_imp=False)[1]


def _pbs_pass2(q, k, scale, rows, *, segment, want_imp):
    q, k = _launchable(q), _launchable(k)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    r = min(rows, Nq)
    prec = _f32_prec(q.dtype)
    m, s, r_pad, nch = _pbs_lse(q, k, scale, r, prec)
    d_pad = max(16, triton.next_power_of_2(D))
    fuse = segment > 0 and segment & (segment - 1) == 0 and segment <= 1024 and not want_imp
    bn = segment if fuse else (16 if interpreting() else 128)
    imp = torch.empty(B, Hkv, Nk, dtype=torch.float32, device=q.device) if (want_imp or not fuse) else None
    perm = torch.empty(B, Hkv, Nk, dtype=torch.int32, device=q.device) if fuse else None
    rb = r_pad if interpreting() else min(r_pad, max(16, (64 * 256) // bn))
    dummy_f = torch.empty(1, dtype=torch.float32, device=q.device)
    dummy_i = torch.empty(1, dtype=torch.int32, device=q.device)
    _pbs_importance_kernel[(triton.cdiv(Nk, bn), B * Hkv)](
        q, *q.stride(), k, *k.stride(), m, s, imp if imp is not None else dummy_f,
        perm if perm is not None else dummy_i,
        Hkv, Hq // Hkv, Nq, Nk, r, nch, (Nk // segment) * segment if segment else 0, scale * _LOG2E,
        float((Hq // Hkv) * r),
        BN=bn, R_PAD=r_pad, RB=rb, NCH_PAD=max(2, triton.next_power_of_2(nch)), D=D, D_PAD=d_pad, PREC=prec,
        WRITE_IMP=imp is not None, SORT=fuse, num_warps=8 if bn * rb >= 128 * 128 else 4, num_stages=2,
    )
    if segment and not fuse:
        perm = segmented_argsort_desc(imp, segment, Nk // segment)
    return imp, perm


# ---------------------------------------------------------------------------------------------------------------
# segmented argsort
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _orderable(x):
    """int32 whose signed order is the float order of x (-0.0 and +0.0 equal)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _seg_argsort_kernel(x_ptr, out_ptr, L, NSEG, NSEG_ALL, SEG: tl.constexpr, S_PAD: tl.constexpr,
                        SPP: tl.constexpr):
    s = tl.program_id(0) * SPP + tl.arange(0, SPP)  # SPP segments per program, one sort along the last dim
    row = tl.program_id(1)
    loc = tl.arange(0, S_PAD)
    pos = s[:, None] * SEG + loc[None, :]
    base = row.to(tl.int64) * L
    live = (loc < SEG)[None, :] & (pos < L) & (s < NSEG_ALL)[:, None]
    x = tl.load(x_ptr + base + pos, mask=live, other=float("-inf"))
    key = (_orderable(x).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)[None, :]
    key = tl.where(live, key, -9223372036854775807)  # padding sorts last
    srt = tl.sort(key, descending=True)
    idx = s[:, None] * SEG + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
    # past the listed segments: identity
    idx = tl.where((s < NSEG)[:, None], idx, pos)
    tl.store(out_ptr + base + pos, idx, mask=live)


def segmented_argsort_desc(scores: torch.Tensor, segment: int, num_segments: int) -> torch.Tensor:
    """``sparse_compile.methods._common.segmented_argsort_desc`` as int32 (bitonic sorts in registers).

    Stable (ties keep the lower index). A last listed segment shorter than ``segment`` sorts what it has; entries
    past ``num_segments * segment`` stay in place. Segments longer than 4096 go to ``torch.argsort``.
    """
    length = scores.shape[-1]
    if segment > 4096 or length == 0:
        from sparse_compile.methods._common import segmented_argsort_desc as ref

        return ref(scores, segment, num_segments).to(torch.int32)
    x = scores.float().reshape(-1, length).contiguous()
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    nseg_all = -(-length // segment)
    s_pad = max(16, triton.next_power_of_2(segment))
    spp = max(1, min(_pow2(nseg_all), ((1 << 14) if interpreting() else 2048) // s_pad))
    _seg_argsort_kernel[(triton.cdiv(nseg_all, spp), x.shape[0])](
        x, out, length, num_segments, nseg_all, SEG=segment, S_PAD=s_pad, SPP=spp,
        num_warps=max(1, min(8, spp * s_pad // 256)))
    return out.view(scores.shape)


# ---------------------------------------------------------------------------------------------------------------
# S2O
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _s2o_rank_keys_kernel(
    k_ptr, s_kb, s_kh, s_kn, s_kd, qm_ptr, out_ptr,
    HKV, NSEG, SEG, TOT, TB, SHIFT, BH0, GROUP,
    BT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PREC: tl.constexpr,
):
    c = tl.program_id(0)
    bhl = tl.program_id(1)  # (batch, KV head) inside this chunk of them
    bh = BH0 + bhl
    b = bh // HKV
    hk = bh % HKV
    t = c * BT + tl.arange(0, BT)
    tin = t < (NSEG - 1) * SEG
    d = tl.arange(0, D_PAD)
    dmask = d < D
    kt = tl.load(k_ptr + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh + t.to(tl.int64)[:, None] * s_kn
                 + d[None, :] * s_kd, mask=tin[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    n = tl.arange(0, G_PAD)
    nin = n < NSEG
    # segment query means of the GQA group's heads, averaged (one ranking per KV group)
    qm = tl.zeros([G_PAD, D_PAD], tl.float32)
    for p in range(GROUP):
        hq = (b.to(tl.int64) * HKV + hk) * GROUP + p
        qm += tl.load(qm_ptr + (hq * NSEG + n[:, None]) * D + d[None, :], mask=nin[:, None] & dmask[None, :],
                      other=0.0)
    qm = qm / GROUP
    sc = _dot(kt, tl.trans(qm), PREC)  # (BT, G_PAD): <q_mean[n], K[t]>
    use = tin[:, None] & nin[None, :] & (t[:, None] < n[None, :] * SEG)  # segment n ranks its prefix [0, nS)
    # ascending packed key = (segment, descending score, position): one global sort ranks every segment
    desc = (2147483647 - _orderable(sc).to(tl.int64))
    seg = (bhl.to(tl.int64) * NSEG + n).to(tl.int64)
    key = (seg[None, :] << SHIFT) | (desc << TB) | t.to(tl.int64)[:, None]
    start = (n * (n - 1) // 2).to(tl.int64) * SEG  # segment n's part of the (batch, head)'s list
    tl.store(out_ptr + bhl.to(tl.int64) * TOT + start[None, :] + t[:, None], key, mask=use)


def s2o_rank_keys(k: torch.Tensor, q_mean: torch.Tensor, segment: int) -> tuple[torch.Tensor, int]:
    """Every segment's causal prefix ranked by descending <q_mean[n], K[t]> (stable): int64 (B, Hkv, TOT) with
    TOT = S * g * (g - 1) / 2; entry ``S*n*(n-1)/2 + r`` holds (in its low bits) the position of segment n's r-th key.

    ``q_mean`` (B, H, g, D) float32 segment means, H = Hkv (one ranking per KV head) or a multiple of it (the
    kernel then averages each GQA group's heads; slower: every program re-reads the group's means).

    Returns (sorted packed keys, number of low bits that hold the position).
    """
    k = _launchable(k)
    B, Hkv, N, D = k.shape
    g = q_mean.shape[2]
    group = q_mean.shape[1] // Hkv
    tot = segment * g * (g - 1) // 2
    tb = max(1, ((g - 1) * segment - 1).bit_length()) if g > 1 else 1
    out = torch.empty(B, Hkv, max(tot, 1), dtype=torch.int64, device=k.device)
    if tot == 0:
        return out[..., :0], tb
    qm = q_mean.float().contiguous()
    seg_bits = 63 - 32 - tb  # bits left for the segment id: (batch, head) chunks that fit are sorted together
    per_chunk = max(1, (1 << seg_bits) // g) if seg_bits > 0 else 0
    if per_chunk == 0:
        raise ValueError(f"s2o_rank_keys: N={N} too long for 64-bit packed keys")
    d_pad = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(g))
    bt = 16 if interpreting() else 64  # 128 x 64 int64 keys per 4 warps spilled (stack frame of 512 bytes)
    flat = out.view(B * Hkv, tot)
    chunks = []
    for bh0 in range(0, B * Hkv, per_chunk):  # one chunk unless N is huge (bits run out)
        bh1 = min(B * Hkv, bh0 + per_chunk)
        part = flat[bh0:bh1]
        _s2o_rank_keys_kernel[(triton.cdiv((g - 1) * segment, bt), bh1 - bh0)](
            k, *k.stride(), qm, part, Hkv, g, segment, tot, tb, 32 + tb, bh0, group,
            BT=bt, G_PAD=g_pad, D=D, D_PAD=d_pad, PREC=_f32_prec(torch.float32), num_warps=4,
        )
        # one radix sort of 64-bit keys ranks every segment of the chunk at once (segment id in the top bits)
        chunks.append(torch.sort(part.reshape(-1)).values)
    srt = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return srt.view(B, Hkv, tot), tb


@triton.jit
def _s2o_assemble_kernel(srt_ptr, out_ptr, N, SEG, TOT, TMASK, LK, BNK, BLK: tl.constexpr):
    c = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    seg_len = tl.minimum(N - n * SEG, SEG)
    intra_pad = (seg_len + BNK - 1) // BNK * BNK
    base = tl.cast(n * (n + 1) // 2, tl.int64) * SEG
    s = c * BLK + tl.arange(0, BLK)
    live = s < intra_pad + n * SEG
    own = tl.where(s < seg_len, n * SEG + s, -1)
    src = bh.to(tl.int64) * TOT + tl.cast(n * (n - 1) // 2, tl.int64) * SEG + (s - intra_pad)
    ranked = (tl.load(srt_ptr + src, mask=live & (s >= intra_pad), other=0) & TMASK).to(tl.int32)
    tl.store(out_ptr + bh.to(tl.int64) * LK + base + s, tl.where(s < intra_pad, own, ranked), mask=live)


def s2o_assemble(ranked: torch.Tensor, tb: int, n: int, segment: int, block_n: int, length: int) -> torch.Tensor:
    """The S2O logical key list (B, Hkv, L) int32: per segment its own keys (padded with -1), then its ranking."""
    B, Hkv = ranked.shape[:2]
    g = -(-n // segment)
    out = torch.empty(B, Hkv, length, dtype=torch.int32, device=ranked.device)
    blk = 256 if not interpreting() else 64
    longest = -(-segment // block_n) * block_n + (g - 1) * segment
    src = ranked if ranked.numel() else torch.empty(1, dtype=torch.int64, device=ranked.device)
    _s2o_assemble_kernel[(triton.cdiv(longest, blk), g, B * Hkv)](
        src, out, n, segment, ranked.shape[-1], (1 << tb) - 1, length, block_n, BLK=blk, num_warps=4,
    )
    return out


@triton.jit
def _s2o_select_kernel(qidx_ptr, s_qb, s_qh, offs_ptr, s_pb, s_ph, s_pi, cnt_ptr, msk_ptr,
                       H, N, NQB, SEG, WIDTH,
                       BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr,
                       HAS_QIDX: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rin = i < NQB
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    seg = (i * BM) // SEG
    if HAS_QIDX:
        r = i[:, None] * BM + tl.arange(0, BM)[None, :]
        qi = tl.load(qidx_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + r, mask=r < N, other=-1)
        qmax = tl.max(qi, 1)
    else:
        qmax = tl.minimum(i * BM + BM, N) - 1
    seg_len = tl.minimum(N - seg * SEG, SEG)
    intra_pad = (seg_len + BN - 1) // BN * BN
    base = SEG * seg * (seg + 1) // 2
    n_masked = tl.minimum((qmax - seg * SEG) // BN + 1, intra_pad // BN)
    count = n_masked + (seg * SEG) // BN
    obase = offs_ptr + b.to(tl.int64) * s_pb + h.to(tl.int64) * s_ph + i.to(tl.int64) * s_pi
    for t0 in range(0, WIDTH, W):
        t = t0 + tl.arange(0, W)[None, :]
        nm = n_masked[:, None]
        o = tl.where(t < nm, base[:, None] + t * BN, (base + intra_pad)[:, None] + (t - nm) * BN)
        tl.store(obase[:, None] + t, tl.where(t < count[:, None], o, 0), mask=rin[:, None] & (t < WIDTH))
    row = bh.to(tl.int64) * NQB + i
    tl.store(cnt_ptr + row, count, mask=rin)
    tl.store(msk_ptr + row, n_masked, mask=rin)


def s2o_select(query_index: Optional[torch.Tensor], *, batch: int, heads: int, n: int, segment: int, block_m: int,
               block_n: int, width: int, device=None):
    """``sparse_compile.methods.s2o.select_s2o``'s tables: (offsets, counts, masked) int32, (B, heads, nqb, width)."""
    nqb = -(-n // block_m)
    i32 = torch.int32
    offs = torch.empty(batch, heads, nqb, width, dtype=i32, device=device)
    cnt = torch.empty(batch, heads, nqb, dtype=i32, device=device)
    msk = torch.empty(batch, heads, nqb, dtype=i32, device=device)
    qi = query_index if query_index is not None else cnt
    w = min(1024, max(16, triton.next_power_of_2(width)))
    rows = max(1, min(_pow2(nqb), 64 if interpreting() else 4))
    _s2o_select_kernel[(triton.cdiv(nqb, rows), batch * heads)](
        qi, qi.stride(0), qi.stride(1), offs, offs.stride(0), offs.stride(1), offs.stride(2), cnt, msk,
        heads, n, nqb, segment, width, BM=block_m, BN=block_n, W=w, ROWS=rows, HAS_QIDX=query_index is not None,
        num_warps=4,
    )
    return offs, cnt, msk
