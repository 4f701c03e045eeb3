"""Pieces shared by the reorder and select stages: pooling, masked softmax, mass selection.

Conventions used throughout ``sparse_compile.methods``:

* ``q`` is ``(B, Hq, Nq, D)``, ``k`` is ``(B, Hkv, Nk, D)``, ``Hq = m * Hkv`` (GQA group size ``m``). K is never
  repeated per query head: per-query-head scores against per-KV-head summaries go through ``group_scores``.
* Selection math runs in float32 (float64 for float64 inputs), whatever the input dtype.
* Anything that grows like N^2 / c (BFLA's group scores, PBS's last-block softmax, S2O's prefix scores)
  is computed in chunks of at most ``CHUNK_ELEMENTS`` elements. Block-level tables ``(N/block)^2`` are
  materialised whole.
* No host synchronisation: only Python integers derived from shapes and parameters drive control flow.
* Non-finite inputs stay confined as in dense attention: a pooled score that is not finite keeps its tile
  (``mass_keep``), and rankings leave non-finite rows out of their means. The selectors that score a sample of rows
  exactly keep the tiles of non-finite keys and every tile of blocks with a non-finite query row
  (``keep_nonfinite``): the scores of the rows they sample cannot say what the others score.

The helpers the kernels share with the package live in ``sparse_compile.kernels``: ``cdiv`` and
``expand_heads`` in ``kernels.validate``, ``hash32`` and ``segmented_argsort_desc`` in ``kernels.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..kernels.validate import cdiv

__all__ = [
    "CHUNK_ELEMENTS",
    "Unsupported",
    "Reordering",
    "compute_dtype",
    "chunk_count",
    "block_mean",
    "finite_row_mean",
    "block_self_similarity",
    "logical_keys",
    "group_scores",
    "masked_softmax",
    "top_mass",
    "mass_keep",
    "FP8_MAX",
    "fp8_round",
    "finite_amax",
    "fp8_rows_and_keys",
    "nonfinite_rows",
    "nonfinite_key_tiles",
    "nonfinite_query_blocks",
    "keep_nonfinite",
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


#: the largest finite e4m3 value (= ``kernels.fp8.FP8_MAX``; the package's references import no Triton)
FP8_MAX = 448.0


def fp8_round(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) rounded as ``kernels.fp8`` quantizes it, with the scale of largest finite magnitude ``amax``
    (broadcast against x): (x in e4m3 values as float32, the scale)."""
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    y = (x / scale).clamp(-FP8_MAX, FP8_MAX)
    y = torch.where(torch.isfinite(x), y, torch.full((), float("nan"), device=x.device))
    return y.to(torch.float8_e4m3fn).float(), scale


def finite_amax(x: torch.Tensor, dims) -> torch.Tensor:
    """The largest finite magnitude of ``x`` over ``dims`` (kept), 0 where there is none."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros((), device=x.device)).amax(dim=dims, keepdim=True)


def fp8_rows_and_keys(rows: torch.Tensor, k: torch.Tensor, scale: float):
    """Sampled rows (B, Hq, R, D) and keys (B, Hkv, Nk, D) rounded as the FP8 scoring kernels round them (a scale
    per row, one per (batch, KV head)): (rows, keys, (B, Hq, R) factor that turns a product into a logit)."""
    rows, row_scale = fp8_round(rows.float(), finite_amax(rows.float(), -1))
    kf = k.float()
    keys, key_scale = fp8_round(kf, finite_amax(kf, (-2, -1)))
    group = rows.shape[1] // k.shape[1]
    return rows, keys, row_scale[..., 0] * key_scale.repeat_interleave(group, 1)[..., 0] * scale


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The selectors' arithmetic dtype for inputs of ``dtype``: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_count(elements_per_item: int, budget: Optional[int] = None) -> int:
    """How many items of ``elements_per_item`` elements fit in the chunk budget (at least one)."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    return max(1, budget // max(1, elements_per_item))


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
               dtype: Optional[torch.dtype] = None, *, finite_rows: bool = False) -> torch.Tensor:
    """Mean of each block of ``block`` rows of ``x`` (..., N, D) over its valid rows -> (..., ceil(N/block), D).

    ``valid`` (broadcastable to ``x[..., 0]``) marks real rows (padding of a permuted key order is invalid).
    The ragged last block is averaged over the rows it has, not over ``block``. A row holding a non-finite value
    makes its block's mean non-finite, unless ``finite_rows`` leaves such rows out. Computed in ``dtype``
    (default: ``compute_dtype(x.dtype)``), chunk by chunk.
    """
    dtype = compute_dtype(x.dtype) if dtype is None else dtype
    out = torch.empty(*x.shape[:-2], cdiv(x.shape[-2], block), x.shape[-1], dtype=dtype, device=x.device)
    for b0, b1, xb, vb in _block_chunks(x, block, valid, dtype):
        if finite_rows:
            row_ok = torch.isfinite(xb).all(-1)
            vb = vb & row_ok
            xb = torch.where(row_ok[..., None], xb, torch.zeros((), dtype=dtype, device=x.device))
        cnt = vb.sum(-1).to(dtype).clamp_min(1)
        out[..., b0:b1, :] = xb.sum(-2) / cnt[..., None]
    return out


