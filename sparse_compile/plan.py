"""The block plan: what the sparse FlashAttention core computes, and its pure-PyTorch reference.

Every method ends in a ``BlockPlan``; the Triton kernel (``sparse_compile.kernels``) and
``reference_attention`` below execute it with exactly the same semantics:

* Queries. Logical query row ``r`` of head ``h`` reads physical row ``query_index[b, h, r]`` (identity when
  ``query_index`` is None) and writes its output there. Query block ``i`` is logical rows
  ``[i*block_m, min((i+1)*block_m, Nq))``. A query at physical row ``r`` sits at absolute position
  ``r + Nk - Nq`` (queries are the last ``Nq`` positions: chunked prefill works).
* Keys. Logical key ``p`` reads physical K/V row ``key_index[b, h, p]`` (identity when None). A logical key is
  *padding* when ``p`` is past the end of ``key_index`` (or ``>= Nk`` without one) or its entry is ``< 0``.
* Tiles. Query block ``i`` visits the tiles ``tile_offsets[b, h, i, t]`` for ``t < tile_counts[b, h, i]`` in that
  order; tile ``t`` is the logical keys ``[offset, offset + block_n)``.
* Masking. The first ``masked_counts[b, h, i]`` tiles are masked: padding and keys after the query's
  absolute position are excluded. The remaining tiles are promised fully visible to every query of the
  block (no padding, no future key); the kernel does not mask them. ``check_plan`` verifies the promise.
* Band (``window`` W > 0, ``chunk`` C > 0; ``local.Local``). Masked tiles also exclude key ``j`` (physical row)
  of query ``i`` (absolute position) where ``i - j >= W`` or ``j // C != i // C``; the promise of the unmasked
  tiles then includes the band. ``local_plan`` lists exactly the tiles that meet the band (keep-all inside it:
  exact), ``restrict_to_local`` cuts any plan to it (tiles wholly outside dropped, tiles partly inside masked).
  The exact tail attends to every key its rows see in the band. Density stays a share of the causal tiles.
* Early stop (``early_stop = τ > 0``). After each unmasked tile, with ``g_r`` the tile's contribution to row
  ``r``'s softmax denominator and ``l_r`` the denominator before it (both at the new running maximum), the
  block stops when ``g_r < τ · l_r`` for every query row of the block. The tile that triggers the stop is kept
  (its cost is already paid). Masked tiles are never subject to the stop.
* P·V skip (``pv_skip = λ < 0``). For any tile, a query row with ``rowmax(S_tile) - m_new < λ`` drops its share
  of the tile's P·V (its P row counts as zero there; the denominator is still updated). Per row, so a decision
  never depends on the other rows of the block; V is still read (0 · NaN is NaN, as for masked keys). The
  kernels do not run a skip that cannot show in the output (Nk · e^λ · max|v| under 1/16 of the output dtype's
  epsilon: ``kernels.attention.pv_skip_is_negligible``; bf16 at λ = −20 up to 236K keys); the reference runs it.
* Exact tail (``exact_tail = T > 0``). The last ``T`` physical query rows (the prompt's last positions, whose
  outputs give the logits that generation reads) attend exactly to every key they see, whatever the tables list:
  dense causal attention over all keys, run after the tables. O(T·Nk) work, O(T·D) memory.
* Rows that see no key produce zeros.
* Non-finite values behave as in dense attention: a row whose visited scores include a NaN or an infinity
  outputs non-finite values, and such a row does not keep an early-stop walk going (it is non-finite whatever
  the others do), so rows that see only finite scores are unaffected. A NaN in V reaches
  every row that multiplies it, including rows of its tile that mask it (P = 0, and 0 · NaN is NaN, as in the
  dense kernels); a tile the plan does not list is never read, so non-finite V there goes unseen (no selector
  reads V; the selectors keep every tile whose pooled keys are not finite).

Head dimensions: ``tile_*`` and index tensors have ``Hq`` heads or ``Hkv`` heads; with ``Hkv`` the query heads of
a GQA group share the entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .kernels.reference import band_start, in_band
from .kernels.validate import SUPPORTED_DTYPES, cdiv, expand_heads, validate_qkv
from .state import STATE

__all__ = [
    "BlockPlan",
    "execute_plan",
    "runs_on_kernels",
    "plan_density",
    "reference_attention",
    "reference_tiles",
    "check_plan",
    "plan_from_block_mask",
    "causal_plan",
    "local_plan",
    "restrict_to_local",
    "local_tiles_per_block",
    "block_visibility",
    "causal_tile_count",
    "tail_blocks",
    "causal_tiles_per_block",
    "apply_exact_tail",
    "count_exact_tail",
    "VISIBLE_NONE",
    "VISIBLE_PARTIAL",
    "VISIBLE_FULL",
]

VISIBLE_NONE, VISIBLE_PARTIAL, VISIBLE_FULL = 0, 1, 2

# the PyTorch reference also runs float64 (exact comparisons in tests); the kernels run SUPPORTED_DTYPES
_REFERENCE_DTYPES = SUPPORTED_DTYPES + (torch.float64,)


@dataclass(frozen=True)
class BlockPlan:
    block_m: int
    block_n: int
    tile_offsets: torch.Tensor  # int32 (B, Ht, n_query_blocks, max_tiles)
    tile_counts: torch.Tensor  # int32 (B, Ht, n_query_blocks)
    masked_counts: torch.Tensor  # int32 (B, Ht, n_query_blocks)
    key_index: Optional[torch.Tensor] = None  # int32 (B, Hk, Lk)
    query_index: Optional[torch.Tensor] = None  # int32 (B, Hq', Nq)
    early_stop: float = 0.0
    pv_skip: Optional[float] = None
    exact_tail: int = 0  # the last query rows computed exactly (module docstring)
    window: int = 0  # sliding window applied in masked tiles (0: none; module docstring)
    chunk: int = 0  # chunked local attention applied in masked tiles (0: none)

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BlockPlan.{name}: must be an int >= 0 (0: none), got {value!r}")

    @property
    def has_band(self) -> bool:
        """A sliding window or chunks beyond causal."""
        return self.window > 0 or self.chunk > 0

    @property
    def num_query_blocks(self) -> int:
        return self.tile_offsets.shape[2]

    def with_options(self, **kwargs) -> "BlockPlan":
        return replace(self, **kwargs)

    def density(self, num_queries: int, num_keys: int, num_heads: Optional[int] = None) -> torch.Tensor:
        """Fraction of the causal tiles the plan lists, per (batch, head): float32 (B, H). See ``plan_density``."""
        return plan_density(self, num_queries, num_keys, num_heads)

    def __repr__(self) -> str:
        batch, heads, blocks, width = self.tile_offsets.shape
        listed = int(self.tile_counts.sum()) if self.tile_counts.numel() else 0
        parts = [f"{self.block_m}x{self.block_n} tiles", f"batch {batch}", f"{heads} heads", f"{blocks} query blocks",
                 f"{listed} tiles listed (at most {width} per block)"]
        if self.key_index is not None:
            parts.append(f"keys permuted (logical length {self.key_index.shape[-1]})")
        if self.query_index is not None:
            parts.append("queries permuted")
        if self.early_stop > 0:
            parts.append(f"early stop {self.early_stop:g}")
        if self.pv_skip is not None:
            parts.append(f"P.V skip {self.pv_skip:g}")
        if self.exact_tail > 0:
            parts.append(f"last {self.exact_tail} query rows exact")
        if self.window > 0:
            parts.append(f"sliding window {self.window}")
        if self.chunk > 0:
            parts.append(f"chunks of {self.chunk}")
        return f"BlockPlan({', '.join(parts)})"


def _positions(index: Optional[torch.Tensor], length: int, batch: int, heads: int, device) -> torch.Tensor:
    if index is None:
        return torch.arange(length, device=device).expand(batch, heads, length)
    return index.long()


def _query_block_bounds(qpos: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max absolute query position of each query block: ``(B, H, n_query_blocks)`` each."""
    batch, heads, n = qpos.shape
    nqb = cdiv(n, block_m)
    pad = nqb * block_m - n
    qmin = torch.nn.functional.pad(qpos, (0, pad), value=2**62).view(batch, heads, nqb, block_m).amin(-1)
    qmax = torch.nn.functional.pad(qpos, (0, pad), value=-1).view(batch, heads, nqb, block_m).amax(-1)
    return qmin, qmax


