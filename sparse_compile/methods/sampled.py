"""Sampled-row mass selection (built here, not from one of the four papers): tiles ranked by the exact attention
mass of every k-th query row of the block.

Why: a retrieval lookup is one query row attending to one key. The papers' selectors pool query blocks and key
tiles into means (PBS, SpargeAttn, S2O) or groups (BFLA), which dilutes that one row and that one key 128-fold, and
they lose most retrieval at density 0.1 although the density itself is enough (``benchmarks/retrieval_oracle.py``:
tiles ranked by the exact mass of every 8th row keep 95% of dense retrieval at 64K and density 0.1). This
selector is that ranking: exact scores for a sample of rows, never pooled.

Per query head h and query block i of B rows (keys in order; queries are the last Nq of Nk positions):

1. Sampled rows: rows k-1, 2k-1, ..., B-1 of the block (k = ``sample_every``; the block's last row is one of them,
   so every key any row of the block sees is seen by a sampled row). In a ragged last block, rows past its end are
   replaced by its last row.
2. Each sampled row r: p_r = causal softmax over every key it sees of q_r . k_j * scale (exact, float32).
3. m_ij = mean over the block's sampled rows of the mass p_r puts in key tile j.
4. Keep the fewest top-m candidates (every visible tile) whose mass reaches tau of the candidates' total
   (``top_mass``; so tau is the share of the sampled rows' attention the kept tiles cover). tau >= 1 keeps every
   visible tile.
5. Always keep the diagonal (partially visible) tiles and, if ``keep_first_block``, tile 0 (the attention sink).

Cost: two passes of QK^T and exp over 1/k of the rows (row statistics, then masses): about 2/k of dense attention's
QK^T and exp work, none of its P.V. Block-level table (B, Hq, nqb, nkt); scores are formed one key chunk at a time.

GQA: per query head (the kernel reads each KV head's keys for its group's heads).

Non-finite inputs (kept confined as in dense attention): a non-finite score leaves its row's softmax and makes its
tile unreadable, and an unreadable tile is kept and leaves the mass ranking (``mass_keep``). So a NaN key's tile
is kept by every block that sees it (its last row sees it), and a block whose sampled row is NaN keeps every
visible tile. A NaN row that is not sampled does not change the plan; its own output is NaN, as in dense
attention, because every key it scores is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodParams, check_block, check_fraction, check_int, fail
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from ._blocks import diagonal_tiles, finish_plan, first_key_tile, visibility
from ._common import Reordering, chunk_count, compute_dtype, group_scores, mass_keep
from ._fast import check_selectable, plan_from_tables, tile_grid

__all__ = ["SampledParams", "sampled_rows", "sampled_tile_logits", "select_sampled", "select_sampled_fast"]

#: added to a tile's mass before the log (= ``kernels.sampled.TINY``): a tile with no mass keeps a finite score
TINY = 1e-30


@dataclass(frozen=True)
class SampledParams(MethodParams):
    """Sampled-row mass selection: exact softmax of every ``sample_every``-th row, tiles kept by cumulative mass.

    ``threshold`` is the share of the sampled rows' attention mass the kept tiles must cover; ``threshold=1.0``
    keeps every causal block. ``block_size`` is the query block and the key tile (square tiles).
    """

    block_size: int = 128
    sample_every: int = 8
    threshold: float = 0.9
    keep_first_block: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block("SampledParams", "block_size", self.block_size)
        check_int("SampledParams", "sample_every", self.sample_every, low=1)
        if self.sample_every & (self.sample_every - 1) or self.sample_every > self.block_size:
            fail("SampledParams", "sample_every",
                 f"must be a power of two <= block_size={self.block_size}, got {self.sample_every}")
        check_fraction("SampledParams", "threshold", self.threshold)


def sampled_rows(num_queries: int, block: int, every: int, device=None) -> torch.Tensor:
    """int64 (nqb * block // every,) query rows scored, block by block (step 1 of the module docstring)."""
    nqb = -(-num_queries // block)
    per = max(1, block // every)
    start = torch.arange(nqb, device=device)[:, None] * block
    rows = start + (every - 1) + torch.arange(per, device=device)[None, :] * every
    return torch.minimum(rows, torch.clamp(start + block, max=num_queries) - 1).reshape(-1)


def sampled_tile_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, every: int) -> torch.Tensor:
    """(B, Hq, nqb, nkt) in the compute dtype: log(mean sampled-row mass of each key tile + ``TINY``), NaN for a
    tile where a sampled row scores a key it sees as non-finite (steps 1-3; tiles no sampled row sees get
    log(TINY)). Two passes over key chunks (log-sum-exp, then masses); never the (rows x Nk) matrix whole."""
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    cdt = compute_dtype(q)
    rows = sampled_rows(num_queries, block, every, q.device)
    per = max(1, block // every)
    nqb, nkt = -(-num_queries // block), -(-num_keys // block)
    qs = q[:, :, rows].to(cdt)  # (B, Hq, R, D)
    positions = rows + (num_keys - num_queries)
    step = chunk_count(batch * heads_q * rows.numel() * block) * block  # keys per chunk: whole tiles
    neg = torch.finfo(cdt).min

    def logits(c0: int, c1: int):
        z = group_scores(qs, k[:, :, c0:c1].to(cdt)) * scale
        seen = torch.arange(c0, c1, device=q.device)[None, :] <= positions[:, None]
        readable = seen & torch.isfinite(z)
        return torch.where(readable, z, torch.full((), neg, dtype=cdt, device=q.device)), readable, seen

    mx = torch.full((batch, heads_q, rows.numel()), neg, dtype=cdt, device=q.device)
    se = torch.zeros((batch, heads_q, rows.numel()), dtype=cdt, device=q.device)
    for c0 in range(0, num_keys, step):
        z, readable, _ = logits(c0, min(c0 + step, num_keys))
        new = torch.maximum(mx, z.amax(-1))
        se = se * torch.exp(mx - new) + (torch.exp(z - new[..., None]) * readable).sum(-1)
        mx = new
    inv = torch.where(se > 0, 1.0 / (se * per), torch.zeros((), dtype=cdt, device=q.device))
    mass = torch.zeros((batch, heads_q, nqb, nkt), dtype=cdt, device=q.device)
    bad = torch.zeros((batch, heads_q, nqb, nkt), dtype=torch.bool, device=q.device)
    for c0 in range(0, num_keys, step):
        c1 = min(c0 + step, num_keys)
        z, readable, seen = logits(c0, c1)
        prob = torch.where(readable, torch.exp(z - mx[..., None]), torch.zeros((), dtype=cdt, device=q.device))
        pad = -(c1 - c0) % block
        tiles = (c1 - c0 + pad) // block
        prob = torch.nn.functional.pad(prob * inv[..., None], (0, pad)).view(batch, heads_q, nqb, per, tiles, block)
        mass[..., c0 // block: c0 // block + tiles] = prob.sum((3, 5))
        unread = torch.nn.functional.pad(seen & ~readable, (0, pad)).view(batch, heads_q, nqb, per, tiles, block)
        bad[..., c0 // block: c0 // block + tiles] = unread.any(5).any(3)
    out = torch.log(mass + TINY)
    return torch.where(bad, torch.full((), float("nan"), dtype=cdt, device=q.device), out)


def select_sampled(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, config) -> BlockPlan:
    params = config.params_of("sampled")
    bs = params.block_size
    batch, heads_q, num_queries, _ = q.shape
    num_keys = k.shape[2]
    vis = visibility(num_queries, num_keys, bs, bs, reordering, batch, heads_q, q.device)
    visible = vis != VISIBLE_NONE
    if params.threshold >= 1.0:
        return finish_plan(visible, vis, bs, bs, reordering)
    scores = sampled_tile_logits(q, k, scale, bs, params.sample_every)
    keep = mass_keep(scores, visible, params.threshold)
    keep = keep | diagonal_tiles(vis, reordering, num_queries, num_keys, bs, bs)
    if params.keep_first_block:
        keep = keep | first_key_tile(reordering, num_keys, bs, batch, heads_q, q.device)
    return finish_plan(keep, vis, bs, bs, reordering)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def select_sampled_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering,
                        config) -> BlockPlan:
    """= ``select_sampled``: the masses from ``kernels.sampled``, the rule and plan rows from ``kernels.mass``."""
    from ..kernels.mass import MassRule, mass_select
    from ..kernels.sampled import sampled_mass_logits

    check_selectable(reordering)
    if reordering.key_index is not None:
        raise ValueError("the sampled selector takes keys in order (reorder 'none')")
    params = config.params_of("sampled")
    bs = params.block_size
    grid = tile_grid(q, k, reordering, bs, bs)
    rule = MassRule(threshold=params.threshold, keep_diagonal=True, keep_first_key=params.keep_first_block)
    logits = None if rule.keeps_all else sampled_mass_logits(q, k, scale, bs, bs, params.sample_every)
    return plan_from_tables(bs, bs, mass_select(grid, rule, logits), reordering)


register_method(Method(
    name="sampled", params=SampledParams, select=select_sampled, fast_select=select_sampled_fast,
    density=DensityKnob("threshold"), keep_all={"threshold": 1.0},
    description="sampled-row mass: exact softmax of every k-th query row, tiles kept by cumulative mass",
))
