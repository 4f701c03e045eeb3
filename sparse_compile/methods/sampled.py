"""Sampled-row mass selection (built here, not from one of the four papers): tiles ranked by the exact attention
mass of every k-th query row of the block, never pooled (pooling dilutes a lookup's one row and one key 128-fold).

Per query head h and query block i of B rows (keys in order; queries are the last Nq of Nk positions):

1. Sampled rows: rows k-1, 2k-1, ..., B-1 of the block (k = ``sample_every``; the last row is one, so every key a
   row of the block sees is seen by a sampled row). In a ragged last block, rows past its end become its last row.
2. Each sampled row r: e_r = exp(q_r . k_j * scale - level_r) over every key it sees (exact, float32). Its
   normaliser's estimate Z_r: the sum of e_r over its forced region (step 3's tiles), plus, of the tiles before the
   region, every ``FAR_STRIDE``-th one's (tiles 7, 15, ...) times ``FAR_STRIDE``, the largest of them counted once.
   level_r is its highest score in those tiles. m_ij = the sum of the sampled rows' e_r in key tile j, over Z_r.
3. The forced tiles: the diagonal (partially visible) tiles, the ``local_tiles`` before them and, if
   ``keep_first_block``, tile 0 (the attention sink).
4. Keep them and the block's ceil(budget x visible tiles) (at least one) other tiles of highest m_ij (ties: lower
   tile first); budget >= 1 keeps every visible tile. With a ``mass_target`` t > 0 the block keeps instead the
   fewest of its highest tiles that bring its mass, the forced tiles' included, to t of the whole, at least
   ceil(min_budget x visible) and at most ceil(budget x visible) of them (the budget is then a cap).

Cost: QK^T and exp over 1/k of the rows in one pass, about 1/k (1 + 1/8) of dense attention's, no P.V. GQA: per
query head. Non-finite inputs (rows as in dense attention): a key tile with a NaN or infinite key element has a NaN
score (kept) in every block that sees it; a block with a NaN or infinite query element in any row, sampled or not,
has NaN in every visible tile (``scoring.keep_nonfinite``, ``kernels.mass.keep_nonfinite``), as does one whose
sampled rows score a seen key NaN or +inf or whose masses sum to ``LIMIT`` or more; a -inf score weighs nothing. V
is never read to plan. Why a mass target, why an estimated normaliser, the reasons for the non-finite rule and the
measurements: docs/methods.md ("`sampled` step by step", "Sampled").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..params import fraction_field
from ..plan import BlockPlan
from ..registry import Method, register_method
from .tiles import BUDGET_KNOB, StridedRowParams, finish_budget_plan, scores_in_fp8, strided_rows
from .scoring import Reordering, chunk_count, compute_dtype, fp8_rows_and_keys, group_scores, keep_nonfinite

__all__ = ["SampledParams", "sampled_rows", "sampled_tile_logits", "select_sampled", "select_sampled_fast"]

sampled_rows = strided_rows  # step 1's rows

#: added to a tile's mass before the log (= ``kernels.sampled.TINY``): a tile with no mass keeps a finite score
TINY = 1e-30
#: a row whose masses sum to LIMIT or more (= ``kernels.sampled.LIMIT``): its block keeps every visible tile (a
#: score ~44 nats above the best its normaliser saw: the ranking would be that tile's anyway)
LIMIT = 2.0 ** 64
#: every FAR_STRIDE-th tile before a row's forced region (t % FAR_STRIDE == FAR_STRIDE - 1) estimates its far mass
#: (= ``kernels.sampled.FAR_STRIDE``)
FAR_STRIDE = 8


@dataclass(frozen=True)
class SampledParams(StridedRowParams):
    """Sampled-row mass selection: exact softmax of every ``sample_every``-th row, per block the fewest tiles that
    hold ``mass_target`` of it.

    Each query block keeps its diagonal tile(s), the sink tile (``keep_first_block``), its local tiles and the fewest
    highest-mass other tiles that bring its sampled mass (the forced tiles' included) to ``mass_target`` of the
    whole, between ceil(``min_budget`` x visible) and ceil(``budget`` x visible) of them (the budget is the most a
    block keeps, and the density knob); ``mass_target=0`` keeps the fixed share ``budget``; ``budget=1.0`` keeps
    every causal block. ``block_size`` is the query block and the key tile. The defaults keep all of dense's
    held-out retrieval at 16K-64K and stay within 0.01 nats per token of dense on SmolLM2 at 16K-32K (README).
    """

    budget: float = 0.2
    mass_target: float = 0.96
    min_budget: float = 0.05

    field_checks: ClassVar[dict] = {**StridedRowParams.field_checks, "mass_target": fraction_field(0.0, 1.0),
                                    "min_budget": fraction_field(0.0, 1.0)}


def sampled_tile_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, every: int, fp8: bool = False,
                        local: int = 0, keep_first: bool = True) -> torch.Tensor:
    """(B, Hq, nqb, nkt) in the compute dtype: log(sum over the block's sampled rows of each row's exp-scores in
    each key tile over its normaliser's estimate, + ``TINY``) (steps 1-3; tiles no sampled row sees get
    log(TINY)); NaN in every tile of a block with a row whose masses sum to ``LIMIT`` or more, or to NaN (a NaN or
    +inf score it sees; a -inf score weighs nothing, as in dense attention), or with a non-finite query element in
    any row, and in every block in the tiles with a non-finite key element. A row's forced region: the keys it sees
    from its block's first diagonal tile minus ``local`` tiles on, and tile 0 with ``keep_first``; its far tiles:
    the tiles before that region, of which those t with t % FAR_STRIDE == FAR_STRIDE - 1 are sampled. Exp-scores
    are relative to its best score in the region and the sampled far tiles; the normaliser's estimate is their sum
    in the region plus the largest sampled far tile's plus FAR_STRIDE times the other sampled far tiles'. Key chunks
    in two passes (the normaliser, then the masses); never the (rows x Nk) matrix whole. ``fp8``: rows and keys
    rounded to e4m3 as ``kernels.fp8`` does (a scale per row, per (batch, KV head)), the products summed in
    float32."""
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    cdt = torch.float32 if fp8 else compute_dtype(q.dtype)
    rows = sampled_rows(num_queries, block, every, q.device)
    per = max(1, block // every)
    nqb, nkt = -(-num_queries // block), -(-num_keys // block)
    qs = q[:, :, rows].to(cdt)  # (B, Hq, R, D)
    logit_scale = torch.full((1, 1, 1), scale, dtype=cdt, device=q.device)
    k_in = k  # before any FP8 rounding
    if fp8:
        qs, k, logit_scale = fp8_rows_and_keys(qs, k, scale)
    positions = rows + (num_keys - num_queries)
    lo = ((rows // block) * block + (num_keys - num_queries)) // block * block - local * block  # each region's start
    step = chunk_count(batch * heads_q * rows.numel() * block) * block  # keys per chunk: whole tiles
    neg = torch.finfo(cdt).min
    zero = torch.zeros((), dtype=cdt, device=q.device)

    def logits(c0: int, c1: int):
        z = group_scores(qs, k[:, :, c0:c1].to(cdt)) * logit_scale[..., None]
        seen = torch.arange(c0, c1, device=q.device)[None, :] <= positions[:, None]
        bad = seen & (torch.isnan(z) | (z == float("inf")))
        weighed = seen & torch.isfinite(z)
        return torch.where(weighed, z, torch.full((), neg, dtype=cdt, device=q.device)), weighed, bad.any(-1)

    shape = (batch, heads_q, rows.numel())
    mx = torch.full(shape, neg, dtype=cdt, device=q.device)
    in_region, far, far_max = (torch.zeros(shape, dtype=cdt, device=q.device) for _ in range(3))
    for c0 in range(0, num_keys, step):  # the normaliser: the region's sum, the sampled far tiles' sums
        c1 = min(c0 + step, num_keys)
        z, weighed, _ = logits(c0, c1)
        keys = torch.arange(c0, c1, device=q.device)[None, :]
        region = weighed & ((keys >= lo[:, None]) | ((keys < block) & keep_first))
        sampled_far = weighed & ~region & ((keys // block) % FAR_STRIDE == FAR_STRIDE - 1) & (keys < lo[:, None])
        new = torch.maximum(mx, torch.where(region | sampled_far, z, neg).amax(-1))
        decay = torch.exp(mx - new)
        e = torch.exp(z - new[..., None])
        pad = -(c1 - c0) % block
        tile_sums = torch.nn.functional.pad(torch.where(sampled_far, e, zero), (0, pad)).view(*shape, -1, block).sum(-1)
        in_region = in_region * decay + torch.where(region, e, zero).sum(-1)
        far = far * decay + tile_sums.sum(-1)
        far_max = torch.maximum(far_max * decay, tile_sums.amax(-1))
        mx = new
    inv = 1.0 / (in_region + far_max + FAR_STRIDE * (far - far_max))  # far tiles scaled, the largest once
    bad = torch.zeros(shape, dtype=torch.bool, device=q.device)
    total = torch.zeros(shape, dtype=cdt, device=q.device)
    mass = torch.zeros((batch, heads_q, nqb, nkt), dtype=cdt, device=q.device)
    for c0 in range(0, num_keys, step):
        c1 = min(c0 + step, num_keys)
        z, weighed, bad_rows = logits(c0, c1)
        prob = torch.where(weighed, torch.exp(z - mx[..., None]), zero) * inv[..., None]
        total, bad = total + prob.sum(-1), bad | bad_rows
        pad = -(c1 - c0) % block
        tiles = (c1 - c0 + pad) // block
        prob = torch.nn.functional.pad(prob, (0, pad)).view(batch, heads_q, nqb, per, tiles, block)
        mass[..., c0 // block: c0 // block + tiles] = prob.sum((3, 5))
    bad = bad | ~(total < LIMIT)
    out = torch.log(mass + TINY)
    block_bad = bad.view(batch, heads_q, nqb, per).any(-1)
    out = torch.where(block_bad[..., None], torch.full((), float("nan"), dtype=cdt, device=q.device), out)
    return keep_nonfinite(out, q, k_in, block)  # the rows not sampled: a non-finite key or query element


def select_sampled(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    keep_all = params.budget >= 1.0
    scores = None if keep_all else sampled_tile_logits(q, k, scale, params.block_size, params.sample_every,
                                                       scores_in_fp8(params, q.device), params.local_tiles,
                                                       params.keep_first_block)
    return finish_budget_plan(scores, q, k, reordering, params, params.mass_target, params.min_budget)


# -- GPU fast path: the masses from a Triton kernel -------------------------------------------------------------
def select_sampled_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering,
                        params) -> BlockPlan:
    """= ``select_sampled``: the masses from ``kernels.sampled`` (the selection's cost), the ranking and the plan
    rows from ``kernels.budget``."""
    from ..kernels.sampled import sampled_mass_logits
    from .fast_path import budget_plan, scores_wanted

    bs = params.block_size
    scores = None
    if scores_wanted(reordering, params, "sampled"):
        scores = sampled_mass_logits(q, k, scale, bs, bs, params.sample_every, scores_in_fp8(params, q.device),
                                     params.local_tiles, params.keep_first_block)
    return budget_plan(scores, q, k, reordering, params, params.mass_target, params.min_budget)


register_method(Method(
    name="sampled", params=SampledParams, select=select_sampled, fast_select=select_sampled_fast,
    density=BUDGET_KNOB, keep_all={"budget": 1.0},
    description="sampled-row mass: exact scores of every k-th query row, per block the tiles holding a target of it",
))
