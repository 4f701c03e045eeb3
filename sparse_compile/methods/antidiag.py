"""Antidiagonal mass selection (XAttention-style scoring, ``sampled``'s fixed share per block): select ``antidiag``.

Tiles are ranked by a softmax over key groups in which each (row group, key group) rectangle of QK^T, R =
``row_stride`` rows by S = ``score_stride`` keys (R <= S), is scored by the sum of its antidiagonal(s), one plain
matmul. An antidiagonal meets every row and every key of its rectangle once, so a lookup (one row, one key) or a
slash line is not averaged away as by mean pooling. R = S is XAttention's square (Xu et al., 2025); R = 1 scores
every row against each group's summed keys. Per query head (queries are the last Nq of Nk positions):

1. Reduced rows: R rows concatenated, (Nq/R, R*D); reduced keys: for each slot t < R the sum of group c's keys j with
   (j + t) mod R = R-1 (``slot_mask``; ``antidiagonals=2`` also R-2), (Nk/S, R*D). Their product a_gc is the
   rectangle's antidiagonal sum, so scoring is one matmul with inner dim R*D. Ragged ends are zero-padded.
2. z_gc = a_gc * scale * ``temperature_factor`` (None: 1/S, XAttention's mean of the logits; 1: their sum); key
   group c is visible to reduced row g when all its keys are visible to the group's first row.
3. p_gc = softmax of z_g over the visible key groups (float32, in chunks of whole query blocks).
4. m_ij = sum of p_gc over query block i's reduced rows and key tile j's groups; the score is log(m_ij + TINY).
5. Keep the forced tiles (diagonal; the sink tile 0 with ``keep_first_block``) and the block's ceil(budget x
   visible tiles) (at least one) other tiles of highest m_ij, as ``sampled``; budget >= 1 keeps every tile.

Half-precision inputs are scored in their own dtype (float32 accumulation, the scale folded into q); the softmax and
masses run in float32. GQA: each query head scores against its KV head's reduced keys (never repeated). Non-finite
inputs: a block whose reduced rows score a visible key group NaN or +inf keeps every visible tile (a NaN key reaches
every block that sees its group fully, a NaN query row keeps its block whole); a -inf score weighs nothing. Why
antidiagonals, the parity of slash lines, the cost (1/(2S) of dense attention's flops) and the retrieval measured
per S and R: docs/methods.md ("`antidiag` step by step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..params import MethodParams, block_field, check_finite, check_share, check_stride, fail, tiles_field
from ..plan import BlockPlan
from ..registry import Method, register_method
from .tiles import BUDGET_KNOB, finish_budget_plan
from .scoring import Reordering, chunk_count, compute_dtype, group_scores, keep_nonfinite

__all__ = ["AntidiagParams", "reduced_queries", "reduced_keys", "slot_mask", "antidiag_tile_logits", "select_antidiag"]

#: added to a tile's mass before the log: a tile with no mass keeps a finite score
TINY = 1e-30


def _antidiagonals(owner: str, name: str, value) -> None:
    if value not in (1, 2) or isinstance(value, bool):
        fail(owner, name, f"must be 1 or 2, got {value!r}")


def _temperature(owner: str, name: str, value) -> None:
    if value is not None:
        check_finite(owner, name, value, sign=1)


@dataclass(frozen=True)
class AntidiagParams(MethodParams):
    """Antidiagonal mass selection: ``row_stride`` x ``score_stride`` rectangles of QK^T scored by their antidiagonal
    sums (one matmul at 1/``score_stride`` of QK^T's flops), a fixed share of tiles per block.

    Each query block keeps its diagonal tile(s), the sink tile (``keep_first_block``) and its ceil(``budget`` x
    visible tiles) other tiles of highest mass; ``budget=1.0`` keeps every causal block. ``block_size`` is the query
    block and the key tile. ``row_stride == score_stride`` is XAttention's square antidiagonal, ``row_stride=1``
    scores every row. ``temperature_factor`` multiplies the reduced logits (None: 1/``score_stride``);
    ``antidiagonals=2`` adds the adjacent antidiagonal (slash lines of both parities); ``local_tiles`` and
    ``exact_tail_blocks`` as ``sampled``'s (``methods.tiles.StridedRowParams``). The defaults are the best
    measured trade (docs/methods.md): half ``sampled``'s matmul, a quarter of its exponentials, less retrieval.
    """

    block_size: int = 128
    score_stride: int = 8
    row_stride: int = 2
    antidiagonals: int = 1
    temperature_factor: Optional[float] = 1.0
    budget: float = 0.1
    keep_first_block: bool = True
    local_tiles: int = 2
    exact_tail_blocks: int = 1

    field_checks: ClassVar[dict] = {"block_size": block_field(), "score_stride": check_stride,
                                    "row_stride": check_stride, "budget": check_share, "antidiagonals": _antidiagonals,
                                    "temperature_factor": _temperature, "local_tiles": tiles_field(),
                                    "exact_tail_blocks": tiles_field()}

    def check_fields(self) -> None:
        if self.score_stride > self.block_size:
            fail("AntidiagParams", "score_stride",
                 f"must be a power of two <= block_size={self.block_size}, got {self.score_stride}")
        if self.row_stride > self.score_stride:
            fail("AntidiagParams", "row_stride",
                 f"must be a power of two <= score_stride={self.score_stride}, got {self.row_stride}")


def reduced_queries(q: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, Hq, ceil(Nq/R), R*D): each group of R = ``rows`` query rows concatenated (ragged end zero-padded)."""
    batch, heads, n, dim = q.shape
    pad = -n % rows
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    return q.reshape(batch, heads, (n + pad) // rows, rows * dim)


def slot_mask(stride: int, rows: int, antidiagonals: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """(R, S) 0/1: key j of a group is summed into slot t (the partner of the group's t-th row) when
    (j + t) mod R is R-1 (the antidiagonal) or, with ``antidiagonals=2``, R-2 (the adjacent one)."""
    t = torch.arange(rows, device=device)[:, None]
    j = torch.arange(stride, device=device)[None, :]
    hit = (j + t) % rows == rows - 1
    if antidiagonals == 2 and rows > 1:
        hit = hit | ((j + t) % rows == (rows - 2) % rows)
    return hit.to(dtype)


def reduced_keys(k: torch.Tensor, stride: int, rows: int, antidiagonals: int) -> torch.Tensor:
    """(B, Hkv, ceil(Nk/S), R*D): per group of S keys (ragged end zero-padded), slot t holds the sum of the keys
    ``slot_mask`` gives to the group's t-th query row, so that ``reduced_queries . reduced_keys`` sums the
    antidiagonal(s) of each R x S rectangle of QK^T."""
    batch, heads, n, dim = k.shape
    pad = -n % stride
    groups = (n + pad) // stride
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(batch, heads, groups, stride, dim)
    if rows == 1:
        return kp.sum(3)
    mask = slot_mask(stride, rows, antidiagonals, k.dtype, k.device)
    return torch.einsum("tj,bhcjd->bhctd", mask, kp).reshape(batch, heads, groups, rows * dim)


def antidiag_tile_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, stride: int, rows: int,
                         antidiagonals: int = 2, temperature_factor: Optional[float] = 1.0) -> torch.Tensor:
    """(B, Hq, nqb, nkt) in the compute dtype: log(mass of each key tile + ``TINY``) per query block (steps 1-4 of
    the module docstring); NaN in every tile of a block whose reduced rows score a visible key group NaN or +inf.
    Chunks of whole query blocks; each chunk scores only the key groups its rows see."""
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    cdt = compute_dtype(q.dtype)
    factor = 1.0 / stride if temperature_factor is None else float(temperature_factor)
    # half precision: the matmul on the tensor cores with the scale folded into q (moderate magnitudes), then float32
    mdt = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else cdt
    rq = reduced_queries(q, rows)  # (B, Hq, Nq/R, R*D)
    rk = reduced_keys(k.to(mdt), stride, rows, antidiagonals)  # (B, Hkv, Nk/S, R*D)
    num_rows, groups = rq.shape[2], rk.shape[2]
    per_q, per_k = block // rows, block // stride  # reduced rows per query block, key groups per tile
    nqb, nkt = -(-num_queries // block), -(-num_keys // block)
    off = num_keys - num_queries
    # key groups visible to reduced row g: c <= last[g] (all S keys at or before the group's first position)
    last = torch.div(off + torch.arange(num_rows, device=q.device) * rows + 1, stride, rounding_mode="floor") - 1
    step = chunk_count(batch * heads_q * per_q * groups) * per_q  # reduced rows per chunk: whole query blocks
    low = torch.finfo(cdt).min
    nan = torch.full((), float("nan"), dtype=cdt, device=q.device)
    out = torch.empty((batch, heads_q, nqb, nkt), dtype=cdt, device=q.device)
    for r0 in range(0, num_rows, step):
        r1 = min(r0 + step, num_rows)
        seen_groups = min(groups, (off + (r1 - 1) * rows + 1) // stride)  # = last[r1 - 1] + 1
        b0, b1 = r0 // per_q, -(-r1 // per_q)
        if seen_groups <= 0:
            out[:, :, b0:b1] = torch.log(torch.full((), TINY, dtype=cdt, device=q.device))
            continue
        qc = rq[:, :, r0:r1].to(mdt) * (scale * factor)
        z = group_scores(qc, rk[:, :, :seen_groups]).to(cdt)  # (B, Hq, r1-r0, seen_groups)
        # in place, the fewest passes over the chunk (it is the selection's memory traffic): unseen groups weigh
        # nothing; a NaN or +inf score a row sees turns its max or its sum NaN (the block's scores become NaN);
        # the max is clamped so that a row that sees nothing (or only -inf) gets mass 0 rather than NaN
        z.masked_fill_(torch.arange(seen_groups, device=q.device)[None, :] > last[r0:r1, None], float("-inf"))
        z.sub_(z.amax(-1, keepdim=True).clamp_(min=low)).exp_()
        total = z.sum(-1)  # (B, Hq, r1-r0)
        # sums over each key tile's groups, then over each block's rows, then normalised per row (linear)
        full, rest = divmod(seen_groups, per_k)
        per_tile = z[..., :full * per_k].unflatten(-1, (full, per_k)).sum(-1)
        if rest:
            per_tile = torch.cat([per_tile, z[..., full * per_k:].sum(-1, keepdim=True)], -1)
        per_tile = per_tile / total.clamp_min(torch.finfo(cdt).tiny)[..., None]
        row_pad = (b1 - b0) * per_q - (r1 - r0)
        mass = torch.nn.functional.pad(per_tile, (0, nkt - per_tile.shape[-1], 0, row_pad))
        mass = mass.view(batch, heads_q, b1 - b0, per_q, nkt).sum(3)
        block_bad = torch.nn.functional.pad(torch.isnan(total), (0, row_pad)).view(batch, heads_q, b1 - b0,
                                                                                  per_q).any(-1)
        out[:, :, b0:b1] = torch.where(block_bad[..., None], nan, torch.log(mass + TINY))
    return out


def select_antidiag(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    if reordering.key_index is not None or reordering.query_index is not None:
        raise ValueError("the antidiag selector takes keys and queries in order (reorder 'none')")
    keep_all = params.budget >= 1.0
    scores = None if keep_all else antidiag_tile_logits(q, k, scale, params.block_size, params.score_stride,
                                                        params.row_stride, params.antidiagonals,
                                                        params.temperature_factor)
    if scores is not None:  # non-finite inputs reach the rows they reach in dense attention
        scores = keep_nonfinite(scores, q, k, params.block_size)
    return finish_budget_plan(scores, q, k, reordering, params)


register_method(Method(
    name="antidiag", params=AntidiagParams, select=select_antidiag,
    density=BUDGET_KNOB, keep_all={"budget": 1.0},
    description="antidiagonal mass: key groups scored by antidiagonal sums (one matmul, 1/S of QK^T), "
                "a fixed share of tiles per block",
))
