"""Pieces shared by the reorder and select stages: pooling, masked softmax, mass selection, sorting, hashing.

Conventions used throughout ``sparse_compile.methods``:

* ``q`` is ``(B, Hq, Nq, D)``, ``k`` is ``(B, Hkv, Nk, D)``, ``Hq = m * Hkv`` (GQA group size ``m``). K is never
  repeated per query head: per-query-head scores against per-KV-head summaries go through ``group_scores``.
* Selection math runs in float32 (float64 for float64 inputs), whatever the input dtype.
* Anything that grows like N^2 / c (XAttention's strided scores, BFLA's group scores, PBS's last-block softmax)
  is computed in chunks of at most ``CHUNK_ELEMENTS`` elements. Block-level tables ``(N/block)^2`` are
  materialised whole.
* No host synchronisation: only Python integers derived from shapes and parameters drive control flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "Unsupported",
    "Reordering",
    "cdiv",
    "compute_dtype",
    "chunk_count",
    "bcast_heads",
    "block_mean",
    "block_self_similarity",
    "logical_keys",
    "group_scores",
    "masked_softmax",
    "top_mass",
    "segmented_argsort_desc",
    "hash32",
]

#: Upper bound on the element count of any chunked intermediate (about 256 MB in float32).
CHUNK_ELEMENTS = 1 << 26


class Unsupported(Exception):
    """The method cannot handle this input; the caller should run dense attention. ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Reordering:
    """Output of a reorder stage.

    name          the stage that produced it.
    key_index     int32 (B, Hkv, L) logical -> physical key rows (-1 = padding), or None (identity).
    query_index   int32 (B, Hq, Nq) logical -> physical query rows, or None (identity).
    segment_size  PBS segment S: key permutation stays inside absolute segments [sS, (s+1)S); selectors keep the
                  query block's own ("on-diagonal") segment. None when keys are not permuted.
    extras        stage-specific data for the matching selector (S2O: the ranked key-list layout).
    """

    name: str
    key_index: Optional[torch.Tensor] = None
    query_index: Optional[torch.Tensor] = None
    segment_size: Optional[int] = None
    extras: dict[str, Any] = field(default_factory=dict)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunk_count(elements_per_item: int, budget: Optional[int] = None) -> int:
    """How many items of ``elements_per_item`` elements fit in the chunk budget (at least one)."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    return max(1, budget // max(1, elements_per_item))


def bcast_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Dim 1 of ``x`` (1, Hkv or ``heads``) broadcast to ``heads``: a view for 1, a repeat for a KV-head table.

    Only used on block-level tables (never on K/V).
    """
    if x.shape[1] == heads:
        return x
    if x.shape[1] == 1:
        return x.expand(x.shape[0], heads, *x.shape[2:])
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _block_chunks(x: torch.Tensor, block: int, valid: Optional[torch.Tensor], dtype: torch.dtype):
    """Yield ``(b0, b1, xb, vb)`` over chunks of whole blocks of rows of ``x`` (..., N, D).

    xb (..., b1-b0, block, D) is cast to ``dtype`` with padding and invalid rows zeroed; vb (..., b1-b0, block)
    marks real rows. Only one chunk is ever converted, so a bf16 Q never gets a full float32 copy.
    """
    n, d = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    nb = cdiv(n, block)
    step = chunk_count(max(1, x[..., :1, :1].numel()) * block * d)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        r0, r1 = b0 * block, min(b1 * block, n)
        pad = (b1 - b0) * block - (r1 - r0)
        xc = x[..., r0:r1, :].to(dtype)
        if valid is None:
            vc = torch.ones(r1 - r0, dtype=torch.bool, device=x.device).expand(*lead, r1 - r0)
        else:
            vc = valid[..., r0:r1].expand(*lead, r1 - r0)
            xc = torch.where(vc[..., None], xc, torch.zeros((), dtype=dtype, device=x.device))
        xc = torch.nn.functional.pad(xc, (0, 0, 0, pad)).unflatten(-2, (b1 - b0, block))
        vc = torch.nn.functional.pad(vc, (0, pad)).unflatten(-1, (b1 - b0, block))
        yield b0, b1, xc, vc


