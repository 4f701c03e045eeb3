"""Block-table helpers of the select stages: visibility, always-kept tiles, the fixed-share rule, and the plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..params import MethodParams, block_field, check_share, check_stride, fail, tiles_field
from ..kernels.validate import cdiv, expand_heads
from ..plan import VISIBLE_NONE, VISIBLE_PARTIAL, BlockPlan, block_visibility, plan_from_block_mask
from ..registry import DensityKnob
from .scoring import Reordering

__all__ = ["BUDGET_KNOB", "StridedRowParams", "scores_in_fp8", "strided_rows", "visibility", "diagonal_tiles",
           "first_key_tile", "local_tiles", "finish_plan", "keep_top_budget", "tiles_to_reach", "finish_budget_plan"]


def visibility(num_queries: int, num_keys: int, block_m: int, block_n: int, reordering: Reordering, batch: int,
               heads: int, device) -> torch.Tensor:
    """int8 (B, heads, n_query_blocks, n_key_tiles) visibility of the logical tiling, from ORIGINAL positions."""
    vis = block_visibility(num_queries, num_keys, block_m, block_n, key_index=reordering.key_index,
                           query_index=reordering.query_index, batch=batch, heads=1, device=device)
    return expand_heads(vis.expand(batch, *vis.shape[1:]), heads)


def diagonal_tiles(vis: torch.Tensor, reordering: Reordering, num_queries: int, num_keys: int, block_m: int,
                   block_n: int) -> torch.Tensor:
    """Tiles on the causal diagonal of each query block, which every selector except BFLA keeps.

    With a segmented key permutation (PBS): every visible tile of the query block's own segment(s) (PBS
    Fig. 1 / App. B.1: the on-diagonal segment is always computed; queries are not permuted, so query block i
    covers absolute positions off + [i*bm, (i+1)*bm) and meets segments qmin//S .. qmax//S; a logical tile lies
    in segment (t*bn)//S because the permutation stays inside segments). Without one: the partially visible
    tiles (those holding the query block's own positions).
    """
    if reordering.segment_size is None:
        return vis == VISIBLE_PARTIAL
    S = reordering.segment_size
    nqb, nkt = vis.shape[-2], vis.shape[-1]
    off = num_keys - num_queries
    i = torch.arange(nqb, device=vis.device)
    qmin = off + i * block_m
    qmax = off + torch.clamp((i + 1) * block_m, max=num_queries) - 1
    tseg = torch.arange(nkt, device=vis.device) * block_n // S
    on = (tseg[None, :] >= (qmin // S)[:, None]) & (tseg[None, :] <= (qmax // S)[:, None])
    return on & (vis != VISIBLE_NONE)


def local_tiles(vis: torch.Tensor, num_queries: int, num_keys: int, block_m: int, block_n: int,
                count: int) -> torch.Tensor:
    """bool (1, 1, n_query_blocks, n_key_tiles): the ``count`` tiles just before each query block's diagonal (keys
    in order), where the block's first rows read their recent context."""
    nqb, nkt = vis.shape[-2], vis.shape[-1]
    first = (num_keys - num_queries + torch.arange(nqb, device=vis.device) * block_m) // block_n
    j = torch.arange(nkt, device=vis.device)
    return ((j[None, :] >= (first - count)[:, None]) & (j[None, :] < first[:, None]))[None, None]


