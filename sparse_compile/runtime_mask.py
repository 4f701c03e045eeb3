"""Masks proven at run time: an ``attn_mask`` that reaches attention as a graph input.

A mask built outside the compiled graph (transformers' static cache builds it outside the compiled forward) or
before a graph break (dynamic rope scaling, MoE routing on older transformers) arrives as an input: the graph says
nothing about its values, so ``masks.py`` cannot prove it. The op then checks the values themselves, on their
device, once per mask tensor and forward pass (``padding.read_once``: every layer of the pass receives the same
tensor), against the one form the sparse path computes::

    allowed[b, h, i, j] == key_valid[b, j] AND j <= i + offset        for one integer offset >= 0

(``allowed``: True for a bool mask; 0 for a float mask, whose other values must be masked, ``<= finfo.min / 2``).
``key_valid`` is read from the last query row, which sees every key any row sees; the offset is where that row's
last visible key puts the queries (keys past it, a static cache's empty slots, are masked for every row and
dropped), or the queries at the last keys. The comparison runs in chunks of query rows (no temporary larger than
``CHECK_ELEMENTS``), every head compared. A row that sees no key under that form (a padded query) must see no
key or every key (implementations that unmask such rows); its output is undefined in every implementation, and
the op returns zeros there, as for proven masks.

A mask that is not that form may be causal AND a sliding window / chunks AND key padding (``MaskVerdict.local``):
the valid keys are those some query row sees, the queries the last keys seen (or the last keys), the widths read
from head 0's rows (the widest row is the window, chunks start where rows' first keys do), then every element of
every head compared with what they give, in chunks of rows as above (a few more device-to-host reads, for such
masks only). As for proven masks, positions are the keys' positions in the row, chunks counted from the row's first
valid key. Anything else (packed documents, other values) runs dense SDPA with the mask, exactly as the original
call, and says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .local import CAUSAL, Local
from .padding import read_once

__all__ = ["MaskVerdict", "check_runtime_mask", "CHECK_ELEMENTS", "CHECKED", "NOT_CAUSAL"]

CHECK_ELEMENTS = 1 << 26  # the largest temporary the check allocates (elements)
CHECKED = "attn_mask checked at run time"
NOT_CAUSAL = f"{CHECKED}: not causal: "


@dataclass(frozen=True)
class MaskVerdict:
    """``causal``: the mask is ``key_valid AND j <= i + offset``; keep ``num_keys`` = q_len + offset keys.
    ``segments``: not that, but packed sequences (continuous batching's block-diagonal mask): each
    ``(q_start, q_end, k_start, k_end)`` is causal attention of those query rows, the last positions of those keys."""

    causal: bool
    reason: str
    num_keys: int = 0
    key_valid: Optional[Tensor] = None  # (batch, num_keys) bool, when causal
    segments: tuple = ()
    local: Local = CAUSAL  # when causal: also a sliding window / chunks, relative to each row's first valid key


def check_runtime_mask(mask: Tensor, batch: int, heads: int, num_queries: int, num_keys: int,
                       local: bool = False) -> MaskVerdict:
    """Whether ``mask`` (what SDPA received as ``attn_mask``) is causal AND key padding for these sizes, or with
    ``local`` (a caller that runs ``MaskVerdict.local``) also AND a sliding window / chunks; without it such a mask
    is not causal, its structure named in the reason. One device-to-host read per mask tensor per forward scope
    (a few more for a local mask)."""
    problem = _shape_problem(mask, batch, heads, num_queries, num_keys)
    if problem is not None:
        return MaskVerdict(False, NOT_CAUSAL + problem)
    # layers often receive their own view of one mask tensor (transformers slices it to kv_len per layer): the
    # verdict is kept on the viewed tensor, for this view's geometry (a view shares its base's version counter)
    anchor = mask._base if mask._base is not None else mask
    tag = ("runtime_mask", batch, heads, num_queries, num_keys, mask.dtype, mask.storage_offset(),
           tuple(mask.shape), tuple(mask.stride()), local)
    return read_once(anchor, tag, _check, mask, batch, num_queries, num_keys, local)


def _shape_problem(mask: Tensor, batch: int, heads: int, num_queries: int, num_keys: int) -> Optional[str]:
    if mask.dim() != 4:
        return f"{mask.dim()}-D mask (expected (batch, 1 or heads, q_len, kv_len))"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"mask dtype {mask.dtype} (bool or floating expected)"
    b, h, nq, nk = mask.shape
    if b not in (1, batch) or h not in (1, heads) or nq != num_queries or nk != num_keys:
        return (f"mask shape {tuple(mask.shape)} for q_len {num_queries}, kv_len {num_keys} (expected ({batch} or "
                f"1, {heads} or 1, {num_queries}, {num_keys}))")
    if num_queries > num_keys:
        return f"q_len {num_queries} > kv_len {num_keys}"
    if mask.numel() == 0:
        return "empty mask"
    return None


def _allowed(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


def _check(mask: Tensor, batch: int, num_queries: int, num_keys: int, local: bool) -> MaskVerdict:
    device = mask.device
    b, h, nq, nk = mask.shape
    last = _allowed(mask[:, 0, nq - 1, :])  # (b, nk): the keys the last query sees
    keys = torch.arange(nk, device=device)
    seen = last.any(1)
    last_seen = torch.where(last, keys, -1).amax(1)  # per row; -1 when the row sees nothing
    first_seen = torch.where(last, keys, nk).amin(1)
    # candidate offsets: the last visible key puts the last query there (trailing keys masked everywhere: a static
    # cache's empty slots), or the queries are the last keys (the usual case, and right padding in every row)
    by_last = (last_seen.amax() - (nq - 1)).clamp(0, nk - nq)
    offsets = torch.stack([by_last, torch.full_like(by_last, nk - nq)])  # (2,)
    rows_per_chunk = max(1, CHECK_ELEMENTS // max(1, b * h * nk * 2))
    mismatch = torch.zeros(2, dtype=torch.bool, device=device)
    bad_values = torch.zeros((), dtype=torch.bool, device=device)
    finfo_limit = torch.finfo(mask.dtype).min / 2 if mask.dtype.is_floating_point else None
    for start in range(0, nq, rows_per_chunk):
        chunk = mask[:, :, start:start + rows_per_chunk, :]
        rows = torch.arange(start, start + chunk.shape[2], device=device)
        if finfo_limit is not None:
            bad_values |= ~((chunk == 0) | (chunk <= finfo_limit)).all()
        allowed = _allowed(chunk)
        # a row that sees no key under the form must see none or all (implementations that unmask such rows)
        partial = allowed.any(-1, keepdim=True) & ~allowed.all(-1, keepdim=True)
        for c in range(2):
            reach = rows + offsets[c]  # (rows,): the last key each query may see
            expected = last[:, None, None, :] & (keys <= reach[:, None])[None, None]
            compared = (first_seen[:, None] <= reach[None, :])[:, None, :, None]  # rows that see some key
            mismatch[c] |= ((allowed != expected) & compared).any() | (partial & ~compared).any()
    summary = torch.cat([offsets, mismatch.to(offsets.dtype), bad_values.to(offsets.dtype)[None],
                         seen.any().to(offsets.dtype)[None]]).tolist()  # the one device-to-host read
    offset_by_last, offset_last_keys, miss_by_last, miss_last_keys, bad, any_seen = summary
    if bad:
        return MaskVerdict(False, NOT_CAUSAL + "float values other than 0 (attend) and <= finfo.min / 2 (masked): "
                                  "an additive bias, not a mask")
    for offset, miss in ((offset_by_last, miss_by_last), (offset_last_keys, miss_last_keys)):
        if any_seen and not miss:
            kept = nq + int(offset)
            valid = last[:, :kept]
            if valid.shape[0] != batch:
                valid = valid.expand(batch, kept)
            return MaskVerdict(True, f"{CHECKED}: causal AND key padding", kept, valid)
    if any_seen:
        verdict = _check_local(mask, batch)
        if verdict is not None:
            return verdict if local else MaskVerdict(False, f"{NOT_CAUSAL}{verdict.reason[len(CHECKED) + 2:]}, "
                                                            "which this caller does not run sparse")
    segments = _segments(mask, windows=local)
    if segments:
        return MaskVerdict(False, f"{CHECKED}: {len(segments)} packed causal sequences", segments=segments)
    if not any_seen:
        return MaskVerdict(False, NOT_CAUSAL + "the last query row sees no key")
    return MaskVerdict(False, NOT_CAUSAL + _first_difference(mask, int(offset_last_keys)))


def _row_ranges(mask: Tensor) -> tuple:
    """Per batch row and query row of head 0 the first key seen (nk where none), and per batch row the keys some
    query row sees; in chunks of query rows (no temporary larger than ``CHECK_ELEMENTS``)."""
    b, _, nq, nk = mask.shape
    keys = torch.arange(nk, device=mask.device)
    lo = torch.empty(b, nq, dtype=torch.long, device=mask.device)
    seen = torch.zeros(b, nk, dtype=torch.bool, device=mask.device)
    rows_per_chunk = max(1, CHECK_ELEMENTS // max(1, b * nk * 2))
    for start in range(0, nq, rows_per_chunk):
        allowed = _allowed(mask[:, 0, start:start + rows_per_chunk, :])  # (b, rows, nk)
        lo[:, start:start + allowed.shape[1]] = torch.where(allowed, keys, nk).amin(-1)
        seen |= allowed.any(1)
    return lo, seen


def _check_local(mask: Tensor, batch: int) -> Optional[MaskVerdict]:
    """Causal AND a sliding window / chunks AND key padding (``Local``: positions of the keys, chunks from each
    row's first valid key), or None. The valid keys are those some query row sees (a key no row sees is not
    attended either way); the queries are the last keys seen (a static cache's empty slots after them) or the last
    keys; the widths are read from head 0's rows, then every element of every head is compared with what they
    give. A few device-to-host reads, for masks that are not plain causal only."""
    b, h, nq, nk = mask.shape
    device = mask.device
    lo, valid = _row_ranges(mask)
    keys = torch.arange(nk, device=device)
    first = torch.where(valid, keys, nk).amin(1)  # (b,): each row's first valid key
    rows = lo < nk
    last_key = int(torch.where(valid, keys, -1).amax())
    for kept in sorted({last_key + 1, nk}):
        if kept < nq:
            continue
        qpos = torch.arange(kept - nq, kept, device=device)  # the queries are the last kept keys
        window, reach = torch.stack([torch.where(rows, qpos - lo + 1, 0).amax(),
                                     torch.where(rows, qpos - lo, 0).amax()]).tolist()
        starts = (lo - first[:, None])[rows & (lo > first[:, None])]
        alone = (qpos - first[:, None])[rows & (lo == qpos) & (qpos > first[:, None])]
        chunk = _gcd(starts.unique().tolist()) if starts.numel() else 0
        chunk_alone = _gcd(alone.unique().tolist()) if alone.numel() else 0
        candidates = [Local(window=window)] if window > 0 else []
        if chunk > reach:
            candidates.append(Local(chunk=chunk))
        if chunk_alone > 1:
            candidates += [Local(chunk=chunk_alone), Local(window=window, chunk=chunk_alone)]
        for local in candidates:
            if local.binds(kept) and _starts_fit(local, lo, qpos, first, valid) and \
                    _fits(mask, local, kept, qpos, first, valid):
                key_valid = valid[:, :kept]
                if key_valid.shape[0] != batch:
                    key_valid = key_valid.expand(batch, kept)
                return MaskVerdict(True, f"{CHECKED}: causal AND {local.describe()} AND key padding", kept,
                                   key_valid, local=local)
    return None


def _starts_fit(local: Local, lo: Tensor, qpos: Tensor, first: Tensor, valid: Tensor) -> bool:
    """Whether head 0's rows start where ``local`` AND the valid keys make them start (a row it leaves empty is
    not compared): the cheap test before the comparison of every element."""
    nk = valid.shape[1]
    keys = torch.arange(nk, device=valid.device)
    next_valid = torch.where(valid, keys, nk).flip(-1).cummin(-1).values.flip(-1)  # (b, nk): first valid key >= j
    start = torch.zeros_like(lo)  # (b, nq): the first key each row may see
    if local.window:
        start = torch.maximum(start, qpos[None] - local.window + 1)
    if local.chunk:
        start = torch.maximum(start, first[:, None] + torch.div(qpos[None] - first[:, None], local.chunk,
                                                                rounding_mode="floor") * local.chunk)
    seen = next_valid.gather(1, start.clamp(0, nk - 1))
    expected = torch.where(seen <= qpos[None], seen, nk)
    return bool(((expected == lo) | (expected >= nk)).all())


def _fits(mask: Tensor, local: Local, kept: int, qpos: Tensor, first: Tensor, valid: Tensor) -> bool:
    """Whether every element of every head is ``local`` AND the valid keys (the first ``kept`` keys; the others
    masked), rows that see no key under it seeing none or every key."""
    b, h, nq, nk = mask.shape
    keys = torch.arange(kept, device=mask.device)
    mismatch = torch.zeros((), dtype=torch.bool, device=mask.device)
    rows_per_chunk = max(1, CHECK_ELEMENTS // max(1, b * h * nk * 2))
    for start in range(0, nq, rows_per_chunk):
        allowed = _allowed(mask[:, :, start:start + rows_per_chunk, :])
        positions = qpos[start:start + allowed.shape[2]]
        expected = (local.visible(positions[None] - first[:, None], keys[None] - first[:, None])
                    & valid[:, None, :kept])[:, None]  # (b, 1, rows, kept)
        compared = expected.any(-1, keepdim=True)
        partial = allowed.any(-1, keepdim=True) & ~allowed.all(-1, keepdim=True)
        mismatch |= ((allowed[..., :kept] != expected) & compared).any() | (partial & ~compared).any()
        mismatch |= (allowed[..., kept:].any(-1, keepdim=True) & compared).any()
    return not bool(mismatch)


def _gcd(values: list) -> int:
    out = 0
    for v in values:
        out = math.gcd(out, int(v))
    return out


def _segments(mask: Tensor, windows: bool = False) -> tuple:
    """Packed sequences, or ``()``: every query row sees one contiguous range of keys ``[lo, hi]``, the same in
    every batch row and head, and consecutive rows with the same ``lo`` see one key more each (causal, the queries
    at the last positions of ``[lo, last hi]``). A row that sees no key (padding) belongs to no sequence; its output
    is undefined, as for padded rows of a proven mask. One device-to-host read.

    ``windows`` (a caller that runs ``Local``): a sequence may also be causal AND a sliding window of W keys, its
    rows' ranges then sliding by one key once W wide (continuous batching's mask of a sliding layer); such a
    sequence comes back as ``(q_start, q_end, k_start, k_end, W)``, every row checked to see exactly
    ``[max(k_start, hi - W + 1), hi]``."""
    b, h, nq, nk = mask.shape
    if b != 1:
        return ()
    allowed = _allowed(mask[0, 0])  # (nq, nk)
    same_heads = torch.ones((), dtype=torch.bool, device=mask.device)
    rows_per_chunk = max(1, CHECK_ELEMENTS // max(1, h * nk * 2))
    for start in range(0, nq, rows_per_chunk) if h > 1 else ():
        chunk = _allowed(mask[0, :, start:start + rows_per_chunk])
        same_heads &= (chunk == chunk[:1]).all()
    keys = torch.arange(nk, device=mask.device)
    count = allowed.sum(-1)
    seen = count > 0
    lo = torch.where(allowed, keys, nk).amin(-1)
    hi = torch.where(allowed, keys, -1).amax(-1)
    contiguous = (~seen | (count == hi - lo + 1)).all() & same_heads
    previous_lo = torch.cat([lo.new_full((1,), -1), lo[:-1]])
    previous_hi = torch.cat([hi.new_full((1,), -2), hi[:-1]])
    slides = (lo == previous_lo + 1) if windows else torch.zeros_like(seen)
    continues = seen & ((lo == previous_lo) | slides) & (hi == previous_hi + 1)
    starts = (seen & ~continues).nonzero().squeeze(1)
    ends = torch.cat([starts[1:], starts.new_full((1,), nq)])
    # a sequence runs from its start to the row before the next start, or to its last row that sees keys
    rows = torch.arange(nq, device=mask.device)
    owner = torch.searchsorted(starts, rows, right=True) - 1
    last_row = torch.where(seen & (owner >= 0), rows, -1)
    ends = torch.full_like(starts, -1).scatter_reduce(0, owner.clamp_min(0)[seen], last_row[seen], "amax") + 1 \
        if starts.numel() else ends
    # a sequence's window: the width of its rows whose range slid (0: none slid, causal); every row must then see
    # exactly the window's keys within the sequence
    first_lo = lo[starts][owner.clamp_min(0)] if starts.numel() else lo
    slid = seen & (owner >= 0) & (lo > first_lo)
    width = torch.where(slid, hi - lo + 1, 0)
    window = torch.zeros_like(starts).scatter_reduce(0, owner.clamp_min(0), width, "amax") if starts.numel() \
        else starts
    row_window = window[owner.clamp_min(0)] if starts.numel() else width
    expected_lo = torch.where(row_window > 0, torch.maximum(first_lo, hi - row_window + 1), first_lo)
    contiguous &= (~seen | (owner < 0) | (lo == expected_lo)).all()
    summary = torch.cat([contiguous.to(torch.int64)[None], starts, ends, lo[starts], hi[(ends - 1).clamp_min(0)],
                         window])
    values = summary.tolist()  # the one device-to-host read
    if not values[0] or not starts.numel():
        return ()
    n = starts.numel()
    firsts, lasts, los = values[1:1 + n], values[1 + n:1 + 2 * n], values[1 + 2 * n:1 + 3 * n]
    his, widths = values[1 + 3 * n:1 + 4 * n], values[1 + 4 * n:]
    # rows between a sequence's last row and the next start must see nothing (checked: they are not 'continues')
    return tuple((q0, q1, k0, k1 + 1) + ((w,) if w else ())
                 for q0, q1, k0, k1, w in zip(firsts, lasts, los, his, widths))


def _first_difference(mask: Tensor, offset: int) -> str:
    """Where the mask first differs from causal AND the last row's keys, queries at the last keys (a dense call's
    diagnosis only)."""
    b, h, nq, nk = mask.shape
    keys = torch.arange(nk, device=mask.device)
    last = _allowed(mask[:, 0, nq - 1, :])[:, None, None, :]
    rows_per_chunk = max(1, CHECK_ELEMENTS // max(1, b * h * nk * 2))
    for start in range(0, nq, rows_per_chunk):
        allowed = _allowed(mask[:, :, start:start + rows_per_chunk, :])
        rows = torch.arange(start, start + allowed.shape[2], device=mask.device)
        expected = last & (keys[None, :] <= (rows + offset)[:, None])[None, None]
        for what, where in (("sees key", allowed & ~expected), ("hides key", expected & ~allowed)):
            found = where.nonzero()
            if found.numel():
                bi, hi, i, j = found[0].tolist()
                return (f"query row {start + i} (batch {bi}, head {hi}) {what} {j}, unlike causal AND the keys "
                        "the last query sees (a sliding window, a block or document mask, heads that differ)")
    return "no single causal offset fits every query row"
