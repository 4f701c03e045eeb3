"""Key padding at run time: which keys of each row are valid, read once per mask tensor, not once per layer.

A rewritten site whose mask was proven to be "causal AND key padding" receives the model's 2-D padding mask
(``attention_mask`` from a tokenizer: nonzero = a real token). For a valid query, the keys it sees are the valid
keys at or before it; gathered into their own sequence, those are exactly causal attention over the row's valid
tokens. So a padded batch runs as groups of rows with the same valid range (left or right padding is a slice, no
copy; a row with holes is gathered), each group through the method as an ordinary causal prefill, and the outputs
of padded query rows are zeros (every implementation leaves them undefined).

Summarising the mask needs its values on the host: one small device-to-host read per distinct mask tensor. Every
layer of a forward pass receives the same tensor object, so the summary is cached on it (checked against the
tensor's version counter): one read per forward, however many layers. An all-ones mask then costs nothing more.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["RowGroup", "PaddingLayout", "padding_layout", "check_query_positions"]


@dataclass(frozen=True)
class RowGroup:
    """Rows whose valid keys are the same: the range ``[start, end)``, or the positions ``index`` (one row)."""

    rows: tuple[int, ...]
    start: int
    end: int
    index: Optional[Tensor] = None

    def row_selector(self):
        """A slice of the batch when the rows are consecutive (a view), else their indices."""
        first, last = self.rows[0], self.rows[-1]
        if last - first + 1 == len(self.rows):
            return slice(first, last + 1)
        return list(self.rows)


@dataclass(frozen=True)
class PaddingLayout:
    all_valid: bool
    groups: tuple[RowGroup, ...]
    binary: bool = True  # every value is 0 or 1

    def describe(self) -> str:
        kinds = []
        for g in self.groups:
            if g.index is not None:
                kinds.append(f"row {g.rows[0]}: {g.index.numel()} valid keys with holes")
            else:
                kinds.append(f"rows {list(g.rows)}: keys [{g.start}, {g.end})")
        return "; ".join(kinds)


_LOCK = threading.Lock()
_CACHE: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, data_ptr, shape, value)
_CACHE_SIZE = 16


def _cached(tensor: Tensor, tag: tuple, compute):
    key = id(tensor)
    version = tensor._version
    with _LOCK:
        entry = _CACHE.get(key)
        if entry is not None:
            ref, ver, ptr, meta, value = entry
            if ref() is tensor and ver == version and ptr == tensor.data_ptr() and meta == tag:
                return value
    value = compute()
    with _LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (weakref.ref(tensor), version, tensor.data_ptr(), tag, value)
    return value


def padding_layout(key_padding: Tensor, num_keys: int) -> PaddingLayout:
    """Row groups of a ``(batch, num_keys)`` padding mask (nonzero = valid key). One host read, then cached."""
    if key_padding.dim() != 2 or key_padding.shape[1] != num_keys:
        raise ValueError(f"key padding mask: expected shape (batch, {num_keys}), got {tuple(key_padding.shape)}")
    return _cached(key_padding, ("layout", tuple(key_padding.shape)), lambda: _layout(key_padding))


def _layout(key_padding: Tensor) -> PaddingLayout:
    valid = key_padding != 0
    batch, n = valid.shape
    as_int = valid.to(torch.int32)
    count = as_int.sum(1)
    first = as_int.argmax(1)
    last = n - 1 - as_int.flip(1).argmax(1)
    other = ((key_padding != 0) & (key_padding != 1)).sum(1, dtype=torch.int32)  # values that are not 0 or 1
    summary = torch.stack([count, first, last, other], 1).tolist()  # the one device-to-host read
    binary = not any(o for *_, o in summary)
    if all(c == n for c, *_ in summary):
        return PaddingLayout(True, (RowGroup(tuple(range(batch)), 0, n),), binary)
    ranges: dict[tuple[int, int], list[int]] = {}
    holes = []
    for row, (c, lo, hi, _) in enumerate(summary):
        if c == 0:
            ranges.setdefault((0, 0), []).append(row)
        elif hi - lo + 1 == c:
            ranges.setdefault((lo, hi + 1), []).append(row)
        else:
            holes.append(RowGroup((row,), lo, hi + 1, valid[row].nonzero().squeeze(1)))
    groups = [RowGroup(tuple(rows), lo, hi) for (lo, hi), rows in sorted(ranges.items(), key=lambda kv: kv[1][0])]
    return PaddingLayout(False, tuple(groups) + tuple(holes), binary)


def check_query_positions(positions: Tensor, num_queries: int, num_keys: int) -> None:
    """The rewrite proved the mask for ``cache_position = arange(kv_len - q_len, kv_len)``; hold it to that."""
    def compute() -> bool:
        expected = torch.arange(num_keys - num_queries, num_keys, device=positions.device)
        return bool(positions.numel() == num_queries and (positions.reshape(-1) == expected).all())

    if not _cached(positions, ("positions", num_queries, num_keys), compute):
        raise RuntimeError(
            f"sparse_compile: the query positions (cache_position) passed to a rewritten attention are not "
            f"arange({num_keys - num_queries}, {num_keys}); the rewrite proved the traced mask only for those "
            "positions. Pass the canonical positions, or run such calls through a model compiled without the "
            "sparse_prefill backend."
        )