def block_mean(x: torch.Tensor, block: int, valid: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Mean of each block of ``block`` rows of ``x`` (..., N, D) over its valid rows -> (..., ceil(N/block), D).

    ``valid`` (broadcastable to ``x[..., 0]``) marks real rows (padding of a permuted key order is invalid).
    The ragged last block is averaged over the rows it has, not over ``block``. Computed in ``dtype`` (default:
    ``compute_dtype(x)``), chunk by chunk.
    """
    dtype = compute_dtype(x) if dtype is None else dtype
    out = torch.empty(*x.shape[:-2], cdiv(x.shape[-2], block), x.shape[-1], dtype=dtype, device=x.device)
    for b0, b1, xb, vb in _block_chunks(x, block, valid, dtype):
        cnt = vb.sum(-1).to(dtype).clamp_min(1)
        out[..., b0:b1, :] = xb.sum(-2) / cnt[..., None]
    return out


def block_self_similarity(x: torch.Tensor, block: int, valid: Optional[torch.Tensor] = None,
                          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """SpargeAttn's intra-block similarity: the mean of the block's token cosine-similarity matrix.

    mean_{a,b} cos(x_a, x_b) over the block's n valid rows (self pairs included) equals
    ``|| sum_a x_a/|x_a| ||^2 / n^2``, so no block x block Gram matrix is formed. A zero row counts as a zero
    unit vector. Returns (..., ceil(N/block)); empty blocks give 0.
    """
    dtype = compute_dtype(x) if dtype is None else dtype
    out = torch.empty(*x.shape[:-2], cdiv(x.shape[-2], block), dtype=dtype, device=x.device)
    tiny = torch.finfo(dtype).tiny
    for b0, b1, xb, vb in _block_chunks(x, block, valid, dtype):
        s = (xb / xb.norm(dim=-1, keepdim=True).clamp_min(tiny)).sum(-2)
        cnt = vb.sum(-1).to(dtype)
        out[..., b0:b1] = (s * s).sum(-1) / (cnt * cnt).clamp_min(1)
    return out


def logical_keys(k: torch.Tensor, key_index: Optional[torch.Tensor]):
    """K in the logical order of ``key_index`` (B, Hkv, L): ``(keys (B, Hkv, L, D), valid (B|1, Hkv|1, L))``.

    A permuted copy (same size as K), not a per-query-head repeat. Padding entries (< 0) give zero rows.
    """
    if key_index is None:
        return k, torch.ones(1, 1, k.shape[2], dtype=torch.bool, device=k.device)
    valid = key_index >= 0
    idx = key_index.long().clamp_min(0)
    keys = torch.gather(k, 2, idx[..., None].expand(*idx.shape, k.shape[-1]))
    keys = torch.where(valid[..., None], keys, torch.zeros((), dtype=k.dtype, device=k.device))
    return keys, valid


def group_scores(xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
    """``xq @ xk^T`` per GQA group without repeating ``xk``: (B, Hq, R, E) x (B, Hkv, C, E) -> (B, Hq, R, C)."""
    b, hq, r, e = xq.shape
    hkv = xk.shape[1]
    out = torch.matmul(xq.reshape(b, hkv, (hq // hkv) * r, e), xk.transpose(-1, -2))
    return out.view(b, hq, r, xk.shape[2])


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; disallowed entries and empty rows give 0 (no NaN)."""
    neg = torch.finfo(logits.dtype).min
    x = torch.where(allowed, logits, torch.full((), neg, dtype=logits.dtype, device=logits.device))
    mx = x.amax(-1, keepdim=True)
    p = torch.exp(x - mx) * allowed
    den = p.sum(-1, keepdim=True)
    return p / torch.where(den > 0, den, torch.ones_like(den))


def top_mass(
    prob: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    *,
    head_start: Optional[torch.Tensor] = None,
    total: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Keep the fewest highest-mass candidates whose cumulative mass reaches ``tau`` of the row total.

    Sort candidates by descending mass (stable: ties keep the lower index) and keep candidate ``r`` iff the mass
    before it, ``head_start + sum_{r' < r} p_{r'}``, is below ``tau * total``. So the kept mass is >= tau (the
    block that crosses the threshold is kept) and, for tau > 0, a row with any mass keeps at least one block.
    This is PBS Algorithm 2 line 13, BFLA Eq. (11) and XAttention's selection rule; SpargeAttn's TopCdf snippet
    (``cumsum <= tau * sum``) would drop the crossing block, we keep it (coverage >= tau, one rule for all).

    ``head_start`` (..., 1) is mass already covered by always-kept blocks (XAttention); ``total`` defaults to the
    candidates' sum. ``tau >= 1`` keeps every candidate explicitly (no reliance on a float cumsum reaching 1).
    Returns a bool mask, a subset of ``candidates``.
    """
    if tau >= 1.0:
        return candidates.clone()
    p = torch.where(candidates, prob, torch.zeros((), dtype=prob.dtype, device=prob.device))
    if total is None:
        total = p.sum(-1, keepdim=True)
    sp, order = torch.sort(p, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sp, dim=-1) - sp
    if head_start is not None:
        before = before + head_start
    keep_sorted = before < tau * total
    keep = torch.zeros_like(candidates).scatter(-1, order, keep_sorted)
    return keep & candidates


def segmented_argsort_desc(scores: torch.Tensor, segment: int, num_segments: int) -> torch.Tensor:
    """Permutation sorting ``scores`` (..., L) descending inside each of the first ``num_segments`` segments.

    Entries past ``num_segments * segment`` stay in place; the last listed segment may be shorter than
    ``segment`` (it is padded with -inf, which sorts after every real entry because the sort is stable).
    Returns int64 physical indices (..., L): position p of a segment holds the index of its p-th best entry.
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


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # exact (x * c) mod 2^32 in int64 without overflow: split c into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer finaliser (C. Wellons): a bijection on 32-bit words, cheap in Triton with uint32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32(seed: int, *parts: torch.Tensor) -> torch.Tensor:
    """Deterministic 32-bit hash of integer tensors (broadcast together) under ``seed``, as int64 in [0, 2^32).

    h = mix(seed); for each part: h = mix(h XOR part). Identical on every device; a Triton kernel can reproduce
    it with uint32 arithmetic (wrapping multiply).
    """
    dev = parts[0].device
    h = _mix32(torch.full((), int(seed) & _MASK32, dtype=torch.int64, device=dev))  # a fill, not a copy
    for part in parts:
        h = _mix32(h ^ (part.long() & _MASK32))
    return h
