"""Packed sequences in one launch: the plans of a varlen call's sequences joined into one ``PackedPlan``.

A packed call (``varlen_attention``, the serving kernel, a packed mask) holds sequences one after another in
q (1, Hq, T_q, D) and k/v (1, Hkv, T_k, D), each causal with its queries at the last positions of its keys. Each
sequence is decided on its own (``pipeline.attend_segments``): a long one by its method's plan, a short one or a
decode token dense, which here means every causal tile. ``pack`` joins them; ``execute_packed`` runs the result in
one launch of the Triton kernel over (plan block, query head), or in the PyTorch reference on the CPU.

The layout (``PackedPlan``), per plan block ``i`` of the joined table:

* ``block_rows[i]`` = (first query row, end of its rows, end of its sequence's keys, offset), packed coordinates,
  int32 on the device: a query at row ``r`` sits at key position ``r + offset`` (``k_end - q_end`` of its
  sequence: the causal diagonal), keys at or past the key end are padding;
* ``tile_offsets[0, h, i]`` (int32, heads Hq or Hkv) lists key tiles by their first packed key row (a method's
  plan shifted by its sequence's first key), ``tile_counts`` / ``masked_counts`` as ``BlockPlan``'s.

A method's exact tail (``BlockPlan.exact_tail``) becomes rows of their own with every causal tile, so nothing runs
after the launch. The blocks are ordered by the keys their last row sees, longest last: the kernel starts the last
blocks first, so long blocks do not trail the launch. What joins (``joinable``): plans in identity order without
early stop, P.V skip or a band, at one block size, with head dim equal to the value dim; the rest runs per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .kernels.validate import SUPPORTED_DTYPES, cdiv, expand_heads
from .plan import BlockPlan, count_exact_tail, reference_tiles

__all__ = ["PackedPlan", "Segment", "joinable", "pack", "execute_packed", "reference_packed_attention",
           "segment_visits"]

# the reference's working set per step (scores of the blocks it takes at once), in elements
_REFERENCE_BUDGET = 1 << 23


@dataclass(frozen=True)
class PackedPlan:
    """One launch's tables over packed sequences (module docstring). ``positions[s]``: the joined blocks that
    the ``s``-th segment given to ``pack`` took from its method's plan (host ints; ``segment_visits``)."""

    block_m: int
    block_n: int
    tile_offsets: torch.Tensor  # int32 (1, Ht, n_blocks, max_tiles), packed key rows
    tile_counts: torch.Tensor  # int32 (1, Ht, n_blocks)
    masked_counts: torch.Tensor  # int32 (1, Ht, n_blocks)
    block_rows: torch.Tensor  # int32 (n_blocks, 4): first row, row end, key end, query-to-key offset
    positions: tuple = ()
    # what reference_tiles reads of a plan: a joined plan has none of these
    early_stop: float = 0.0
    pv_skip: Optional[float] = None
    window: int = 0
    chunk: int = 0
    has_band: bool = False


@dataclass(frozen=True)
class Segment:
    """A sequence of a packed call: query rows ``q0:q1`` at the last positions of keys ``k0:k1``; ``plan`` its
    method's plan, or None for every causal tile (dense)."""

    q0: int
    q1: int
    k0: int
    k1: int
    plan: Optional[BlockPlan] = None


