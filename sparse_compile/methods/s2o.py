"""S2O (Zhang et al. 2026). Reorder stage ``s2o``: intra-segment query sort and per-segment ranked causal
prefix (Alg. 1, ``reorder_s2o``). Select stage ``s2o``: S2O's two passes as one plan (Zhang et al. 2026, Sec. 3.2-3.3,
Alg. 2-4).

Needs the ``s2o`` reorder (its ranked key list). For query block i (``block_size_q`` logical rows, all inside
one segment n because S is a multiple of the block):

* Pass 1, dense intra-segment causal window: the tiles of segment n's own keys (original order) that hold a key
  at or before the block's last query position. They are the plan's masked tiles: the kernel applies the causal
  mask (and the -1 padding of a ragged last segment) and early stopping never applies to them.
* Pass 2, coordinate-scheduled prefix: every tile of segment n's ranked causal prefix [0, nS), in ranked order
  (best first). All of them are fully visible (every key < nS <= every query position of the segment).
* Early stop: ``plan.early_stop = tau``, in plan.py's block-level form: stop when g_r < tau * l_r for ALL rows of
  the query block, keeping the tile that triggered it (the paper discards it). tau = 0 never stops: exact dense.

The local dense window W <= S of Alg. 3/4 is taken as W = S (``S2OParams`` has no window parameter). Selection is
thus nothing up front: every causal tile is listed and the kernel decides online how far down the ranked list to
go. Tile tables are per query head (query sorting is per head), (B, Hq, N/bm, <= N/bn + S/bn).

Non-finite inputs (not in the paper; kept confined as in dense attention): the guide key and the segment query means
leave non-finite rows out and a non-finite ranking score ranks first (as +inf, ties by position), so a key whose
scores are not finite is visited before any early stop can pass it, and a NaN query row does not scramble the
rankings (its own segment's rows may stop at other tiles; they stay finite). V is never read to rank. Why W = S,
and the rules in full: docs/methods.md ("`s2o` step by step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..params import MethodParams, block_field, fail, fraction_field, span_field
from ..kernels.reference import segmented_argsort_desc
from ..kernels.validate import cdiv
from ..plan import BlockPlan, execute_plan, runs_on_kernels
from ..registry import DensityKnob, Method, register_method
from ..state import STATE
from .scoring import Reordering, Unsupported, block_mean, chunk_count, compute_dtype, finite_row_mean
from .fast_path import plan_from_tables

__all__ = ["S2OParams", "S2OLayout", "s2o_layout", "s2o_segment_tensors", "planned_segment", "reorder_s2o",
           "select_s2o", "reorder_s2o_fast", "select_s2o_fast", "window_tables"]


@dataclass(frozen=True)
class S2OParams(MethodParams):
    """S2O (Zhang et al. 2026): query sort inside segments, per-segment prefix-key ranking, early stop.

    Defaults from the paper (Sec. 4.1): S=2048, τ=0.005, tiles (128, 128).
    ``early_stop=0.0`` never stops: every causal key is visited. ``segment_size`` <= ``params.MAX_SPAN`` (2**16).
    """

    segment_size: int = 2048
    early_stop: float = 0.005
    block_size_q: int = 128
    block_size_kv: int = 128
    sort_queries: bool = True

    field_checks: ClassVar[dict] = {
        # params.MAX_SPAN: the plans are laid out by whole segments (on a prompt shorter than the segment, by the
        # shortest with the same plans: planned_segment)
        "segment_size": span_field("the queries of a whole segment are pooled and each query block lists "
                                   "segment_size / block_size_kv window tiles, even on a short prompt"),
        "early_stop": fraction_field(), "block_size_q": block_field(), "block_size_kv": block_field()}

    def check_fields(self) -> None:
        for name in ("block_size_q", "block_size_kv"):
            if self.segment_size % getattr(self, name):
                fail("S2OParams", "segment_size", f"must be a multiple of {name}={getattr(self, name)}")


@dataclass(frozen=True)
class S2OLayout:
    """The logical key list of S2O: per segment n, [its own keys, padded to block_n] + [its ranked prefix].

    Pure shape arithmetic (Python ints, no device work), one entry per segment: ``seg_len`` (own keys),
    ``intra_pad`` (own keys rounded up to whole tiles), ``prefix_len`` (= n*S) and ``base`` (offset of the
    segment's part in the list); ``length`` is the list's total length.
    """

    segment: int
    seg_len: tuple[int, ...]
    intra_pad: tuple[int, ...]
    prefix_len: tuple[int, ...]
    base: tuple[int, ...]
    length: int


def s2o_segment_tensors(seg: torch.Tensor, n: int, segment: int, block_n: int):
    """``(base, seg_len, intra_pad)`` of the segments ``seg`` (a device tensor), equal to ``S2OLayout``'s lists.

    Closed forms computed on the device (a host list copied to the GPU could synchronise): only the last segment
    can be short, so every segment before n is full and base[n] = sum_{m<n} (S + mS) = S * n * (n + 1) / 2.
    """
    base = segment * seg * (seg + 1) // 2
    seg_len = torch.clamp(n - seg * segment, max=segment)
    intra_pad = (seg_len + block_n - 1) // block_n * block_n
    return base, seg_len, intra_pad


def s2o_layout(n: int, segment: int, block_n: int) -> S2OLayout:
    g = cdiv(n, segment)
    seg_len = [min(segment, n - i * segment) for i in range(g)]
    intra_pad = [cdiv(x, block_n) * block_n for x in seg_len]
    prefix_len = [i * segment for i in range(g)]
    base, acc = [], 0
    for i in range(g):
        base.append(acc)
        acc += intra_pad[i] + prefix_len[i]
    return S2OLayout(segment, tuple(seg_len), tuple(intra_pad), tuple(prefix_len), tuple(base), acc)


def planned_segment(params: S2OParams, n: int) -> int:
    """The segment S2O's plans of an ``n``-token prompt are laid out with: ``params.segment_size``, or, where that
    is longer than the prompt, the smallest power of two >= n holding whole query and key blocks (never longer than
    the segment asked for).

    A segment at least as long as the prompt is its only segment whatever its length, so the plans are the same:
    every segment of S2O's layout is [its own keys, padded to whole key tiles] + [its causal prefix], and the one
    segment has n own keys and no prefix (the layout's lists, the key list and the tile tables are equal); the
    query sort is a stable sort of the same n scores, the -inf padding after them being either length; the pooled
    segment query means, which alone pool over the whole padded segment, rank the prefixes of later segments and
    there are none. Without the clamp a 200-token prompt with ``segment_size=2**16`` pooled 32 heads of 2**16
    padded query rows (2.9 GB extra on the CPU reference). Powers of two: few distinct segments (kernels compile
    per segment length). ``execute_s2o`` keeps the segment asked for: its window pass's tables (segment / block_kv
    int32 columns per query block: 512 at 2**16 / 128) pick the kernel's schedule by their width.
    """
    segment = params.segment_size
    if segment <= n:
        return segment
    return min(segment, max(1 << (n - 1).bit_length(), params.block_size_q, params.block_size_kv))


def _full_prefill_shape(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """q's shape (B, Hq, N, D); ``Unsupported`` unless N == Nk (the paper's segments describe a full prefill)."""
    if q.shape[2] != k.shape[2]:
        raise Unsupported(f"s2o: needs a full prefill (Nq == Nk), got Nq={q.shape[2]}, Nk={k.shape[2]}")
    return tuple(q.shape)


def _rank_first_if_nonfinite(scores: torch.Tensor) -> torch.Tensor:
    # NaN has no order: a non-finite score ranks first (+inf), ties by position (stable sorts)
    return torch.where(torch.isfinite(scores), scores, torch.full((), float("inf"), dtype=scores.dtype,
                                                                  device=scores.device))


def reorder_s2o(q: torch.Tensor, k: torch.Tensor, scale: float, params) -> Reordering:
    """S2O Algorithm 1 (intra-segment lightweight ranking), laid out as one logical key list for the plan.

    * Segments of S over the sequence; the last one may be shorter (it is treated like the others). S is
      ``planned_segment``: the segment asked for, or a shorter one with the same plans on a shorter prompt.
    * Query permutation (if ``sort_queries``): inside each segment, queries sorted by descending
      <Q[t], k_guide>, k_guide = mean of the first segment's keys (per KV head; Eq. 1). Per query head.
    * Key ranking: segment n's causal prefix [0, nS) sorted by descending <q_mean[n], K[t]> (Eq. 2), q_mean[n]
      the mean query of segment n. GQA choice: one ranking per KV group, using the mean of the group's query
      heads' q_mean (= ranking by the group's mean score). Per query head would multiply the (N/S) x N index
      table by the group size; the group shares K/V loads.
    * Logical key list (``key_index``, int32 (B, Hkv, L), L = sum_n (pad(len_n) + nS) ~ N^2 / 2S): for every
      segment its own keys in original order (padded with -1 to a multiple of block_size_kv), then its ranked
      prefix. The select stage points each query block at its segment's part. Memory O(N^2/S) int32: this is
      the paper's KV_perm table itself; at N=128K, S=2048 about 17 MB per KV head.
    * Non-finite rows are left out of k_guide and q_mean; non-finite scores rank first (module docstring).
    Requires Nq == Nk (the paper's segments describe a full prefill).
    """
    batch, heads_q, n, dim = _full_prefill_shape(q, k)
    heads_kv, S, bn = k.shape[1], planned_segment(params, n), params.block_size_kv
    group = heads_q // heads_kv
    cdt = compute_dtype(q.dtype)
    dev = q.device
    layout = s2o_layout(n, S, bn)
    g = len(layout.seg_len)

    query_index = None
    if params.sort_queries:
        k_guide = finite_row_mean(k[:, :, : layout.seg_len[0]], dim=2)  # (B, Hkv, D)
        s_q = torch.empty(batch, heads_q, n, dtype=cdt, device=dev)
        step = chunk_count(batch * heads_q * dim)
        for r0 in range(0, n, step):  # Q cast chunk by chunk
            r1 = min(r0 + step, n)
            qc = q[:, :, r0:r1].to(cdt).view(batch, heads_kv, group, r1 - r0, dim)
            s_q[:, :, r0:r1] = (qc * k_guide[:, :, None, None, :]).sum(-1).view(batch, heads_q, r1 - r0)
        query_index = segmented_argsort_desc(_rank_first_if_nonfinite(s_q), S, g).to(torch.int32).contiguous()

    # segment query means over finite rows, averaged over the GQA group -> (B, Hkv, g, D)
    base, seg_len, intra_pad = s2o_segment_tensors(torch.arange(g, device=dev), n, S, bn)
    q_mean = block_mean(q, S, dtype=cdt, finite_rows=True).view(batch, heads_kv, group, g, dim).mean(2)

    length = layout.length
    key_index = torch.empty((batch, heads_kv, length), dtype=torch.int32, device=dev)
    kc = k.to(cdt)
    # segments in chunks: the (chunk, prefix) score table is the only large intermediate
    step = chunk_count(batch * heads_kv * n)
    for n0 in range(0, g, step):
        n1 = min(n0 + step, g)
        s0 = layout.base[n0]
        s1 = layout.base[n1] if n1 < g else length
        slots = torch.arange(s0, s1, device=dev)
        seg = torch.searchsorted(base, slots, right=True) - 1
        local = slots - base[seg]
        intra = local < intra_pad[seg]
        own = seg * S + local
        own = torch.where(local < seg_len[seg], own, torch.full_like(own, -1))
        plen = (n1 - 1) * S  # longest prefix in this chunk
        if plen > 0:
            sc = torch.matmul(q_mean[:, :, n0:n1], kc[:, :, :plen].transpose(-1, -2))  # (B, Hkv, c, plen)
            sc = _rank_first_if_nonfinite(sc)
            # rank only the causal prefix [0, nS): later keys get -inf and sort last (stable)
            lim = torch.arange(n0, n1, device=dev)[:, None] * S
            sc = sc.masked_fill(torch.arange(plen, device=dev)[None, :] >= lim, float("-inf"))
            ranked = torch.argsort(sc, dim=-1, descending=True, stable=True)  # (B, Hkv, c, plen)
            rank = (local - intra_pad[seg]).clamp(0, plen - 1)
            flat = (seg - n0) * plen + rank
            pref = torch.gather(ranked.flatten(2), 2, flat.expand(batch, heads_kv, -1))
            vals = torch.where(intra, own.expand(batch, heads_kv, -1), pref)
        else:
            vals = own.expand(batch, heads_kv, -1)
        key_index[:, :, s0:s1] = vals.to(torch.int32)
    return Reordering("s2o", key_index=key_index, query_index=query_index, extras={"layout": layout})


def select_s2o(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    layout = reordering.extras["layout"]
    bm, bn, S = params.block_size_q, params.block_size_kv, layout.segment
    batch, heads_q, n, _ = q.shape
    heads_kv = k.shape[1]
    dev = q.device
    nqb = cdiv(n, bm)
    i = torch.arange(nqb, device=dev)
    seg = i * bm // S
    # last (absolute) query position of each block, after the query permutation
    if reordering.query_index is None:
        qmax = (torch.clamp((i + 1) * bm, max=n) - 1).expand(batch, heads_kv, nqb)
    else:
        qi = torch.nn.functional.pad(reordering.query_index.long(), (0, nqb * bm - n), value=-1)
        qmax = qi.view(batch, heads_q, nqb, bm).amax(-1)
    base, _, intra_pad = s2o_segment_tensors(seg, n, S, bn)
    intra_tiles = intra_pad // bn
    prefix_tiles = seg * S // bn
    # pass-1 tiles: own-segment tiles starting at or before qmax (a prefix of them, in original order)
    n_masked = torch.minimum((qmax - seg * S) // bn + 1, intra_tiles)
    counts = n_masked + prefix_tiles
    width = max(a // bn + b // bn for a, b in zip(layout.intra_pad, layout.prefix_len))
    t = torch.arange(width, device=dev)
    offs = torch.where(
        t < n_masked[..., None],
        base[:, None] + t * bn,  # own keys, original order
        (base + intra_pad)[:, None] + (t - n_masked[..., None]) * bn,  # ranked prefix, best first
    )
    offs = torch.where(t < counts[..., None], offs, torch.zeros_like(offs))
    return BlockPlan(
        block_m=bm,
        block_n=bn,
        tile_offsets=offs.to(torch.int32).contiguous(),
        tile_counts=counts.to(torch.int32).contiguous(),
        masked_counts=n_masked.to(torch.int32).contiguous(),
        key_index=reordering.key_index,
        query_index=reordering.query_index,
        early_stop=float(params.early_stop),
    )


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
@STATE.cached("s2o.width", 64)
def _s2o_width(n: int, segment: int, block_n: int):
    layout = s2o_layout(n, segment, block_n)
    width = max(a // block_n + b // block_n for a, b in zip(layout.intra_pad, layout.prefix_len))
    return layout, width


def reorder_s2o_fast(q: torch.Tensor, k: torch.Tensor, scale: float, params) -> Reordering:
    """= ``reorder_s2o``: query sort inside segments, ranked causal prefixes, the logical key list.

    The layout, the ranking and the key list take ``planned_segment``; the pass over Q keeps the segment asked
    for (its launch shape follows the segment, and with it the order of each row's guide product on the GPU), but
    where that segment is too long to be sorted in its program (``kernels.sorting.MAX_SEGMENT``) the rows are
    sorted apart, over the planned segment: the same stable sort, without a Q-sized padding to the whole
    segment."""
    from ..kernels.pooling import block_pool
    from ..kernels.s2o import s2o_assemble, s2o_rank_keys
    from ..kernels.sorting import MAX_SEGMENT, segmented_argsort_desc as sort_in_segments

    batch, heads_q, n, dim = _full_prefill_shape(q, k)
    heads_kv, S, bn = k.shape[1], planned_segment(params, n), params.block_size_kv
    layout, _ = _s2o_width(n, S, bn)
    g = len(layout.seg_len)
    # k_guide (B, Hkv, D): the first segment's mean finite key (one launch, float32 accumulation)
    guide = None
    if params.sort_queries:
        first = layout.seg_len[0]
        guide = block_pool(k[:, :, :first], first, finite_rows_mean=True).mean[:, :, 0]
    # one pass over Q: per-head segment means (for the key ranking) and <Q[t], k_guide> sorted inside each
    # segment by the same program (the query order), or after it where the segment asked for is longer than a
    # program sorts and the prompt plans a shorter one
    sort_apart = S != params.segment_size and params.segment_size > MAX_SEGMENT
    pool = block_pool(q, params.segment_size, guide=guide, sort_guide=not sort_apart, finite_rows_mean=True)
    query_index = None
    if params.sort_queries:
        query_index = sort_in_segments(pool.guide_score, S, g) if sort_apart else pool.guide_order
    # the GQA group's mean of the segment means, once (averaging inside the ranking kernel re-read every head's
    # means in every program: 0.41 -> 0.58 ms at 128K, docs/kernels.md)
    q_mean = pool.mean.view(batch, heads_kv, heads_q // heads_kv, g, dim).mean(2)
    ranking = s2o_rank_keys(k, q_mean, S)
    key_index = s2o_assemble(ranking, batch, heads_kv, n, S, bn, layout.length)
    return Reordering("s2o", key_index=key_index, query_index=query_index, extras={"layout": layout})


def select_s2o_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    """= ``select_s2o``: intra-segment masked tiles, then the ranked prefix; early stop in the kernel."""
    from ..kernels.s2o import s2o_select

    layout = reordering.extras["layout"]
    batch, heads_q, n, _ = q.shape
    heads_kv = k.shape[1]
    _, width = _s2o_width(n, layout.segment, params.block_size_kv)
    heads = heads_q if reordering.query_index is not None else heads_kv
    tables = s2o_select(reordering.query_index, batch=batch, heads=heads, n=n, segment=layout.segment,
                        block_m=params.block_size_q, block_n=params.block_size_kv, width=width, device=q.device)
    return plan_from_tables(params.block_size_q, params.block_size_kv, tables, reordering,
                            early_stop=float(params.early_stop))


# -- execution: the intra-segment window as its own pass, then the ranked prefix in segment chunks -----------------
#: the longest slice of the ranked key list run at once, in sequence lengths. The kernel reads keys in list order
#: from a permuted copy of K and V; the whole list is ~N^2 / 2S long (17 GiB of copies at 128K), so the plan runs
#: in chunks of whole segments, each over its own slice of the list and K/V cut at the chunk's last position.
LIST_BUDGET = 2
#: a list whose K/V copy fits in this many bytes runs in one piece whatever its length (still O(N): a constant):
#: chunks cost more than their copies (each launch's tail, the short lists of the first segments). H100, S2O at
#: 32K: five chunks ran at 0.62 of the dense kernel per visited tile, one piece at 0.69.
COPY_BYTES_FLOOR = 2 << 30


@STATE.cached("s2o.window_tables", 64)
def window_tables(n: int, segment: int, block_m: int, block_n: int, device: torch.device):
    """(tile_offsets, tile_counts, masked_counts) of the intra-segment causal window in the original query order,
    each (1, 1, blocks, ...): block i (rows r0..r1 of segment s0..) lists the tiles holding a key in (r0, r1]
    (masked) first, then the segment's tiles before them (fully visible to every row)."""
    nqb = cdiv(n, block_m)
    r0 = torch.arange(nqb, device=device) * block_m
    r1 = torch.clamp(r0 + block_m, max=n) - 1
    first = (r0 // segment) * segment // block_n  # the segment's first tile
    masked_from = torch.maximum(first, (r0 + 1) // block_n)  # tiles from here on hold a key after r0
    last = r1 // block_n
    n_masked = last - masked_from + 1
    counts = last - first + 1
    t = torch.arange(segment // block_n, device=device)
    tiles = torch.where(t < n_masked[:, None], masked_from[:, None] + t, first[:, None] + t - n_masked[:, None])
    offsets = torch.where(t < counts[:, None], tiles * block_n, torch.zeros_like(tiles))
    as_table = lambda x: x.to(torch.int32)[None, None].contiguous()  # noqa: E731
    return as_table(offsets), as_table(counts), as_table(n_masked)


def _window_plan(q: torch.Tensor, segment: int, block_m: int, block_n: int) -> BlockPlan:
    """The window pass's plan for q's (batch, query heads): ``window_tables`` expanded with stride 0."""
    batch, heads, n = q.shape[:3]
    tables = [t.expand(batch, heads, *t.shape[2:]) for t in window_tables(n, segment, block_m, block_n, q.device)]
    return BlockPlan(block_m=block_m, block_n=block_n, tile_offsets=tables[0], tile_counts=tables[1],
                     masked_counts=tables[2])


def execute_s2o(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale, params, *,
                kernel: str = "auto", return_visited: bool = False, key_mode: str = "auto", backend: str = "auto",
                kernel_options=None,
                window_pass: bool = True, list_budget: float = LIST_BUDGET, copy_bytes_floor: int = COPY_BYTES_FLOOR):
    """``execute_plan`` for S2O's plans, in O(N) extra memory.

    On the kernels, two passes: the plan's masked tiles are each block's own-segment keys, run as the causal
    triangle of every segment in the original query order (``window_tables``), writing each row's log2-sum-exp2;
    then the ranked-prefix walk (the plan's unmasked tiles, early stop) resumes from that state. Its visited counts
    are the tiles the two passes computed. With sorted queries a block's rows spread over its whole segment, so in
    one pass it would visit the segment's full square of tiles, every score masked by position; the triangle holds
    half of them and almost no masks. Same keys per row, same early-stop rule. ``window_pass=False`` runs the plan
    in one pass, as the reference always does (the spec). ``list_budget`` / ``copy_bytes_floor``: the chunking
    (``LIST_BUDGET``, ``COPY_BYTES_FLOOR``).

    The ranked walk is one call when the kernel reads the ranked keys in place (the Hopper kernel gathers them for
    lists over 4 x N, i.e. from 16K at S=2048: ``kernels.attention.reads_keys_in_place``; ``key_mode="auto"``),
    else segment chunk by segment chunk over permuted K/V copies (``key_mode="copy"`` forces it; same result).
    Segment n's queries are physical rows [nS, (n+1)S) (the query sort stays inside segments) and its keys are
    list entries [base[n], base[n+1]), all physical keys < (n+1)S. So a chunk of segments is a chunked prefill:
    its queries are the last positions of K/V cut at the chunk's end.
    """
    if key_mode not in ("auto", "copy"):
        raise ValueError(f"execute_s2o: key_mode must be 'auto' or 'copy', got {key_mode!r}")
    passes = {}
    window_visits = None
    # a plan cut to a band (``plan.restrict_to_local``) lists band-cut tiles among its masked ones, which the window
    # pass (the segments' whole causal triangles) does not know: it runs in one pass, as the reference does
    if window_pass and runs_on_kernels(q, kernel) and not plan.has_band:
        window = _window_plan(q, params.segment_size, plan.block_m, plan.block_n)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        out = execute_plan(q, k, v, window, scale, kernel=kernel, lse=lse, backend=backend,
                           kernel_options=kernel_options)
        passes = {"out": out, "lse": lse, "resume": True, "skip_masked": True}
        window_visits = window.tile_counts
    result = _ranked_walk(q, k, v, plan, scale, params, kernel, return_visited, key_mode, passes, list_budget,
                          copy_bytes_floor, backend, kernel_options)
    if window_visits is None or not return_visited:
        return result
    out, visited = result
    return out, visited + window_visits


def _ranked_walk(q, k, v, plan: BlockPlan, scale, params, kernel: str, return_visited: bool, key_mode: str,
                 passes: dict, list_budget: float, copy_bytes_floor: int, backend: str, kernel_options=None):
    """The plan (with ``passes``: its unmasked tiles, resumed from the window pass) in one call or segment chunks."""
    if key_mode == "auto" and kernel != "reference" and q.is_cuda and backend != "triton" and not kernel_options:
        from ..kernels.attention import reads_keys_in_place

        if reads_keys_in_place(q, k, v, plan.tile_offsets, block_m=plan.block_m, block_n=plan.block_n,
                               key_index=plan.key_index, query_index=plan.query_index, early_stop=plan.early_stop,
                               pv_skip=plan.pv_skip, window=plan.window, chunk=plan.chunk):
            return execute_plan(q, k, v, plan, scale, kernel=kernel, return_visited=return_visited, backend=backend,
                                kernel_options=kernel_options, **passes)
    n = q.shape[-2]
    copied = "copy" if kernel != "reference" else "auto"  # the kernels read each chunk's keys from a copy
    layout = s2o_layout(n, params.segment_size, plan.block_n)
    segments = len(layout.seg_len)
    ends = list(layout.base[1:]) + [layout.length]
    # one list entry's copy (at least one byte: an empty batch copies nothing)
    row_bytes = max(1, q.shape[0] * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size())
    budget = max(list_budget * n, copy_bytes_floor // row_bytes)
    chunks, start = [], 0
    for last in range(segments):
        if ends[last] - layout.base[start] > budget and last > start:
            chunks.append((start, last))
            start = last
    chunks.append((start, segments))
    if len(chunks) == 1:
        return execute_plan(q, k, v, plan, scale, kernel=kernel, return_visited=return_visited,
                            key_mode=copied, backend=backend, kernel_options=kernel_options, **passes)
    out = passes.get("out")
    if out is None:
        out = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty((*q.shape[:-1], v.shape[-1]))
    visited = None
    if return_visited:
        visited = torch.zeros((q.shape[0], q.shape[1], plan.num_query_blocks), dtype=torch.int32, device=q.device)
    segment = params.segment_size
    for first, stop in chunks:
        row0, row1 = first * segment, min(stop * segment, n)
        block0, block1 = row0 // plan.block_m, cdiv(row1, plan.block_m)
        list0, list1 = layout.base[first], ends[stop - 1]
        offsets = plan.tile_offsets[:, :, block0:block1]
        counts = plan.tile_counts[:, :, block0:block1]
        # listed tiles move to the chunk's slice of the list; unlisted entries (padding, any value) stay in range
        listed = torch.arange(offsets.shape[-1], device=offsets.device) < counts[..., None]
        chunk_plan = BlockPlan(
            block_m=plan.block_m, block_n=plan.block_n,
            tile_offsets=torch.where(listed, offsets - list0, torch.zeros_like(offsets)),
            tile_counts=counts, masked_counts=plan.masked_counts[:, :, block0:block1],
            key_index=plan.key_index[..., list0:list1],
            query_index=None if plan.query_index is None else plan.query_index[..., row0:row1] - row0,
            early_stop=plan.early_stop, pv_skip=plan.pv_skip, window=plan.window, chunk=plan.chunk,
        )
        chunk_passes = {}
        if passes:  # the chunk resumes its own rows, in place
            chunk_passes = dict(passes, out=out[:, :, row0:row1], lse=passes["lse"][:, :, row0:row1])
        result = execute_plan(q[:, :, row0:row1], k[:, :, :row1], v[:, :, :row1], chunk_plan, scale, kernel=kernel,
                              return_visited=return_visited, key_mode=copied, backend=backend,
                              kernel_options=kernel_options, **chunk_passes)
        if return_visited:
            result, visited[:, :, block0:block1] = result
        if not passes:
            out[:, :, row0:row1] = result
    return (out, visited) if return_visited else out


register_method(Method(
    name="s2o", params=S2OParams, reorder=reorder_s2o, select=select_s2o, fast_reorder=reorder_s2o_fast,
    fast_select=select_s2o_fast, execute=execute_s2o, select_after=(),
    density=DensityKnob("early_stop", 0.0, 0.5, higher_keeps_more=False),
    keep_all={"early_stop": 0.0}, description="S2O: query sort, per-segment ranked prefix, early stop in the kernel",
    decided_at_run_time=lambda params: params.early_stop > 0,
))