def first_key_tile(reordering: Reordering, num_keys: int, block_n: int, batch: int, heads: int, device) -> torch.Tensor:
    """bool (B, heads, 1, n_key_tiles): the logical tile that holds original key 0 (the attention sink).

    Identity order: tile 0. With a permutation, wherever key 0 was sorted to (as the PBS code's first-token mask).
    """
    if reordering.key_index is None:
        nkt = cdiv(num_keys, block_n)
        out = torch.zeros(1, 1, 1, nkt, dtype=torch.bool, device=device)
        out[..., 0] = True
        return out.expand(batch, heads, 1, nkt)
    ki = reordering.key_index
    nkt = cdiv(ki.shape[-1], block_n)
    where = torch.argmax((ki == 0).to(torch.int8), dim=-1)  # (B, Hkv) logical position of key 0
    tiles = torch.arange(nkt, device=device)
    out = (tiles == (where // block_n)[..., None])[:, :, None, :]
    return expand_heads(out, heads)


def finish_plan(keep: torch.Tensor, vis: torch.Tensor, block_m: int, block_n: int, reordering: Reordering,
                **options) -> BlockPlan:
    """The BlockPlan of a keep mask: invisible tiles dropped, partial ones first (masked), ascending order."""
    return plan_from_block_mask(keep & (vis != VISIBLE_NONE), vis, block_m, block_n, key_index=reordering.key_index,
                                query_index=reordering.query_index, **options)


def keep_top_budget(scores: torch.Tensor, visible: torch.Tensor, forced: torch.Tensor, budget: float,
                    mass_target: float = 0.0, min_budget: float = 0.0) -> torch.Tensor:
    """Each row keeps its forced tiles and its ``allowed`` highest-scoring other visible tiles (ties: lower index
    first); NaN scores are kept.

    ``allowed``: ceil(budget x visible), at least one. With a ``mass_target`` (scores are log masses): the fewest
    tiles, highest first, that bring the row's mass with its forced tiles' to ``mass_target`` of its whole visible
    mass, kept between ceil(min(min_budget, budget) x visible) and ceil(budget x visible), at least one."""
    tiles = visible.sum(-1, keepdim=True)
    allowed = torch.clamp(torch.ceil(budget * tiles - 1e-9), min=1)
    forced = forced & visible
    unreadable = visible & torch.isnan(scores)
    ranked = visible & ~forced & ~unreadable
    key = torch.where(ranked, scores, torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device))
    order = torch.argsort(key, dim=-1, descending=True, stable=True)
    # ranked tiles first (a ranked tile scored -inf must not lose its place to an unranked one)
    order = order.gather(-1, torch.argsort(ranked.gather(-1, order).to(torch.int8), dim=-1, descending=True,
                                           stable=True))
    if mass_target > 0.0:
        allowed = torch.minimum(allowed, torch.clamp(torch.ceil(min(min_budget, budget) * tiles - 1e-9), min=1)
                                .maximum(tiles_to_reach(scores, visible & ~unreadable, forced, ranked, order,
                                                        mass_target)))
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order))
    return ((rank < allowed) & ranked) | unreadable | forced


def tiles_to_reach(scores: torch.Tensor, readable: torch.Tensor, forced: torch.Tensor, ranked: torch.Tensor,
                   order: torch.Tensor, mass_target: float) -> torch.Tensor:
    """(..., 1): how many ranked tiles, taken in ``order`` (highest score first), bring the forced tiles' mass to
    ``mass_target`` of the readable tiles' (masses exp(score)); at least one; every ranked one when it is not
    reached."""
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    mass = torch.where(readable, torch.exp(scores), zero)
    goal = mass_target * mass.sum(-1, keepdim=True)
    reached = (torch.where(forced, mass, zero).sum(-1, keepdim=True)
               + torch.where(ranked, mass, zero).gather(-1, order).cumsum(-1))
    short = (reached < goal) & ranked.gather(-1, order)
    return short.sum(-1, keepdim=True) + 1


def finish_budget_plan(scores: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, reordering: Reordering,
                       params, mass_target: float = 0.0, min_budget: float = 0.0) -> BlockPlan:
    """The plan of a fixed-share selector (``params``: ``block_size``, ``budget``, ``keep_first_block``) from its
    (B, Hq, nqb, nkt) tile scores: each query block keeps its diagonal tiles, the sink tile (``keep_first_block``)
    and ``keep_top_budget`` of the others (``mass_target``, ``min_budget``: its mass rule); ``scores`` None keeps
    every visible tile."""
    bs = params.block_size
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    vis = visibility(num_queries, num_keys, bs, bs, reordering, batch, heads_q, q.device)
    visible = vis != VISIBLE_NONE
    if scores is None:
        return finish_plan(visible, vis, bs, bs, reordering)
    forced = diagonal_tiles(vis, reordering, num_queries, num_keys, bs, bs)
    if params.keep_first_block:
        forced = forced | first_key_tile(reordering, num_keys, bs, batch, heads_q, q.device)
    if params.local_tiles:
        forced = forced | local_tiles(vis, num_queries, num_keys, bs, bs, params.local_tiles)
    keep = keep_top_budget(scores, visible, forced, params.budget, mass_target, min_budget)
    return finish_plan(keep, vis, bs, bs, reordering,
                       exact_tail=params.exact_tail_blocks * bs)