def joinable(plan: BlockPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto") -> bool:
    """Whether a sequence's ``plan`` can run inside a joined launch: identity order, no early stop, P.V skip or band
    (one launch has one of each: a dense sequence beside it would take them too), and, on a GPU with ``backend``
    "auto", a plan the Gluon Hopper kernel would not serve (it takes one sequence per launch, and is the faster
    kernel where it serves)."""
    if (plan.key_index is not None or plan.query_index is not None or plan.early_stop > 0
            or plan.pv_skip is not None or plan.has_band):
        return False
    if not q.is_cuda or backend == "triton":
        return True
    from .kernels.attention import hopper_serves

    return not hopper_serves(q, k, v, plan.tile_offsets, block_m=plan.block_m, block_n=plan.block_n)


def executor(q: torch.Tensor, v: torch.Tensor, kernel: str) -> bool:
    """Whether a packed call on q, v can run joined with ``kernel`` ("triton" / "reference"): the Triton kernel
    takes float16 / bfloat16 (and float32 off the GPU: the interpreter), the reference float64 too; both need the
    value dim equal to the head dim."""
    if v.shape[-1] != q.shape[-1] or q.shape[-1] == 0:
        return False
    if kernel == "triton":
        return q.dtype in SUPPORTED_DTYPES and not (q.is_cuda and q.dtype == torch.float32)
    return q.dtype in SUPPORTED_DTYPES + (torch.float64,)


def pack(segments: Sequence[Segment], heads: int, kv_heads: int, device) -> PackedPlan:
    """Join the segments' plans into one ``PackedPlan`` (module docstring). Every method plan must share one block
    size (``pipeline`` runs the others on their own); dense segments take it, or, with none, 128-key tiles and query
    blocks of the longest segment's queries rounded up to a power of two (16 to 128). Host work is arithmetic on the
    segments' bounds (a few numbers per block); the device builds the dense blocks' tiles and joins them with the
    method plans' tables. No host sync."""
    plans = [s.plan for s in segments if s.plan is not None]
    if plans:
        block_m, block_n = plans[0].block_m, plans[0].block_n
        if any((p.block_m, p.block_n) != (block_m, block_n) for p in plans):
            raise ValueError("packed.pack: the method plans differ in block size")
    else:
        longest = max(s.q1 - s.q0 for s in segments)
        block_m, block_n = min(128, max(16, 1 << (longest - 1).bit_length())), 128
    table_heads = heads if any(p.tile_offsets.shape[1] == heads != kv_heads for p in plans) else kv_heads
    # ranges of rows: (first row, row end, first key, key end, the segment's query end), and the plan or None; a
    # method's exact tail is a dense range of its own after the method's
    ranges, range_plans = [], []
    for n, s in enumerate(segments):
        body = s.q1 if s.plan is None else s.q1 - min(s.plan.exact_tail, s.q1 - s.q0)
        for lo, hi, plan in ((s.q0, body, s.plan), (body, s.q1, None)):
            if hi > lo:
                ranges.append((lo, hi, s.k0, s.k1, s.q1))
                range_plans.append(None if plan is None else (n, plan))
    first, end, k0, k1, q_end = torch.tensor(ranges, dtype=torch.int64).view(-1, 5).unbind(1)
    counts = (end - first + block_m - 1) // block_m
    which = torch.repeat_interleave(torch.arange(len(ranges)), counts)  # each block's range
    step = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    row0 = first[which] + step * block_m
    row_end = torch.minimum(row0 + block_m, end[which])
    offset = (k1 - q_end)[which]
    rows = torch.stack([row0, row_end, k1[which], offset], 1)
    # a block's local key positions run p_lo..p_hi: the tiles up to p_hi's are seen, those wholly at or before
    # p_lo by every row (unmasked); dense blocks list them, masked ones first (as plan.causal_plan)
    p_lo, p_hi = row0 + offset - k0[which], row_end - 1 + offset - k0[which]
    dense = torch.tensor([p is None for p in range_plans], dtype=torch.bool)[which]
    total, full = p_hi // block_n + 1, (p_lo + 1) // block_n
    width = max([int(total[dense].max()) if bool(dense.any()) else 1] + [p.tile_offsets.shape[-1] for p in plans])
    tables = ([], [], [])
    source = torch.nonzero(dense)[:, 0].tolist()  # the block behind each row of the tables, before sorting
    if source:  # built where they run, from four numbers per block
        full_d, total_d, first_d = (x[dense].to(device) for x in (full, total, k0[which]))
        masked = (total_d - full_d)[:, None]
        t = torch.arange(width, device=device)[None, :]
        tile = torch.minimum(torch.where(t < masked, full_d[:, None] + t, t - masked), total_d[:, None] - 1)
        for table, part in zip(tables, (tile * block_n + first_d[:, None], total_d, masked[:, 0])):
            table.append(part.to(torch.int32)[None, None].expand(1, table_heads, *part.shape))
    positions = [[] for _ in segments]
    for r, owner in enumerate(range_plans):
        if owner is None:
            continue
        n, plan = owner
        blocks = int(counts[r])
        offs = expand_heads(plan.tile_offsets[:, :, :blocks], table_heads)
        tables[0].append(torch.nn.functional.pad(offs, (0, width - offs.shape[-1])) + int(k0[r]))
        tables[1].append(expand_heads(plan.tile_counts[:, :, :blocks], table_heads))
        tables[2].append(expand_heads(plan.masked_counts[:, :, :blocks], table_heads))
        positions[n] = torch.nonzero(which == r)[:, 0].tolist()
        source += positions[n]
    # longest last (the kernel starts there): by the keys a block's last row sees
    source = torch.tensor(source, dtype=torch.int64)
    order = torch.argsort(p_hi[source], stable=True)
    where = torch.empty_like(order)
    where[source[order]] = torch.arange(order.numel())  # block -> its row in the sorted tables
    offs, cnt, msk = (torch.cat(t, dim=2).index_select(2, order.to(device)).to(torch.int32).contiguous()
                      for t in tables)
    table = rows[source[order]].to(torch.int32).contiguous()
    return PackedPlan(block_m, block_n, offs, cnt, msk, table.to(device),
                      positions=tuple(tuple(where[mine].tolist()) for mine in positions))


def execute_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedPlan, scale: float, *,
                   kernel: str, out: torch.Tensor, return_visited: bool = False,
                   kernel_options=None) -> Optional[torch.Tensor]:
    """Run ``packed`` on q (1, Hq, T_q, D), k/v (1, Hkv, T_k, D), writing its rows of ``out`` (q's shape and dtype;
    rows in no block are left as they are). ``kernel``: "triton" (one launch) or "reference" (PyTorch). Returns the
    tiles each (query head, block) computed, int32 (1, Hq, n_blocks), with ``return_visited``, else None."""
    if kernel == "triton":
        from .kernels import block_sparse_attention

        result = block_sparse_attention(q, k, v, packed.tile_offsets, packed.tile_counts, packed.masked_counts,
                                        block_m=packed.block_m, block_n=packed.block_n, scale=scale, out=out,
                                        return_visited=return_visited, block_rows=packed.block_rows,
                                        options=kernel_options)
        return result[1] if return_visited else None
    visited = reference_packed_attention(q, k, v, packed, scale, out=out)
    return visited if return_visited else None


