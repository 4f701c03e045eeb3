"""Key padding at run time: which keys of each row are valid, read once per mask tensor, not once per layer.

A rewritten site whose mask was proven to be "causal AND key padding" receives the model's 2-D padding mask
(``attention_mask`` from a tokenizer: nonzero = a real token). For a valid query, the keys it sees are the valid
keys at or before it; gathered into their own sequence, those are exactly causal attention over the row's valid
tokens. So a padded batch runs as groups of rows with the same valid range (left or right padding is a slice, no
copy; a row with holes is gathered), each group through the method as an ordinary causal prefill, and the outputs
of padded query rows are zeros (every implementation leaves them undefined).

Summarising the mask needs its values on the host: one small device-to-host read. Every layer of a forward pass
receives the same tensor object, so the summary is cached, but only for the duration of one call of a compiled
graph (``forward_scope``, which the backend wraps around every graph it compiles): between two calls the caller
may have changed the mask through an alias that PyTorch does not see (``mask.numpy()[...] = 0``, ``mask.data``,
DLPack), so no version counter or pointer can vouch for a summary made before. Inside one call no user code runs
between the graph's attention calls, so the cache is sound there. Cost: one read per mask tensor per call of a
compiled graph (one per forward pass of a model compiled whole; one per graph when the model has graph breaks),
one per forward pass for a mask sparse_compile builds itself for that pass (``owned_mask``: the transformers
attention interface), and one per op call otherwise (direct calls of the op).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from .state import STATE

__all__ = ["RowGroup", "PaddingLayout", "padding_layout", "check_query_positions", "forward_scope", "in_forward_scope",
           "per_forward", "owned_mask", "read_once", "compute_layout", "document_segments"]


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


_SCOPE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("sparse_compile_padding_scope",
                                                                         default=None)


@contextlib.contextmanager
def forward_scope() -> Iterator[None]:
    """Inside the block, a mask tensor's summary is read once and reused (one call of a compiled graph)."""
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def in_forward_scope() -> bool:
    """Whether a ``forward_scope`` is open here (one is only while a compiled graph's call runs)."""
    return _SCOPE.get() is not None


def per_forward(compiled: Callable) -> Callable:
    """``compiled`` (a compiled graph's callable) with every call in its own ``forward_scope``."""

    def scoped(*args, **kwargs):
        with forward_scope():
            return compiled(*args, **kwargs)

    scoped._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo's calling convention, passed through
    return scoped


_OWNED: dict[int, tuple] = STATE.add("padding.owned", {})  # id -> (weakref, that mask's cache)


def owned_mask(mask: Tensor) -> Tensor:
    """Mark ``mask`` as built by sparse_compile for one forward pass (a fresh tensor object each pass, that every
    layer of the pass receives): its summary is then read once and kept for the object's lifetime, as inside a
    ``forward_scope``. Returns ``mask``."""
    key = id(mask)
    # the dict is bound now: at interpreter exit the module global may already be None when the callback runs
    _OWNED[key] = (weakref.ref(mask, lambda _, key=key, owned=_OWNED: owned.pop(key, None)), {})
    return mask


def read_once(tensor: Tensor, tag: tuple, compute: Callable, *args):
    """``compute(*args)``, a summary of ``tensor``'s values (``tag`` names which), read once per ``forward_scope``
    (or per ``owned_mask``) and recomputed outside one (module docstring)."""
    cache = _SCOPE.get()
    holder = tensor  # a scope's entry holds its tensor, so that the tensor's id is not reused inside the scope
    if cache is None:
        owned = _OWNED.get(id(tensor))
        if owned is None or owned[0]() is not tensor:
            return compute(*args)  # outside a compiled graph's call: nothing vouches for an earlier read
        # the cache belongs to this one tensor (checked through the weak reference): holding the tensor there
        # would keep it, and its cache, alive for ever
        cache, holder = owned[1], None
    key = (id(tensor), tag)
    entry = cache.get(key)
    # version and pointer catch a tracked in-place change or a swapped storage
    if entry is not None and entry[0] is holder and entry[1] == (tensor._version, tensor.data_ptr()):
        return entry[2]
    value = compute(*args)
    cache[key] = (holder, (tensor._version, tensor.data_ptr()), value)
    return value


def padding_layout(key_padding: Tensor, num_keys: int) -> PaddingLayout:
    """Row groups of a ``(batch, num_keys)`` padding mask (nonzero = valid key). One host read per
    ``forward_scope`` (module docstring)."""
    if key_padding.dim() != 2 or key_padding.shape[1] != num_keys:
        raise ValueError(f"key padding mask: expected shape (batch, {num_keys}), got {tuple(key_padding.shape)}")
    return read_once(key_padding, ("layout", tuple(key_padding.shape)), compute_layout, key_padding)


def compute_layout(key_padding: Tensor) -> PaddingLayout:
    valid = key_padding != 0
    batch, n = valid.shape
    if batch == 0 or n == 0:  # nothing to summarise (an empty call runs dense attention)
        return PaddingLayout(True, (RowGroup(tuple(range(batch)), 0, n),) if batch else (), True)
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


def document_segments(positions: Tensor, num_keys: int) -> tuple:
    """Per batch row, the documents packed in it as ``(start, end, start, end)`` sequences (queries and keys the
    same tokens), from ``(batch, num_keys)`` position ids: a document starts wherever a position is not its
    predecessor's plus one. One host read per ``forward_scope``."""
    if positions.dim() != 2 or positions.shape[1] != num_keys:
        raise ValueError(f"position ids: expected shape (batch, {num_keys}), got {tuple(positions.shape)}")
    return read_once(positions, ("documents", tuple(positions.shape)), _documents, positions)


def _documents(positions: Tensor) -> tuple:
    batch, n = positions.shape
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    step[:, 0] = 0  # every row's first token starts a document
    starts = (step != 1).nonzero().tolist()  # the one device-to-host read
    rows: list = [[] for _ in range(batch)]
    for row, start in starts:
        rows[row].append(start)
    return tuple(tuple((a, b, a, b) for a, b in zip(row, row[1:] + [n])) for row in rows)


def check_query_positions(positions: Tensor, num_queries: int, num_keys: int) -> None:
    """The rewrite proved the mask for ``cache_position = arange(kv_len - q_len, kv_len)``; hold it to that."""
    def compute() -> bool:
        expected = torch.arange(num_keys - num_queries, num_keys, device=positions.device)
        return bool(positions.numel() == num_queries and (positions.reshape(-1) == expected).all())

    if not read_once(positions, ("positions", num_queries, num_keys), compute):
        raise RuntimeError(
            f"sparse_compile: the query positions (cache_position) passed to a rewritten attention are not "
            f"arange({num_keys - num_queries}, {num_keys}); the rewrite proved the traced mask only for those "
            "positions. Pass the canonical positions, or run such calls through a model compiled without the "
            "sparse_prefill backend."
        )
