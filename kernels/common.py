"""Pieces shared by the selection kernels: Triton helpers (visibility, the mass rule, plan rows, sort keys) and the
host-side launch arithmetic (interpreter detection, precisions, row buckets).

Conventions of every selection kernel: selection math in float32, block means and sums accumulated in float32
from the input dtype; bf16/fp16 matmuls on tensor cores with float32 accumulation, float32 inputs through
``tf32x3`` on the GPU (float32-level accuracy) and IEEE float32 under the interpreter. Nothing syncs with the host;
host work is shape arithmetic, cached per shape.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .validate import cdiv

__all__ = ["interpreting", "pow2", "dot_precision", "launchable", "TileGrid", "PlanTables", "empty_plan_tables",
           "plan_buckets", "rows_per_program", "row_warps", "LENGTH_ARGS", "jit_any_length"]

#: Integer kernel arguments that follow a prompt's length: the length itself, counts derived from it (rows, tiles,
#: query blocks, segments, work items) and the strides of the tables shaped by them (scores, plan rows, key
#: indices, row log-sum-exps); and the head counts, so that ``precompile``'s small problem compiles the kernels of
#: a model with any number of heads above one. Triton specialises an int argument on its divisibility by 16, so
#: each new class of length (an odd length after even ones, a tile count not a multiple of 16) would compile the
#: kernel again, inside a server's call (5 planning kernels, 6 s, at 24,577 tokens after 16,384). These bound loops
#: and masks and address small tables; the loads that need alignment (q, k, v, o) go through their own strides,
#: which stay specialised (a head dim that is a multiple of 16 makes them length-independent). Compiled without
#: it, a kernel compiled for one length serves every length of its power-of-two bucket (``precompile`` runs one
#: length per bucket).
LENGTH_ARGS = ("N", "L", "LQ", "LK", "LENGTH", "COUNT", "TOTAL", "NUM_QUERIES", "NUM_KEYS", "NUM_QUERY_BLOCKS",
               "NUM_KEY_TILES", "NUM_QUERY_TILES", "NUM_BLOCKS", "NUM_CHUNKS", "NUM_PROGRAMS", "NUM_SEGMENTS",
               "NUM_SEGMENTS_ALL", "SEGMENTS_END", "ROW0", "ROW1", "ROWS", "N_Q", "N_K", "KEY_LEN", "N_QBLK", "N_PBLK",
               "N_ITEMS", "WIDTH", "count", "H", "HQ", "HKV", "H_Q", "GROUP", "GQA",
               # table strides: scores / logits, plan rows, tile counts, key and query indices, LSEs
               "stride_sb", "stride_sh", "stride_si", "stride_lb", "stride_lh", "stride_li", "stride_pb", "stride_ph",
               "stride_pi", "stride_tb", "stride_th", "stride_tq", "stride_cb", "stride_ch", "stride_mb", "stride_mh",
               "stride_kib", "stride_kih", "stride_qib", "stride_qih", "stride_ib", "stride_ih")


def jit_any_length(fn=None, *, jit=None):
    """``@triton.jit`` (or ``jit``, e.g. ``gluon.jit``) with ``LENGTH_ARGS`` compiled for any length."""
    jit = jit or triton.jit
    if fn is None:
        return functools.partial(jit_any_length, jit=jit)
    params = inspect.signature(fn).parameters.values()  # a constexpr is compiled per value anyway (Triton refuses it)
    return jit(fn, do_not_specialize_on_alignment=[p.name for p in params if p.name in LENGTH_ARGS
                                                   and "constexpr" not in str(p.annotation)])



def _read_interpret() -> bool:
    """TRITON_INTERPRET as Triton itself reads it ("1", "true", "on", "yes", any case; "false" or "2" are off)."""
    try:
        from triton._C.libtriton import getenv_bool

        return bool(getenv_bool("TRITON_INTERPRET", False))
    except (ImportError, AttributeError):  # pragma: no cover - another Triton layout
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


# read once, like @triton.jit itself reads it when the kernels are defined (and it is on the host hot path)
_INTERPRETING = _read_interpret()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _INTERPRETING


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 operands keep float32 accuracy (tf32x3; IEEE in the interpreter)."""
    if dtype != torch.float32:
        return "none"
    return "ieee" if interpreting() else "tf32x3"


def runs_in_float32(dtype: torch.dtype) -> bool:
    """Whether the kernels read inputs of ``dtype`` as float32: bf16 ``tl.dot`` is wrong under the interpreter, so
    those small CPU cases run in float32."""
    return dtype == torch.bfloat16 and interpreting()