def reference_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedPlan, scale: float,
                               *, out: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of a joined launch: ``plan.reference_tiles`` over the packed blocks, as many at a time
    as a bounded working set holds (each block a batch entry), in float32 (float64 kept). Writes ``out``'s rows of
    the blocks; returns the visited tiles, int32 (1, Hq, n_blocks). Reads the tile counts on the host."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    kv_head = torch.arange(heads, device=q.device) // (heads // kv_heads)
    qf, kf, vf = q[0].to(work), k.to(work)[:, kv_head], v.to(work)[:, kv_head]  # (Hq, T_q, D), (1, Hq, T_k, D)
    counts = expand_heads(packed.tile_counts, heads)[0].long().T  # (n_blocks, Hq)
    masked = expand_heads(packed.masked_counts, heads)[0].long().T
    offs = expand_heads(packed.tile_offsets, heads)[0].long().transpose(0, 1)  # (n_blocks, Hq, width)
    rows = packed.block_rows.long()
    blocks, bm = rows.shape[0], packed.block_m
    visited = torch.zeros(blocks, heads, dtype=torch.int32, device=q.device)
    widest = max(int(counts.max()) if counts.numel() else 0, 1)
    step = max(1, _REFERENCE_BUDGET // (heads * bm * widest * packed.block_n))
    for b0 in range(0, blocks, step):
        part = slice(b0, min(b0 + step, blocks))
        tiles = int(counts[part].max())
        if tiles == 0:
            continue
        r = rows[part, :1] + torch.arange(bm, device=q.device)  # (n, bm) packed rows, past the end: none
        ok = r < rows[part, 1:2]
        safe = torch.where(ok, r, rows[part, :1])
        qpos = torch.where(ok, r + rows[part, 3:4], -1)[:, None].expand(-1, heads, -1)  # a row past: sees nothing
        qb = qf[:, safe].transpose(0, 1)  # (n, Hq, bm, D)
        n = qb.shape[0]
        o, visited[part] = reference_tiles(qb, qpos, kf.expand(n, -1, -1, -1), vf.expand(n, -1, -1, -1),
                                           offs[part, :, :tiles], counts[part], masked[part], packed, scale,
                                           length=k.shape[2], key_end=rows[part, 2].view(n, 1, 1, 1))
        out[0][:, safe[ok]] = o.transpose(0, 1)[:, ok].to(out.dtype)
    return visited.T[None].contiguous()


def segment_visits(visited: torch.Tensor, packed: PackedPlan, index: int, plan: BlockPlan, num_queries: int,
                   num_keys: int) -> torch.Tensor:
    """The ``index``-th segment's visited tiles per its own plan's query blocks (1, Hq, blocks), as running
    its plan alone counts them: its blocks' from the joined launch, its exact tail's as every causal tile."""
    mine = torch.tensor(packed.positions[index], dtype=torch.int64, device=visited.device)
    blocks = cdiv(num_queries, plan.block_m)
    out = torch.zeros(*visited.shape[:2], blocks, dtype=visited.dtype, device=visited.device)
    out[..., :mine.numel()] = visited.index_select(2, mine)
    count_exact_tail(out, plan, num_queries, num_keys)
    return out
