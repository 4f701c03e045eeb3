"""PyTorch helpers shared by the kernels' launchers and the package: the 32-bit hash, the segmented argsort and the
band predicate (sliding window, chunks) that the attention kernel's masked tiles apply.

No Triton import (``import sparse_compile`` loads this module). Each has one implementation here: the package's
reference stages call them, and the kernels either reproduce them exactly (the hash, in uint32 arithmetic) or fall
back to them (segments too long to sort in registers).
"""

from __future__ import annotations

import torch

__all__ = ["hash32", "segmented_argsort_desc", "in_band", "band_start"]

_MASK32 = 0xFFFFFFFF
_MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # exact (x * c) mod 2^32 in int64 without overflow: split c into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer finaliser: a bijection on 32-bit words, cheap in Triton with uint32
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MULTIPLIERS[1])
    return x ^ (x >> 16)


def hash32(seed: int, *parts: torch.Tensor) -> torch.Tensor:
    """Deterministic 32-bit hash of integer tensors (broadcast together) under ``seed``, as int64 in [0, 2^32).

    h = mix(seed); for each part: h = mix(h XOR part). Identical on every device; the Triton kernels reproduce it
    with uint32 arithmetic (wrapping multiplies). ``hash32(seed)`` alone is a CPU scalar tensor: ``int()`` of it
    is the first step of the chain, which the kernels take as an argument.
    """
    device = parts[0].device if parts else "cpu"
    h = _mix32(torch.full((), int(seed) & _MASK32, dtype=torch.int64, device=device))  # a fill, not a copy
    for part in parts:
        h = _mix32(h ^ (part.long() & _MASK32))
    return h


def segmented_argsort_desc(scores: torch.Tensor, segment: int, num_segments: int) -> torch.Tensor:
    """Permutation sorting ``scores`` (..., L) descending inside each of the first ``num_segments`` segments.

    Entries past ``num_segments * segment`` stay in place; the last listed segment may be shorter than
    ``segment`` (it is padded with -inf, which sorts after every real entry because the sort is stable).
    Ties keep the lower index first. Returns int64 physical indices (..., L): position p of a segment holds the
    index of its p-th best entry. Callers map non-finite scores to a defined value first (NaN has no order).
    """
    length = scores.shape[-1]
    span = min(num_segments * segment, length)
    if span <= 0:
        return torch.arange(length, device=scores.device).expand(scores.shape).clone()
    head = scores[..., :span]
    pad = num_segments * segment - span
    head = torch.nn.functional.pad(head, (0, pad), value=float("-inf"))
    order = torch.argsort(head.unflatten(-1, (num_segments, segment)), dim=-1, descending=True, stable=True)
    order = order + torch.arange(num_segments, device=scores.device)[:, None] * segment
    order = order.flatten(-2)[..., :span]
    tail = torch.arange(span, length, device=scores.device).expand(*scores.shape[:-1], length - span)
    return torch.cat([order, tail], dim=-1)


def in_band(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """Whether key position ``key_pos`` lies in the band of query position ``query_pos`` (broadcast together), the
    predicate the attention kernel's masked tiles apply beside causality: ``query_pos - key_pos < window`` (window
    > 0) and ``key_pos // chunk == query_pos // chunk`` (chunk > 0). Positions >= 0; causality is not included."""
    ok = torch.ones(torch.broadcast_shapes(query_pos.shape, key_pos.shape), dtype=torch.bool, device=query_pos.device)
    if window > 0:
        ok = ok & (query_pos - key_pos < window)
    if chunk > 0:
        ok = ok & (torch.div(key_pos, chunk, rounding_mode="floor")
                   == torch.div(query_pos, chunk, rounding_mode="floor"))
    return ok


def band_start(query_pos: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """The first key position query position ``query_pos`` sees (int64, elementwise): with the band, a query sees
    exactly the keys ``[band_start(i), i]``, an interval whose start never decreases with ``i``."""
    start = torch.zeros_like(query_pos, dtype=torch.int64)
    pos = query_pos.long()
    if window > 0:
        start = torch.maximum(start, pos - window + 1)
    if chunk > 0:
        start = torch.maximum(start, torch.div(pos, chunk, rounding_mode="floor") * chunk)
    return start