def launchable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels can read it (``runs_in_float32``)."""
    return x.float() if runs_in_float32(x.dtype) else x


class TileGrid(NamedTuple):
    """The block tiling one selection call works on: query blocks of ``block_m`` logical rows, key tiles of
    ``block_n`` logical keys (``key_length`` of them: the key list, longer than ``num_keys`` under S2O)."""

    batch: int
    heads: int
    kv_heads: int
    num_queries: int
    num_keys: int
    key_length: int
    block_m: int
    block_n: int
    device: torch.device

    @property
    def num_query_blocks(self) -> int:
        return cdiv(self.num_queries, self.block_m)

    @property
    def num_key_tiles(self) -> int:
        return cdiv(self.key_length, self.block_n)


class PlanTables(NamedTuple):
    """A plan's int32 tables: ``tile_offsets`` (B, H, blocks, width), ``tile_counts`` and ``masked_counts``
    (B, H, blocks)."""

    tile_offsets: torch.Tensor
    tile_counts: torch.Tensor
    masked_counts: torch.Tensor


def empty_plan_tables(batch: int, heads: int, blocks: int, width: int, device) -> PlanTables:
    i32 = torch.int32
    return PlanTables(torch.empty(batch, heads, blocks, width, dtype=i32, device=device),
                      torch.empty(batch, heads, blocks, dtype=i32, device=device),
                      torch.empty(batch, heads, blocks, dtype=i32, device=device))


# ---------------------------------------------------------------------------------------------------------------
# row launches of the per-(query block) kernels
# ---------------------------------------------------------------------------------------------------------------

#: elements of a (ROWS, W) row tile per warp: 32 per thread keeps the bisection's working set in registers
#: (64 per thread spilled: 255 registers and a stack frame, seen in the compiler's resource report)
_ROW_ELEMS = 1024


def rows_per_program(width: int, rows: int) -> int:
    # GPU: one warp per program holding up to 1024 elements, so that the 31 bisection reductions and the prefix
    # sums of a row stay inside the warp (shuffles, no shared memory or barriers; v1 spread a row over 4-8 warps
    # and was barrier-bound, see docs/kernels.md). Interpreter: every reduction is a slow Python call, so take
    # as many rows as possible.
    # The GPU count follows the width alone: a constexpr that followed the bucket's row count too would compile
    # the kernel again for a length whose widest bucket holds fewer rows (16,400 tokens after 32,768).
    if interpreting():
        return max(1, min(64, pow2(rows)))
    return pow2(max(1, _ROW_ELEMS // width))


def row_warps(rows: int, width: int) -> int:
    return max(1, rows * width // _ROW_ELEMS)


@functools.lru_cache(maxsize=256)
def plan_buckets(nqb: int, nkt: int, block_m: int, block_n: int, num_queries: int, num_keys: int, seg_bound: int,
                 max_launches: int = 2) -> tuple:
    """Launches ``(row0, row1, width)`` over the query blocks, by their visible-tile bounds; cached per shape.

    A row's width is the power of two >= its bound (>= 16); the narrowest widths are merged so that at most
    ``max_launches`` launches remain (each extra launch costs host time, each doubling of width row work).
    """
    return tuple(row_buckets(_row_limits(nqb, nkt, block_m, block_n, num_queries, num_keys, seg_bound),
                             max_launches))


def row_buckets(limits: list[int], max_launches: int = 2) -> list[tuple[int, int, int]]:
    """Split rows with non-decreasing visible-tile bounds into launches ``(row0, row1, width)``."""
    if not limits:
        return []
    widths = [max(16, pow2(x)) for x in limits]
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
    limits = []
    for i in range(nqb):
        qmax = off + min((i + 1) * block_m, num_queries) - 1
        limits.append(min(nkt, cdiv(((qmax // seg_bound + 1) * seg_bound), block_n)))
    return limits


# ---------------------------------------------------------------------------------------------------------------
# Triton helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """``tl.dot`` at ``dot_precision``; "none" leaves Triton's default (tensor cores for 16-bit operands)."""
    if PREC == "none":
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def split_heads(bh, HEADS, GROUP):
    """(batch, query head, KV head) of a program index over (batch, HEADS query heads), GROUP per KV head."""
    b = bh // HEADS
    h = bh % HEADS
    return b, h, h // GROUP