def strided_rows(num_queries: int, block: int, every: int, device=None) -> torch.Tensor:
    """int64 (nqb * block // every,) query rows a strided-row selector scores, block by block: rows every-1,
    2*every-1, ..., block-1 of each query block (the block's last row among them, so every key any row of the block
    sees is seen by a sampled row); in a ragged last block, rows past its end are replaced by its last row."""
    nqb = -(-num_queries // block)
    per = max(1, block // every)
    start = torch.arange(nqb, device=device)[:, None] * block
    rows = start + (every - 1) + torch.arange(per, device=device)[None, :] * every
    return torch.minimum(rows, torch.clamp(start + block, max=num_queries) - 1).reshape(-1)


#: the density knob of the fixed-share selectors (``sampled``, ``peak``, ``antidiag``): the share itself. A share
#: must be > 0, so the sparsest end is one tile in 1024; every block still keeps at least one ranked tile.
BUDGET_KNOB = DensityKnob("budget", low=2 ** -10)


@dataclass(frozen=True)
class StridedRowParams(MethodParams):
    """The fields of a selector that scores every ``sample_every``-th row of each query block exactly and keeps a
    fixed share of tiles per block (``sampled``, ``peak``): ``block_size`` is the query block and the key tile,
    ``budget`` the share (1.0 keeps every causal block), ``keep_first_block`` keeps the sink tile,
    ``local_tiles`` keeps that many tiles just before each block's diagonal (the recent context its first rows
    read), and the rows of the last ``exact_tail_blocks`` query blocks (``block_size`` rows each) attend to every
    key they see (``BlockPlan.exact_tail``: the rows whose outputs give the next token). On SmolLM2-135M the exact
    tail keeps 4K needles, and eight local tiles (a fixed count: about a tenth of the causal tiles at 16K, under 2%
    at 128K) bring the loss at 16K within +0.01 nats per token of dense (docs/methods.md). ``fp8_scores``: the
    sampled rows' QK^T in FP8 (e4m3) where the GPU multiplies it on its tensor cores (``scores_in_fp8``; a third
    less selection time, the same loss and retrieval), the exact scores elsewhere."""

    block_size: int = 128
    sample_every: int = 8
    budget: float = 0.1
    keep_first_block: bool = True
    local_tiles: int = 8
    exact_tail_blocks: int = 1
    fp8_scores: bool = True

    field_checks: ClassVar[dict] = {"block_size": block_field(), "sample_every": check_stride,
                                    "budget": check_share, "local_tiles": tiles_field(),
                                    "exact_tail_blocks": tiles_field()}

    def check_fields(self) -> None:
        if self.sample_every > self.block_size:
            fail(type(self).__name__, "sample_every",
                 f"must be a power of two <= block_size={self.block_size}, got {self.sample_every}")


def scores_in_fp8(params: StridedRowParams, device: torch.device) -> bool:
    """Rule: the sampled rows' scores come from FP8 QK^T when asked for and the device multiplies FP8 on its tensor
    cores (twice the bf16 rate); a ranking of tiles needs the scores' order, which 3 mantissa bits keep for a key
    that stands out. Elsewhere (CPU, older GPUs, the interpreter) the scores are exact, the same plan up to
    near-equal tiles."""
    if not params.fp8_scores or device.type != "cuda":
        return False
    from ..kernels.fp8 import fp8_tensor_cores

    return fp8_tensor_cores(device)