def _physical_keys(key_index: Optional[torch.Tensor], logical: torch.Tensor, length: int) -> torch.Tensor:
    """Physical K/V rows of logical key positions ``(B, H, ...)``; -1 past the end of ``key_index``."""
    if key_index is None:
        return logical
    phys = torch.gather(key_index.long(), 2, logical.clamp(max=length - 1).flatten(2)).view(logical.shape)
    return torch.where(logical < length, phys, torch.full_like(phys, -1))


def block_visibility(
    num_queries: int,
    num_keys: int,
    block_m: int,
    block_n: int,
    *,
    key_index: Optional[torch.Tensor] = None,
    query_index: Optional[torch.Tensor] = None,
    batch: int = 1,
    heads: int = 1,
    device=None,
    window: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """Visibility class of each (query block, key tile) in logical order: NONE, PARTIAL or FULL.

    Returns int8 ``(B, H, n_query_blocks, n_key_tiles)`` where ``H`` is the larger head count of the two indices
    (or ``heads``). A block-level table: O((N/block)^2) memory, never N×N. ``window`` / ``chunk``: the band
    (module docstring) on top of causal; NONE is then exact for contiguous blocks and tiles (identity order) and
    conservative (a tile may read PARTIAL yet hold no visible pair) under permutations.
    """
    if key_index is not None:
        batch, device = key_index.shape[0], key_index.device
    if query_index is not None:
        batch, device = query_index.shape[0], query_index.device
    hk = key_index.shape[1] if key_index is not None else 1
    hq = query_index.shape[1] if query_index is not None else 1
    h = max(hk, hq, 1) if (key_index is not None or query_index is not None) else heads
    if key_index is not None and query_index is not None and h % min(hk, hq):
        raise ValueError("key_index and query_index head counts are incompatible")
    offset = num_keys - num_queries
    # query blocks: min/max absolute position
    qmin, qmax = _query_block_bounds(_positions(query_index, num_queries, batch, hq, device) + offset, block_m)
    # key tiles: min/max valid position, and whether the tile holds padding
    length = key_index.shape[-1] if key_index is not None else num_keys
    kpos = _positions(key_index, length, batch, hk, device)
    nkt = cdiv(length, block_n)
    pad_k = nkt * block_n - length
    kpos_p = torch.nn.functional.pad(kpos, (0, pad_k), value=-1).view(batch, kpos.shape[1], nkt, block_n)
    valid = (kpos_p >= 0) & (kpos_p < num_keys)
    kmin = torch.where(valid, kpos_p, torch.full_like(kpos_p, 2**62)).amin(-1)
    kmax = torch.where(valid, kpos_p, torch.full_like(kpos_p, -1)).amax(-1)
    has_pad = ~valid.all(-1)
    qmin, qmax = expand_heads(qmin, h), expand_heads(qmax, h)
    kmin, kmax, has_pad = expand_heads(kmin, h), expand_heads(kmax, h), expand_heads(has_pad, h)
    none, full = _band_classes(qmin[:, :, :, None], qmax[:, :, :, None], kmin[:, :, None, :], kmax[:, :, None, :],
                               has_pad[:, :, None, :], window, chunk)
    vis = torch.full(none.shape, VISIBLE_PARTIAL, dtype=torch.int8, device=none.device)
    vis[full] = VISIBLE_FULL
    vis[none] = VISIBLE_NONE
    return vis


def _band_classes(qmin, qmax, kmin, kmax, has_pad, window: int, chunk: int):
    """(none, full) of tiles with valid key positions in [kmin, kmax] against query blocks with positions in
    [qmin, qmax] (broadcast together). A query ``i`` sees the keys ``[band_start(i), i]``: a pair is visible only if
    ``i* = max(qmin, kmin) <= qmax`` and ``band_start(i*) <= kmax`` (exact when both position sets are
    contiguous); every pair is visible iff ``kmax <= qmin`` and ``band_start(qmax) <= kmin`` (and no padding)."""
    none = kmin > qmax
    full = (kmax <= qmin) & ~has_pad
    if window > 0 or chunk > 0:
        first = torch.maximum(qmin, kmin)
        none = none | (band_start(first, window, chunk) > kmax)
        full = full & (band_start(qmax, window, chunk) <= kmin)
    return none, full


def plan_from_block_mask(
    keep: torch.Tensor,
    visibility: torch.Tensor,
    block_m: int,
    block_n: int,
    *,
    key_index: Optional[torch.Tensor] = None,
    query_index: Optional[torch.Tensor] = None,
    order_scores: Optional[torch.Tensor] = None,
    early_stop: float = 0.0,
    pv_skip: Optional[float] = None,
    exact_tail: int = 0,
    window: int = 0,
    chunk: int = 0,
) -> BlockPlan:
    """Turn a boolean block mask ``(B, H, n_query_blocks, n_key_tiles)`` into a ``BlockPlan``.

    Invisible tiles are dropped; partially visible tiles go first (masked), then fully visible ones, each group
    in ascending tile order, or by descending ``order_scores`` when given (same shape as ``keep``).
    ``window`` / ``chunk``: the band the plan's masked tiles apply; ``visibility`` must have been computed with it
    (``block_visibility(..., window=, chunk=)``).
    """
    keep = keep & (visibility != VISIBLE_NONE)
    partial = keep & (visibility == VISIBLE_PARTIAL)
    n_tiles = keep.shape[-1]
    # two stable sorts, no host sync: by score (or tile id), then by group (partial, full, dropped)
    if order_scores is None:
        order = torch.arange(n_tiles, device=keep.device).expand_as(keep)
    else:
        order = torch.argsort(order_scores.float(), dim=-1, descending=True, stable=True)
    group = torch.where(partial, 0, torch.where(keep, 1, 2)).to(torch.int8)
    regroup = torch.argsort(torch.gather(group, -1, order), dim=-1, stable=True)
    order = torch.gather(order, -1, regroup)
    counts = keep.sum(-1, dtype=torch.int32)
    masked = partial.sum(-1, dtype=torch.int32)
    offsets = (order * block_n).to(torch.int32).contiguous()
    return BlockPlan(
        block_m=block_m,
        block_n=block_n,
        tile_offsets=offsets,
        tile_counts=counts.contiguous(),
        masked_counts=masked.contiguous(),
        key_index=key_index,
        query_index=query_index,
        early_stop=early_stop,
        pv_skip=pv_skip,
        exact_tail=exact_tail,
        window=window,
        chunk=chunk,
    )


def causal_plan(
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    block_m: int = 128,
    block_n: int = 128,
    device=None,
) -> BlockPlan:
    """Every causal tile, diagonal tiles masked: with it the core computes dense causal attention."""
    vis = block_visibility(num_queries, num_keys, block_m, block_n, batch=batch, heads=heads, device=device)
    return plan_from_block_mask(torch.ones_like(vis, dtype=torch.bool), vis, block_m, block_n)


def _check_band(who: str, window, chunk) -> None:
    for name, value in (("window", window), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{who}: {name} must be an int >= 0 (0: none), got {value!r}")


def _band_ranges(num_queries: int, num_keys: int, block_m: int, block_n: int, window: int, chunk: int):
    """Per query block (identity order, CPU int64): the first and last key tile that meets the band and the first
    and last tile wholly inside it for every row (``f_lo > f_hi``: none). A query ``i`` sees keys
    ``[band_start(i), i]``; over a block's rows ``p0..p1`` those are ``[band_start(p0), p1]`` (every key there is
    seen by some row), and a tile ``[a, a + block_n)`` is seen whole by every row iff ``band_start(p1) <= a`` and
    ``a + block_n - 1 <= p0``."""
    offset = num_keys - num_queries
    r0 = torch.arange(cdiv(num_queries, block_m), dtype=torch.int64) * block_m
    p0 = r0 + offset
    p1 = torch.clamp(r0 + block_m, max=num_queries) - 1 + offset
    t_lo = band_start(p0, window, chunk) // block_n
    t_hi = p1 // block_n
    f_lo = -(-band_start(p1, window, chunk) // block_n)
    f_hi = (p0 + 1) // block_n - 1
    return t_lo, t_hi, f_lo, f_hi


@STATE.cached("plan.band_tables", 64)
def _band_tables(num_queries: int, num_keys: int, block_m: int, block_n: int, window: int, chunk: int,
                 device: torch.device):
    """(tile_offsets, tile_counts, masked_counts) of ``local_plan``, each (1, 1, blocks, ...): per block the tiles
    partly inside the band (below the whole ones, then above: ascending), then the whole ones (ascending)."""
    t_lo, t_hi, f_lo, f_hi = _band_ranges(num_queries, num_keys, block_m, block_n, window, chunk)
    count = t_hi - t_lo + 1
    whole = f_lo <= f_hi
    low = torch.where(whole, f_lo - t_lo, count)  # partial tiles below the whole ones (all of them when none is)
    high = torch.where(whole, t_hi - f_hi, torch.zeros_like(count))
    width = max(int(count.max()) if count.numel() else 0, 1)
    s = torch.arange(width, dtype=torch.int64)[None, :]
    low, high, count = low[:, None], high[:, None], count[:, None]
    tiles = torch.where(s < low, t_lo[:, None] + s,
                        torch.where(s < low + high, f_hi[:, None] + 1 + (s - low), f_lo[:, None] + (s - low - high)))
    offsets = torch.where(s < count, tiles * block_n, torch.zeros_like(tiles))
    as_table = lambda x: x.to(torch.int32)[None, None].contiguous().to(device)  # noqa: E731
    return as_table(offsets), as_table(count[:, 0]), as_table((low + high)[:, 0])


def local_plan(
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    block_m: int = 128,
    block_n: int = 128,
    device=None,
    *,
    window: int = 0,
    chunk: int = 0,
) -> BlockPlan:
    """Every tile that meets the band (module docstring), nothing else: tiles partly inside masked, tiles wholly
    outside never listed; with it the core computes dense attention restricted to the band. ``window=chunk=0``:
    ``causal_plan``'s tiles. Tables from the shapes alone (no host sync), shared by every (batch, head) with stride
    0; O(blocks x band tiles) memory, never the full tile grid."""
    _check_band("local_plan", window, chunk)
    device = torch.device(device) if device is not None else torch.device("cpu")
    tables = [t.expand(batch, heads, *t.shape[2:])
              for t in _band_tables(num_queries, num_keys, block_m, block_n, window, chunk, device)]
    return BlockPlan(block_m=block_m, block_n=block_n, tile_offsets=tables[0], tile_counts=tables[1],
                     masked_counts=tables[2], window=window, chunk=chunk)


def local_tiles_per_block(blocks: int, num_queries: int, num_keys: int, block_m: int, block_n: int, window: int = 0,
                          chunk: int = 0) -> torch.Tensor:
    """int64 (blocks,): the key tiles that meet the band for each query block (identity order): what dense
    attention restricted to the band computes (``causal_tiles_per_block`` without a band)."""
    if window <= 0 and chunk <= 0:
        return causal_tiles_per_block(blocks, num_queries, num_keys, block_m, block_n)
    t_lo, t_hi, _, _ = _band_ranges(num_queries, num_keys, block_m, block_n, window, chunk)
    counts = t_hi - t_lo + 1
    return torch.nn.functional.pad(counts, (0, max(blocks - counts.numel(), 0)))[:blocks]


def _window_extremes(values: torch.Tensor, width: int, reduce, fill: int) -> torch.Tensor:
    """``reduce`` (torch.minimum / torch.maximum) of ``values[..., p : p + width]`` for every start ``p`` of the last
    dim, entries past its end reading ``fill``: a sparse table, O(L log width) work, O(L) memory."""
    level, span = values, 1
    while span * 2 <= width:
        level = reduce(level, torch.nn.functional.pad(level[..., span:], (0, span), value=fill))
        span *= 2
    if span == width:
        return level
    return reduce(level, torch.nn.functional.pad(level[..., width - span:], (0, width - span), value=fill))


def restrict_to_local(plan: BlockPlan, num_queries: int, num_keys: int, *, window: int = 0,
                      chunk: int = 0) -> BlockPlan:
    """``plan`` cut to the band (module docstring): its own choices inside the band, in its order. A listed tile
    with no visible pair is dropped, an unmasked one that the band cuts moves to the masked tiles (after the
    plan's own masked ones, so that an early stop never decides on it), and the plan carries ``window`` /
    ``chunk`` for the kernels' masked tiles and its exact tail. Exact for contiguous positions; under a key or
    query permutation a tile is kept whenever the bounds of its positions allow a visible pair. No host sync;
    O(tables) memory plus O(key_index) for the key permutation's tile bounds."""
    _check_band("restrict_to_local", window, chunk)
    if window <= 0 and chunk <= 0:
        return plan
    if plan.has_band and (plan.window, plan.chunk) != (window, chunk):
        raise ValueError(f"restrict_to_local: the plan already carries window={plan.window}, chunk={plan.chunk}; "
                         f"asked for window={window}, chunk={chunk}")
    offs = plan.tile_offsets
    dev = offs.device
    batch = offs.shape[0]
    heads = max([offs.shape[1]] + [x.shape[1] for x in (plan.key_index, plan.query_index) if x is not None])
    offs = expand_heads(offs, heads).long()
    counts = expand_heads(plan.tile_counts, heads).long()
    masked = expand_heads(plan.masked_counts, heads).long()
    qpos = _positions(expand_heads(plan.query_index, heads), num_queries, batch, heads, dev) + (num_keys - num_queries)
    qmin, qmax = _query_block_bounds(qpos, plan.block_m)
    big = 2**62
    bn = plan.block_n
    if plan.key_index is None:
        kmin = torch.where(offs < num_keys, offs, torch.full_like(offs, big))
        kmax = torch.clamp(offs + bn, max=num_keys) - 1
        has_pad = offs + bn > num_keys
    else:
        ki = plan.key_index.long()
        if ki.shape[-1] == 0:  # no logical key at all: nothing visible
            ki = torch.full((*ki.shape[:2], 1), -1, dtype=torch.int64, device=dev)
        valid = (ki >= 0) & (ki < num_keys)
        # extremes of every window of block_n logical keys (past the index: padding), read at the listed offsets
        lo = _window_extremes(torch.where(valid, ki, torch.full_like(ki, big)), bn, torch.minimum, big)
        hi = _window_extremes(torch.where(valid, ki, torch.full_like(ki, -1)), bn, torch.maximum, -1)
        pad = _window_extremes((~valid).to(torch.int8), bn, torch.maximum, 1)
        at = offs.clamp(0, ki.shape[-1] - 1).flatten(2)
        pick = lambda t: torch.gather(expand_heads(t, heads), 2, at).view(offs.shape)  # noqa: E731
        kmin, kmax, has_pad = pick(lo), pick(hi), pick(pad).bool()
        beyond = offs >= ki.shape[-1]  # wholly past the index: padding only
        kmin = torch.where(beyond, torch.full_like(kmin, big), kmin)
        kmax = torch.where(beyond, torch.full_like(kmax, -1), kmax)
    none, full = _band_classes(qmin[..., None], qmax[..., None], kmin, kmax, has_pad, window, chunk)
    t = torch.arange(offs.shape[-1], device=dev)
    live = (t < counts[..., None]) & ~none
    was_masked = t < masked[..., None]
    # the plan's masked tiles, then its unmasked ones the band cuts, then the whole ones; the rest dropped
    group = torch.where(~live, 3, torch.where(was_masked, 0, torch.where(full, 2, 1))).to(torch.int8)
    order = torch.argsort(group, dim=-1, stable=True)
    new_offsets = torch.gather(expand_heads(plan.tile_offsets, heads), -1, order)
    group = torch.gather(group, -1, order)
    new_offsets = torch.where(group < 3, new_offsets, torch.zeros_like(new_offsets)).contiguous()
    return replace(plan, tile_offsets=new_offsets, tile_counts=(group < 3).sum(-1, dtype=torch.int32).contiguous(),
                   masked_counts=(group < 2).sum(-1, dtype=torch.int32).contiguous(), window=window, chunk=chunk)


@STATE.cached("plan.causal_tile_count", 256)  # asked on every planned call: a loop over query blocks
def causal_tile_count(num_queries: int, num_keys: int, block_m: int, block_n: int) -> int:
    """Number of (query block, key tile) pairs with at least one visible key, in the identity order."""
    offset = num_keys - num_queries
    nqb = cdiv(num_queries, block_m)
    total = 0
    for i in range(nqb):
        last = min((i + 1) * block_m, num_queries) - 1 + offset
        total += min(last // block_n + 1, cdiv(num_keys, block_n)) if last >= 0 else 0
    return total


def causal_tiles_per_block(blocks: int, num_queries: int, num_keys: int, block_m: int, block_n: int) -> torch.Tensor:
    """int64 (blocks,): the key tiles dense causal attention computes for each query block (identity order)."""
    offset = num_keys - num_queries
    last = torch.clamp((torch.arange(blocks) + 1) * block_m, max=num_queries) - 1 + offset
    counts = torch.clamp(last // block_n + 1, max=-(-num_keys // block_n))
    return torch.where(last >= 0, counts, torch.zeros_like(counts))


def plan_density(plan: BlockPlan, num_queries: int, num_keys: int, num_heads: Optional[int] = None) -> torch.Tensor:
    """Fraction of the causal tiles that ``plan`` lists, per (batch, query head): float32 (B, H).

    The denominator is ``causal_tile_count`` (identity tiling at the plan's block sizes). H is ``num_heads`` if
    given, else the largest head count among the plan's tensors (a per-KV-head plan gives Hkv columns unless
    ``num_heads`` is passed). The numerator counts listed tiles: with early stopping (S2O) it is an upper bound
    (the stop happens at run time; ``execute_plan(..., return_visited=True)`` counts visited tiles). A plan can
    exceed 1: under a key permutation (PBS) or S2O's query sort, the on-diagonal segment is computed as a full
    square of tiles rather than a triangle. A banded plan (``window`` / ``chunk``) is counted against the causal
    tiles too, its exact tail's blocks as the tiles that meet the band.
    """
    heads = num_heads
    if heads is None:
        heads = max(x.shape[1] for x in (plan.tile_counts, plan.key_index, plan.query_index) if x is not None)
    counts = expand_heads(plan.tile_counts, heads)
    tail = tail_blocks(plan, num_queries)
    if tail:  # the exact tail's blocks cost what dense attention (in the band, if any) computes for them
        causal = local_tiles_per_block(counts.shape[-1], num_queries, num_keys, plan.block_m, plan.block_n,
                                       plan.window, plan.chunk)
        counts = torch.cat([counts[..., :-tail], causal[-tail:].to(counts.device, counts.dtype)
                            .expand(*counts.shape[:-1], tail)], dim=-1)
    total = causal_tile_count(num_queries, num_keys, plan.block_m, plan.block_n)
    return counts.sum(-1, dtype=torch.int64).to(torch.float32) / max(total, 1)


def tail_blocks(plan: BlockPlan, num_queries: int) -> int:
    """How many of the last query blocks (identity order) hold rows of the plan's exact tail."""
    if plan.exact_tail <= 0 or num_queries <= 0:
        return 0
    first_row = max(num_queries - plan.exact_tail, 0)
    return cdiv(num_queries, plan.block_m) - first_row // plan.block_m


def apply_exact_tail(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                     scale: Optional[float], visited: Optional[torch.Tensor] = None):
    """The plan's exact tail written over ``out`` (module docstring); ``visited`` (per query block) then counts
    the tail's blocks as every causal tile (identity order: what dense attention computes for them), or every
    tile that meets the plan's band."""
    rows = min(plan.exact_tail, q.shape[-2])
    if rows <= 0:
        return out, visited
    q_tail = q[:, :, -rows:]
    num_keys = k.shape[-2]
    if q.is_cuda:  # the fused SDPA kernels mask by assignment: a non-finite key a row does not see stays unseen
        from .dense import dense_attention, dense_causal_attention

        if plan.has_band:  # the band as an explicit mask of the tail's rows: O(rows x Nk), rows are few
            positions = torch.arange(num_keys, device=q.device)
            seen = (positions[-rows:, None] >= positions[None, :]) & in_band(
                positions[-rows:, None], positions[None, :], plan.window, plan.chunk)
            tail = dense_attention(q_tail, k, v, is_causal=False, scale=scale, attn_mask=seen,
                                   enable_gqa=q.shape[1] != k.shape[1])
        else:
            tail = dense_causal_attention(q_tail, k, v, scale=scale)
    else:  # PyTorch's CPU path adds the mask as a bias, and NaN - inf is NaN: the reference masks exactly
        tail = reference_attention(q_tail, k, v, local_plan(q.shape[0], q.shape[1], rows, num_keys, plan.block_m,
                                                            plan.block_n, device=q.device, window=plan.window,
                                                            chunk=plan.chunk), scale)
    out[:, :, -rows:] = tail.to(out.dtype)
    if visited is not None:
        count_exact_tail(visited, plan, q.shape[-2], num_keys)
    return out, visited


def count_exact_tail(visited: torch.Tensor, plan: BlockPlan, num_queries: int, num_keys: int) -> None:
    """Count the exact tail's blocks in ``visited`` (per query block, in place) as every tile dense attention (in
    the band, if any) computes for them."""
    tail = tail_blocks(plan, num_queries)
    if tail:
        causal = local_tiles_per_block(visited.shape[-1], num_queries, num_keys, plan.block_m, plan.block_n,
                                       plan.window, plan.chunk)
        visited[..., -tail:] = causal[-tail:].to(visited.device, visited.dtype)


def runs_on_kernels(q: torch.Tensor, kernel: str) -> bool:
    """Whether ``execute_plan(..., kernel=kernel)`` runs the kernels (not the PyTorch reference) for ``q``."""
    return kernel == "triton" or (kernel == "auto" and q.is_cuda)


def execute_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: Optional[float] = None,
                 *, kernel: str = "auto", return_visited: bool = False, check: bool = False,
                 key_mode: str = "auto", config=None, out=None, lse=None, resume: bool = False,
                 skip_masked: bool = False, backend: str = "auto", kernel_options=None):
    """Run ``plan`` on q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D): the one place that picks the executor.

    ``kernel``: "triton" (the Triton kernel: CUDA, or the CPU under ``TRITON_INTERPRET=1``), "reference"
    (``reference_attention``, pure PyTorch) or "auto" (Triton for CUDA inputs, the reference otherwise).
    ``check=True`` runs ``check_plan`` first (host syncs). ``key_mode`` and ``config`` (a
    ``sparse_compile.kernels.KernelConfig``) go to the Triton kernel; ``backend`` to the kernels ("auto": the Gluon
    Hopper kernel where it serves the call; "triton": the Triton kernel only), ``kernel_options`` (launch
    parameters over the Triton kernel's own choice: ``kernels.validate.KERNEL_OPTIONS``) too. Returns the output,
    and with ``return_visited`` also the tiles each (batch, query head, query block) computed, int32.
    ``out`` / ``lse`` / ``resume`` / ``skip_masked`` run a plan as the second of two passes over one softmax
    (``kernels.block_sparse_attention`` documents them); the kernels only: the reference runs a plan in one pass.
    """
    if kernel not in ("auto", "triton", "reference"):
        raise ValueError(f"execute_plan: kernel must be 'auto', 'triton' or 'reference', got {kernel!r}")
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"execute_plan: plan must be a sparse_compile.plan.BlockPlan, got {type(plan).__name__}")
    if check:
        check_plan(plan, q, k)
    if runs_on_kernels(q, kernel):
        from .kernels import block_sparse_attention

        result = block_sparse_attention(
            q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts, block_m=plan.block_m,
            block_n=plan.block_n, key_index=plan.key_index, query_index=plan.query_index, scale=scale,
            early_stop=plan.early_stop, pv_skip=plan.pv_skip, return_visited=return_visited, key_mode=key_mode,
            config=config, out=out, lse=lse, resume=resume, skip_masked=skip_masked, window=plan.window,
            chunk=plan.chunk, backend=backend, options=kernel_options)
        if plan.exact_tail <= 0:
            return result
        if lse is not None or resume:
            raise ValueError("execute_plan: a plan with an exact tail runs in one pass (no lse= or resume=)")
        output, visited = result if return_visited else (result, None)
        output, visited = apply_exact_tail(output, q, k, v, plan, scale, visited)
        return (output, visited) if return_visited else output
    if out is not None or lse is not None or resume or skip_masked:
        raise ValueError("execute_plan: out=, lse=, resume= and skip_masked= need a kernel (kernel='triton' or "
                         "CUDA inputs); the reference runs a plan in one pass")
    return reference_attention(q, k, v, plan, scale, return_visited=return_visited)


def check_plan(plan: BlockPlan, q: torch.Tensor, k: torch.Tensor) -> None:
    """Validate a plan against its inputs; raises ValueError naming the first problem. Syncs with the host."""
    validate_qkv(q, k, k, who="check_plan", dtypes=_REFERENCE_DTYPES)
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqb = cdiv(Nq, plan.block_m)
    for name in ("tile_offsets", "tile_counts", "masked_counts"):
        t = getattr(plan, name)
        if t.dtype != torch.int32:
            raise ValueError(f"plan.{name}: must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"plan.{name}: on {t.device}, inputs on {q.device}")
        if t.shape[0] != B or t.shape[1] not in (Hq, Hkv) or t.shape[2] != nqb:
            raise ValueError(f"plan.{name}: shape {tuple(t.shape)} does not match (B={B}, H in ({Hq}, {Hkv}), "
                             f"{nqb} query blocks)")
    if plan.tile_counts.shape != plan.masked_counts.shape or plan.tile_counts.shape != plan.tile_offsets.shape[:3]:
        raise ValueError("plan: tile_counts, masked_counts and tile_offsets disagree in shape")
    max_tiles = plan.tile_offsets.shape[-1]
    if bool((plan.tile_counts < 0).any()) or bool((plan.tile_counts > max_tiles).any()):
        raise ValueError(f"plan.tile_counts: must lie in [0, {max_tiles}]")
    if bool((plan.masked_counts < 0).any()) or bool((plan.masked_counts > plan.tile_counts).any()):
        raise ValueError("plan.masked_counts: must lie in [0, tile_counts]")
    length = Nk
    if plan.key_index is not None:
        ki = plan.key_index
        if ki.dtype != torch.int32 or ki.dim() != 3 or ki.shape[0] != B or ki.shape[1] not in (Hq, Hkv):
            raise ValueError(f"plan.key_index: must be int32 (B, Hq or Hkv, L), got {ki.dtype} {tuple(ki.shape)}")
        if bool((ki >= Nk).any()):
            raise ValueError(f"plan.key_index: entries must be < Nk={Nk} (negative entries mark padding)")
        length = ki.shape[-1]
    if plan.query_index is not None:
        qi = plan.query_index
        if qi.dtype != torch.int32 or qi.shape[0] != B or qi.shape[1] not in (Hq, Hkv) or qi.shape[2] != Nq:
            raise ValueError(f"plan.query_index: must be int32 (B, Hq or Hkv, Nq), got {qi.dtype} {tuple(qi.shape)}")
        ref = torch.arange(Nq, device=qi.device)
        if not bool((qi.sort(-1).values == ref).all()):
            raise ValueError("plan.query_index: each row must be a permutation of range(Nq)")
    t = torch.arange(max_tiles, device=q.device)
    live = t < plan.tile_counts[..., None]
    offs = plan.tile_offsets
    if bool(((offs < 0) & live).any()) or bool(((offs >= length) & live).any()):
        raise ValueError(f"plan.tile_offsets: live offsets must lie in [0, {length})")
    # the promise: unmasked tiles fully visible
    unmasked = live & (t >= plan.masked_counts[..., None])
    if bool(unmasked.any()):
        H = max([plan.tile_offsets.shape[1]]
                + [x.shape[1] for x in (plan.key_index, plan.query_index) if x is not None])
        qi = expand_heads(plan.query_index, H)
        ki = expand_heads(plan.key_index, H)
        qmin, qmax = _query_block_bounds(_positions(qi, Nq, B, H, q.device) + (Nk - Nq), plan.block_m)
        logical = expand_heads(offs, H).long()[..., None] + torch.arange(plan.block_n, device=q.device)
        phys = _physical_keys(ki, logical, length)
        ok = (phys >= 0) & (phys < Nk) & (phys <= qmin[..., None, None])
        if plan.has_band:  # every row of the block sees the key in the band: its last row's band starts before it
            ok = ok & (phys >= band_start(qmax, plan.window, plan.chunk)[..., None, None])
        bad = expand_heads(unmasked, H) & ~ok.all(-1)
        if bool(bad.any()):
            where = [int(x) for x in bad.nonzero()[0].tolist()]
            raise ValueError(
                f"plan: unmasked tile not fully visible at (batch, head, query block, tile)={tuple(where)}; "
                "tiles with padding, future keys or keys outside the band must be among the first masked_counts tiles"
            )


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: Optional[float] = None,
    *,
    return_visited: bool = False,
):
    """Pure-PyTorch execution of ``plan`` (see the module docstring). Blockwise: O(Nk·block_m) memory per step.

    Computes in float32 (float64 for float64 inputs) and returns the output in ``q.dtype``; with
    ``return_visited`` also the number of tiles each (batch, query head, query block) computed, int32.
    """
    validate_qkv(q, k, v, who="reference_attention", dtypes=_REFERENCE_DTYPES)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    bm = plan.block_m
    nqb = cdiv(Nq, bm)
    offs = expand_heads(plan.tile_offsets, Hq).long()
    counts = expand_heads(plan.tile_counts, Hq).long()
    masked = expand_heads(plan.masked_counts, Hq).long()
    ki = expand_heads(plan.key_index, Hq)
    qi = expand_heads(plan.query_index, Hq)
    length = ki.shape[-1] if ki is not None else Nk
    kv_head = torch.arange(Hq, device=dev) // G
    kf = k.to(cdt)[:, kv_head]  # (B, Hq, Nk, D) view-sized copy: O(N·D)
    vf = v.to(cdt)[:, kv_head]
    out = torch.zeros(B, Hq, Nq, D, dtype=cdt, device=dev)
    visited = torch.zeros(B, Hq, nqb, dtype=torch.int32, device=dev)
    for i in range(nqb):
        rows = torch.arange(i * bm, min((i + 1) * bm, Nq), device=dev)
        m = rows.numel()
        phys_rows = rows.expand(B, Hq, m) if qi is None else qi[:, :, rows].long()
        qb = torch.gather(q.to(cdt), 2, phys_rows[..., None].expand(B, Hq, m, D))
        T = int(counts[:, :, i].max().item()) if counts.numel() else 0
        if T == 0:
            continue
        o, visited[:, :, i] = reference_tiles(qb, phys_rows + (Nk - Nq), kf, vf, offs[:, :, i, :T], counts[:, :, i],
                                              masked[:, :, i], plan, scale, key_index=ki, length=length, key_end=Nk)
        out.scatter_(2, phys_rows[..., None].expand(B, Hq, m, D), o)
    out, visited = apply_exact_tail(out, q, k, v, plan, scale, visited)
    out = out.to(q.dtype)
    return (out, visited) if return_visited else out


def reference_tiles(qb: torch.Tensor, qpos: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, offs: torch.Tensor,
                    counts: torch.Tensor, masked: torch.Tensor, plan, scale: float, *,
                    key_index: Optional[torch.Tensor] = None, length: int, key_end):
    """One step of ``reference_attention``: the listed tiles of a set of query blocks, in the module docstring's
    semantics. qb (B, H, m, D) in the compute dtype at absolute positions ``qpos`` (B, H, m); kf, vf (B, H, Nk, D)
    (an expanded view is fine); ``offs`` (B, H, T) int64, the first T of each list, ``counts`` / ``masked`` (B, H);
    ``key_end``: keys at or past it are padding (an int, or a tensor broadcasting against (B, H, T, block_n): one
    bound per packed block). ``plan``: its ``block_n``, band, early stop and P.V skip (a ``BlockPlan`` or
    ``packed.PackedPlan``). Returns the output (B, H, m, D) and the tiles each block computed, int32 (B, H)."""
    B, Hq, m, D = qb.shape
    T, bn, dev = offs.shape[-1], plan.block_n, qb.device
    logical = offs[..., None] + torch.arange(bn, device=dev)  # (B, Hq, T, bn)
    phys = _physical_keys(key_index, logical, length)
    valid = (phys >= 0) & (phys < key_end)
    t_ids = torch.arange(T, device=dev)
    live = t_ids < counts[..., None]  # (B, Hq, T)
    is_masked = t_ids < masked[..., None]
    safe = phys.clamp(0, kf.shape[2] - 1).flatten(2)  # (B, Hq, T*bn)
    kb = torch.gather(kf, 2, safe[..., None].expand(-1, -1, -1, D))
    vb = torch.gather(vf, 2, safe[..., None].expand(-1, -1, -1, vf.shape[-1]))
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # (B, Hq, m, T*bn)
    s = s.view(B, Hq, m, T, bn)
    causal = phys[:, :, None, :, :] <= qpos[:, :, :, None, None]
    if plan.has_band:  # masked tiles only, as in the kernel
        causal = causal & in_band(qpos[:, :, :, None, None], phys[:, :, None, :, :], plan.window, plan.chunk)
    allowed = torch.where(is_masked[:, :, None, :, None], valid[:, :, None] & causal, torch.ones_like(causal))
    allowed = allowed & live[:, :, None, :, None]
    s = s.masked_fill(~allowed, float("-inf"))
    vb = vb.view(B, Hq, T, bn, vf.shape[-1])
    if plan.early_stop > 0 or plan.pv_skip is not None:
        return _sequential_tiles(s, vb, live, is_masked, plan.early_stop, plan.pv_skip)
    s2 = s.flatten(3)
    mx = s2.amax(-1, keepdim=True)
    mx = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)  # rows that see nothing
    p = torch.exp(s2 - mx)
    denom = p.sum(-1, keepdim=True)
    # only an empty row divides by 1: a NaN denominator (a non-finite score) stays NaN
    o = torch.matmul(p, vb.flatten(2, 3)) / torch.where(denom == 0, torch.ones_like(denom), denom)
    return o, counts.to(torch.int32)


def _sequential_tiles(s, vb, live, is_masked, early_stop, pv_skip):
    """Online softmax tile by tile, for early stop and P·V skip. s: (B, H, m, T, bn); vb: (B, H, T, bn, D).

    Non-finite scores flow through as in the kernel: a NaN or +inf score makes the row's denominator NaN, which
    stays NaN and reaches the output; such a row does not keep the walk going nor prevent a skip.
    """
    B, H, m, T, bn = s.shape
    D = vb.shape[-1]
    neg_inf = float("-inf")
    mrow = torch.full((B, H, m), neg_inf, dtype=s.dtype, device=s.device)
    lrow = torch.zeros((B, H, m), dtype=s.dtype, device=s.device)
    acc = torch.zeros((B, H, m, D), dtype=s.dtype, device=s.device)
    active = torch.ones((B, H), dtype=torch.bool, device=s.device)
    visited = torch.zeros((B, H), dtype=torch.int32, device=s.device)
    for t in range(T):
        run = active & live[:, :, t]
        if not bool(run.any()):
            break
        st = s[:, :, :, t, :]
        tile_max = st.amax(-1)
        m_new = torch.maximum(mrow, tile_max)
        # a row that has seen no key yet (-inf) subtracts 0: exp(-inf) = 0, no (-inf) - (-inf)
        m_safe = torch.where(m_new == neg_inf, torch.zeros_like(m_new), m_new)
        alpha = torch.exp(mrow - m_safe)
        p = torch.exp(st - m_safe[..., None])
        gain = p.sum(-1)
        l_prev = lrow * alpha
        l_new = l_prev + gain
        if pv_skip is not None:
            # per row: far below its running max drops the row's P.V share (a NaN gap drops too: l is NaN)
            keep = tile_max - m_safe >= pv_skip  # (B, H, m)
            p = torch.where(keep[..., None], p, torch.zeros_like(p))
        pv = torch.matmul(p, vb[:, :, t])
        acc_new = acc * alpha[..., None] + pv
        upd = run[..., None]
        mrow = torch.where(upd, m_new, mrow)
        lrow = torch.where(upd, l_new, lrow)
        acc = torch.where(upd[..., None], acc_new, acc)
        visited = visited + run.to(torch.int32)
        if early_stop > 0:
            # the walk goes on while some row gains at least tau of what it had (NaN compares false)
            goes_on = (gain >= early_stop * l_prev).any(-1) | is_masked[:, :, t]
            active = active & ~(run & ~goes_on)
    out = acc / torch.where(lrow == 0, torch.ones_like(lrow), lrow)[..., None]
    return out, visited