@triton.jit
def load_head_rows(ptr, b, h, rows, row_mask, d, dmask, stride_b, stride_h, stride_n, stride_d):
    """The (rows, d) tile of batch ``b``, head ``h`` of a (batch, heads, rows, dim) tensor; masked entries 0.
    Offsets in int64: batch x heads x rows x dim exceeds 2^31 at long N."""
    base = ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    return tl.load(base + rows.to(tl.int64)[:, None] * stride_n + d[None, :] * stride_d,
                   mask=row_mask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def query_block_bounds(i, BLOCK, NUM_QUERIES, NUM_KEYS):
    """(earliest, latest) absolute position of query block ``i`` of BLOCK rows; queries are the last NUM_QUERIES
    of NUM_KEYS positions."""
    off = NUM_KEYS - NUM_QUERIES
    return off + i * BLOCK, off + tl.minimum(i * BLOCK + BLOCK, NUM_QUERIES) - 1


@triton.jit
def physical_rows(index_base, rows, stride_index, in_range, num_rows, HAS_INDEX: tl.constexpr):
    """(physical row, valid) of logical ``rows``: through the index at ``index_base`` (entries < 0 are padding)
    or the rows themselves; rows outside ``in_range`` are invalid."""
    if HAS_INDEX:
        phys = tl.load(index_base + rows.to(tl.int64) * stride_index, mask=in_range, other=-1)
        valid = in_range & (phys >= 0) & (phys < num_rows)
    else:
        phys = rows
        valid = in_range
    return phys, valid


@triton.jit
def is_finite(x):
    """Elementwise: neither NaN nor infinite."""
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def tile_limit(qmax, SEGMENT_BOUND, BLOCK_N, NUM_KEY_TILES):
    """Exclusive bound of the logical key tiles that can hold a key visible to absolute position ``qmax``.

    Keys are either in order (SEGMENT_BOUND = 1) or permuted inside segments of SEGMENT_BOUND keys (PBS), so a
    logical key p holds an original position >= (p // SEGMENT_BOUND) * SEGMENT_BOUND.
    """
    lim = (qmax // SEGMENT_BOUND + 1) * SEGMENT_BOUND
    return tl.minimum((lim + BLOCK_N - 1) // BLOCK_N, NUM_KEY_TILES)


@triton.jit
def mix32(x):
    """The lowbias32 finaliser on uint32 (wrapping multiplies): ``kernels.reference.hash32``'s mixing step."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def orderable(x):
    """int32 whose signed order is the float order of x (-0.0 and +0.0 equal)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def row_visibility(j, jin, qmin, qmax, kmin_ptr, kmax_ptr, kpad_ptr, kbase, num_keys,
                   BLOCK_N: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """(visible, partial, kmin) of logical key tiles ``j`` (W,) for query blocks spanning [qmin, qmax] (ROWS,).

    = plan.block_visibility: NONE when the tile's earliest valid key is after qmax, FULL when its latest valid
    key is at or before qmin and it holds no padding, PARTIAL otherwise. Returns (ROWS, W) masks. Without
    positions (keys in order) they follow from the tile index.
    """
    if HAS_POSITIONS:
        kmin = tl.load(kmin_ptr + kbase + j, mask=jin, other=2147483647)
        kmax = tl.load(kmax_ptr + kbase + j, mask=jin, other=-1)
        kpad = tl.load(kpad_ptr + kbase + j, mask=jin, other=1) != 0
    else:
        kmin = j * BLOCK_N
        kmax = tl.minimum(j * BLOCK_N + BLOCK_N, num_keys) - 1
        kpad = j * BLOCK_N + BLOCK_N > num_keys
    vis = jin[None, :] & (kmin[None, :] <= qmax[:, None])
    full = (kmax[None, :] <= qmin[:, None]) & (kpad[None, :] == 0)
    return vis, vis & (full == 0), kmin


@triton.jit
def top_mass(p, cand, T, head):
    """Keep mask of the cumulative-mass rule (``methods.scoring.top_mass``) for each row of (ROWS, W).

    The rule keeps candidate ``j`` (stable descending order) iff the mass before it is below ``T = tau * total``.
    The mass strictly above a value ``x``, ``M(x) = sum(p_i for p_i > x)``, is non-increasing in ``x``, so the kept
    set is ``{p_j > v*}`` plus the first members (in index order) of the tie group ``p_j == v*``, where ``v*`` is
    the smallest value with ``head + M(v*) < T``. Non-negative float32 values are ordered like their bit patterns,
    so ``v*`` is found by a 31-step bisection on the bit pattern (31 row reductions instead of a sort). Equal to
    the sorted rule in exact arithmetic; in floating point only the summation order of the prefix masses differs.
    """
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
def store_plan_rows(keep, part, j, jin, rin, obase, cnt_ptr, msk_ptr, row, NUM_KEY_TILES, BLOCK_N: tl.constexpr,
                    W: tl.constexpr):
    """Write plan rows: kept partial tiles, kept full tiles, then every other tile, each ascending.

    The same complete order as ``plan.plan_from_block_mask`` (so whole tile_offsets rows are identical), built
    with three prefix sums instead of two argsorts. Tiles >= W are invisible by construction of the launch
    buckets; they keep their own position. ``obase`` (ROWS,) row pointers, ``rin`` (ROWS,) live rows.
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
    tl.store(obase[:, None] + pos, (j * BLOCK_N)[None, :] + pos * 0, mask=live)
    for t0 in range(W, NUM_KEY_TILES, W):
        jj = t0 + tl.arange(0, W)
        tl.store(obase[:, None] + jj[None, :], (jj * BLOCK_N)[None, :] + rin[:, None].to(tl.int32) * 0,
                 mask=rin[:, None] & (jj < NUM_KEY_TILES)[None, :])
    tl.store(cnt_ptr + row, n0 + n1, mask=rin)
    tl.store(msk_ptr + row, n0, mask=rin)