def finite_row_mean(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of ``x`` (..., N, D) along ``dim`` (its N axis) over the rows that hold only finite values, 0 where
    there are none; in ``compute_dtype(x.dtype)``. S2O's guide key, in both implementations."""
    dtype = compute_dtype(x.dtype)
    row_ok = torch.isfinite(x).all(-1, keepdim=True)
    total = torch.where(row_ok, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim, dtype=dtype)
    return total / row_ok.sum(dim, dtype=dtype).clamp_min(1)


def block_self_similarity(x: torch.Tensor, block: int, valid: Optional[torch.Tensor] = None,
                          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """SpargeAttn's intra-block similarity: the mean of the block's token cosine-similarity matrix.

    mean_{a,b} cos(x_a, x_b) over the block's n valid rows (self pairs included) equals
    ``|| sum_a x_a/|x_a| ||^2 / n^2``, so no block x block Gram matrix is formed. A zero row counts as a zero
    unit vector. Returns (..., ceil(N/block)); empty blocks give 0.
    """
    dtype = compute_dtype(x.dtype) if dtype is None else dtype
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


def top_mass(prob: torch.Tensor, candidates: torch.Tensor, tau: float) -> torch.Tensor:
    """Keep the fewest highest-mass candidates whose cumulative mass reaches ``tau`` of the row total.

    Sort candidates by descending mass (stable: ties keep the lower index) and keep candidate ``r`` iff the mass
    before it, ``sum_{r' < r} p_{r'}``, is below ``tau`` times the candidates' sum. So the kept mass is >= tau
    (the block that crosses the threshold is kept) and, for tau > 0, a row with any mass keeps at least one
    block. This is PBS Algorithm 2 line 13 and BFLA Eq. (11); SpargeAttn's TopCdf snippet (``cumsum <= tau *
    sum``) would drop the crossing block, we keep it (coverage >= tau, one rule for all).

    ``tau >= 1`` keeps every candidate explicitly (no reliance on a float cumsum reaching 1).
    Returns a bool mask, a subset of ``candidates``.
    """
    if tau >= 1.0:
        return candidates.clone()
    p = torch.where(candidates, prob, torch.zeros((), dtype=prob.dtype, device=prob.device))
    total = p.sum(-1, keepdim=True)
    sp, order = torch.sort(p, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sp, dim=-1) - sp
    keep_sorted = before < tau * total
    keep = torch.zeros_like(candidates).scatter(-1, order, keep_sorted)
    return keep & candidates


def mass_keep(logits: torch.Tensor, candidates: torch.Tensor, tau: float) -> torch.Tensor:
    """``top_mass`` of the softmax of ``logits`` over ``candidates``, where a candidate whose logit is not finite
    (its pooled query or key statistics are not) is kept and leaves the softmax.

    So a query block with a non-finite row keeps every candidate, and a key tile with a non-finite key is kept by
    every row that has it as a candidate; the other rows and columns are selected as without them. The fast
    path's ``kernels.mass`` applies the same rule.
    """
    unreadable = candidates & ~torch.isfinite(logits)
    readable = candidates & ~unreadable
    return top_mass(masked_softmax(logits, readable), readable, tau) | unreadable


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """bool (..., N) of ``x`` (..., N, D): rows holding a NaN or infinite element. One reduction over ``x``
    (``aminmax`` propagates NaN), no elementwise copy of it."""
    lo, hi = torch.aminmax(x, dim=-1)
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def _blocks_any(flags: torch.Tensor, block: int) -> torch.Tensor:
    """(..., ceil(N/block)) of (..., N) bool: whether each block of ``block`` entries holds a True one."""
    pad = -flags.shape[-1] % block
    return torch.nn.functional.pad(flags, (0, pad)).unflatten(-1, (-1, block)).any(-1)


def nonfinite_key_tiles(k: torch.Tensor, block: int) -> torch.Tensor:
    """bool (B, Hkv, ceil(Nk/block)): key tiles of ``block`` keys holding a NaN or infinite element. Whether a
    query row scores such a key +inf, -inf or NaN depends on the row (the sign of its element against the infinite
    one), so a selector that scores a sample of rows cannot tell from their scores whether the others see a +inf:
    the fixed-share selectors keep these tiles for every block that sees them (their scores are NaN), and each
    row then reads the key as in dense attention."""
    return _blocks_any(nonfinite_rows(k), block)


def nonfinite_query_blocks(q: torch.Tensor, block: int) -> torch.Tensor:
    """bool (B, Hq, ceil(Nq/block)): query blocks of ``block`` rows with a NaN or infinite element in one of their
    rows (such a row's output depends on every key it sees: NaN where one scores it +inf or NaN, zeros where all
    score -inf, as in dense attention); the fixed-share selectors keep every visible tile of these blocks."""
    return _blocks_any(nonfinite_rows(q), block)


def keep_nonfinite(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """A fixed-share selector's (B, Hq, nqb, nkt) tile ``scores`` (query blocks and key tiles of ``block``) with NaN,
    which ``tiles.keep_top_budget`` keeps, in every tile of a block of ``nonfinite_query_blocks`` and, in every
    block that sees them, in the tiles of ``nonfinite_key_tiles`` (those of each query head's KV head): non-finite
    inputs reach exactly the rows they reach in dense attention. The fast path's kernels (``kernels.sampled``,
    ``kernels.peak``) apply the same rule."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    tiles = nonfinite_key_tiles(k, block).repeat_interleave(group, 1)[:, :, None, :]
    # the tiles each block sees: from its last position's (queries are the last Nq of Nk positions)
    last = torch.clamp((torch.arange(scores.shape[-2], device=q.device) + 1) * block, max=num_queries) - 1
    seen = torch.arange(scores.shape[-1], device=q.device)[None, :] * block <= (last + num_keys - num_queries)[:, None]
    blocks = nonfinite_query_blocks(q, block)[..., None]
    nan = torch.full((), float("nan"), dtype=scores.dtype, device=scores.device)
    return torch.where((tiles & seen) | blocks, nan, scores)
