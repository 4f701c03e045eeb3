"""BFLA (Wu et al. 2026), select stage ``bfla``: block-filtered selection (Wu et al. 2026, Sec. 3.2-3.3).

Stage 1, coarse blocks of b tokens (logical order) in groups of g tokens: flatten-g pooling (a group of g rows is one
g*D vector, Eq. 3; a ragged group zero-padded, an empty one ignored); S[p, i, j] = max over group pairs of the pooled
product (Eq. 4; query head p of KV head h); a block-causal mask from original positions (Eq. 5-8; chunked prefill
through the offset Nk - Nq); A = softmax(alpha * S) over visible blocks (Eq. 9, alpha = ``score_scale``); keep the
fewest top-A blocks with cumulative mass >= gamma (Eq. 10-12, ``top_mass``; gamma >= 1 keeps all). GQA: the mass
mask is OR-ed over a KV head's query heads (the paper's final tile mask is indexed by KV head): one tile list each.

Stage 2, on the (tile_size_q x tile_size_kv) tile grid (Eq. 13-20): each tile takes its coarse block's mask; the local
band (Eq. 15; the paper's index range is garbled: the query tile's own diagonal tiles plus ``n_local`` before them);
the sink, the first ``sink_tiles`` key tiles (Eq. 16); stride rescue (Eq. 18: ``hash32``(seed, i, j) mod eta == 0,
head-independent; eta = 0 disables it); random rescue (Eq. 19: hash32(seed ^ 0x5851F42D, h, i, j) < floor(rho *
2^32), h the KV head). Only causally visible tiles are kept; under a PBS permutation band and sink use logical tiles.

Departure: alpha defaults to scale / g (``block_softmax_scale``: a block logit is the mean aligned token logit of
its best group pair), not the paper's 1/sqrt(C), with which the block softmax is nearly one-hot on the query block's
own diagonal block; ``score_scale=1/math.sqrt(C)`` restores the paper's alpha. Memory: group scores per chunk of
coarse query blocks (at most ``CHUNK_ELEMENTS`` elements); the kept tables are (N/b)^2 and (N/tile)^2.

Non-finite inputs (not in the paper; kept confined as in dense attention): a non-finite block score keeps its coarse
block and leaves the softmax (``mass_keep``). Through the shared GQA tile mask a NaN query row changes the tiles of
every query head of its KV group inside its coarse query block (rows stay finite). No selector reads V. The steps in
full and why alpha departs: docs/methods.md ("`bfla` step by step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..params import (MAX_SPAN, MethodParams, block_field, fail, finite_field, fraction_field, int_field,
                      optional_field, tiles_field)
from ..kernels.reference import hash32
from ..kernels.validate import cdiv, expand_heads
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from .tiles import finish_plan, visibility
from .scoring import Reordering, chunk_count, compute_dtype, group_scores, logical_keys, mass_keep
from .fast_path import check_selectable, plan_from_tables, segment_bound, tile_grid

__all__ = ["BFLAParams", "MAX_GROUPS", "select_bfla", "select_bfla_fast", "bfla_block_scores", "block_softmax_scale",
           "planned_coarse_block", "RANDOM_SALT"]


#: the most groups per coarse block (coarse_block_size / group_size). Every pair of groups of two coarse blocks is
#: scored: the reference holds B x Hq x G x (N / b) x G scores for each coarse query block (chunks never split a
#: block: G = 2**20 asked for 8.8 TB at 200 tokens), and a program of the kernel (``kernels/bfla.py``) covers
#: max(its 64 or 128 group rows, G): past 128 its (G x G) float32 accumulator and (G x D) operands, staged in shared
#: memory, outgrow the GPU (H200, head dim 128: G = 128 ran; G = 256, b = 512, asked for 393216 bytes of shared
#: memory where there are 232448). The paper's operating point has G = 4 (b = 256, g = 64).
MAX_GROUPS = 128
_GROUPS_REASON = ("every pair of groups of two coarse blocks is scored: G x G scores per block pair, in one "
                  "kernel program")
_COARSE_REASON = ("queries and keys are padded to whole coarse blocks, so the scores' memory grows with it even "
                  f"on a short prompt; the longest coarse block supported is MAX_SPAN = 2**16 = {MAX_SPAN} tokens")


@dataclass(frozen=True)
class BFLAParams(MethodParams):
    """BFLA (Wu et al. 2026): flatten-g pooled block mass selection, then tile-level rescue.

    Defaults are the paper's highlighted operating point (Table 5): b=256, g=64, n_local=8, ρ=0, η=16, except
    the block-softmax scale α and γ: 0.998, not 0.99. At 0.99 a pretrained model (SmolLM2-135M) lost +0.052 nats
    per token at 16K, at 0.998 +0.033 (density 0.54 instead of 0.36; docs/methods.md). ``mass_threshold=1.0``
    keeps every causal block.

    ``score_scale`` is α of Eq. 9. ``None`` (the default) means α = scale / g: 1/(g·√C) at the attention's usual
    scale 1/√C, which puts a block logit (the best group pair's flatten-g product, a sum of g aligned token
    products) on the scale of one token logit. The paper writes α = 1/√C; pass it explicitly to get it back
    (``score_scale=1 / math.sqrt(C)``, e.g. 0.0884 at head dim 128). With the paper's α the block softmax is
    nearly one-hot on real models (logit spread of several hundred), its top block is the query block's own
    diagonal block, and γ has no effect: on the retrieval model the plan is then only the local band, sink and
    stride rescue (density 0.22 at 8K, 0.14 at 16K, whatever γ, relative L1 error 0.05), and random inputs keep
    0.71 of the tiles at 8K with relative L1 error 0.33. With α = 1/(g·√C) γ moves the density; at γ = 0.99
    the retrieval model's plans keep 0.49 / 0.43 of the tiles at 8K / 16K with relative L1 error 0.018 / 0.017,
    PBS's error at its own defaults (0.019 / 0.016 at density 0.40 / 0.31), and random inputs (no structure to
    exploit) keep every tile
    (``docs/methods.md``).

    Bounds (refused where given): ``coarse_block_size`` <= ``params.MAX_SPAN`` (2**16 tokens), at most
    ``MAX_GROUPS`` (128) groups per coarse block (``group_size`` >= ``coarse_block_size / 128``), ``local_tiles``
    and ``sink_tiles`` <= ``params.MAX_TILES``.
    """

    coarse_block_size: int = 256
    group_size: int = 64
    mass_threshold: float = 0.998
    tile_size_q: int = 128
    tile_size_kv: int = 64
    local_tiles: int = 8
    sink_tiles: int = 1
    stride: int = 16
    random_rescue: float = 0.0
    seed: int = 0
    score_scale: float | None = None

    field_checks: ClassVar[dict] = {
        # the coarse block is a selection granularity, not a kernel tile: no 256 cap, but a bound (params.MAX_SPAN)
        "coarse_block_size": block_field(high=MAX_SPAN, why=_COARSE_REASON),
        "group_size": int_field(low=1, high=MAX_SPAN, why="a group is part of a coarse block, at most MAX_SPAN = "
                                                          f"{MAX_SPAN} tokens"),
        "mass_threshold": fraction_field(), "tile_size_q": block_field(), "tile_size_kv": block_field(),
        "local_tiles": tiles_field(), "sink_tiles": tiles_field(), "stride": int_field(),
        "random_rescue": fraction_field(), "seed": int_field(),
        "score_scale": optional_field(finite_field(sign=1)),
    }

    def check_fields(self) -> None:
        if self.coarse_block_size % self.group_size:
            fail("BFLAParams", "group_size", f"must divide coarse_block_size={self.coarse_block_size}")
        for name in ("tile_size_q", "tile_size_kv"):
            if self.coarse_block_size % getattr(self, name):
                fail("BFLAParams", name, f"must divide coarse_block_size={self.coarse_block_size}")
        groups = self.coarse_block_size // self.group_size
        if groups > MAX_GROUPS:
            fail("BFLAParams", "group_size",
                 f"must be at least coarse_block_size / {MAX_GROUPS} = {self.coarse_block_size // MAX_GROUPS} "
                 f"(coarse_block_size={self.coarse_block_size}), got {self.group_size}: that is {groups} groups per "
                 f"coarse block, and at most MAX_GROUPS = {MAX_GROUPS} are supported ({_GROUPS_REASON})")


def block_softmax_scale(params: BFLAParams, scale: float) -> float:
    """α of Eq. 9 for attention scale ``scale``: ``params.score_scale``, or scale / group_size when it is None
    (1/(g·√C) at the usual scale; the paper's 1/√C must be given explicitly). The reference and fast selectors
    both resolve it here."""
    return float(params.score_scale) if params.score_scale is not None else float(scale) / params.group_size


#: XOR-ed into the seed of the random-rescue hash so that it is independent of the stride-rescue hash.
RANDOM_SALT = 0x5851F42D


def planned_coarse_block(params: BFLAParams, num_queries: int, key_length: int) -> int:
    """The coarse block BFLA's stage 1 runs with on ``num_queries`` queries over ``key_length`` logical keys:
    ``params.coarse_block_size``, or, where that holds the whole prompt and the mass rule keeps some mass
    (0 < ``mass_threshold`` < 1), the smallest power of two >= the prompt holding whole groups and tiles (never
    longer than the block asked for).

    A coarse block holding the whole prompt is its only one (one coarse query block, one coarse key block) and
    every tile maps to it, so the plan reads one score per (batch, query head): a visible block that is the
    softmax's only candidate, probability exactly 1, kept by the cumulative-mass rule for any threshold > 0, and
    kept as well where its score is not finite (``mass_keep``, ``kernels.mass``). So the plan does not depend on
    the score, and the score needs no queries and keys padded to the block asked for: a 200-token prompt with
    ``coarse_block_size=2**16`` padded 32 query heads to 2**16 rows (1.3 GB extra on the CPU reference). At
    ``mass_threshold=0`` the block is kept only where its score is not finite, which a float32 sum of finite
    products can decide by its order of summation: there the block asked for stays.
    """
    coarse = params.coarse_block_size
    prompt = max(num_queries, key_length)
    if coarse < prompt or not 0.0 < params.mass_threshold < 1.0:
        return coarse
    fit = max(1 << max(0, prompt - 1).bit_length(), params.group_size, params.tile_size_q, params.tile_size_kv)
    return min(coarse, fit)


def bfla_block_scores(q: torch.Tensor, k: torch.Tensor, block: int, group: int, key_index=None) -> torch.Tensor:
    """Steps 1-2: max-over-group-pairs block scores (B, Hq, ceil(Nq/b), ceil(L/b)) (unscaled, unmasked).

    A block pair with a non-finite group product (a group holding a non-finite row) scores NaN."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    cdt = compute_dtype(q.dtype)
    dev = q.device
    keys, valid = logical_keys(k, key_index)
    L = keys.shape[2]
    G = block // group
    lq, lk = cdiv(Nq, block), cdiv(L, block)
    pk = torch.nn.functional.pad(keys.to(cdt), (0, 0, 0, lk * block - L)).reshape(B, Hkv, lk * G, group * D)
    qlive = torch.arange(lq * G, device=dev) * group < Nq
    klive = torch.nn.functional.pad(valid, (0, lk * block - L)).view(*valid.shape[:2], lk * G, group).any(-1)
    klive = expand_heads(klive, Hq)  # (B|1, Hq, lk*G)
    neg = torch.finfo(cdt).min
    out = torch.empty(B, Hq, lq, lk, dtype=cdt, device=dev)
    step = chunk_count(B * Hq * G * lk * G)
    for i0 in range(0, lq, step):
        i1 = min(i0 + step, lq)
        rows = slice(i0 * G, i1 * G)
        qc = q[:, :, i0 * block: min(i1 * block, Nq)].to(cdt)  # cast chunk by chunk
        qc = torch.nn.functional.pad(qc, (0, 0, 0, (i1 - i0) * block - qc.shape[2]))
        z = group_scores(qc.reshape(B, Hq, (i1 - i0) * G, group * D), pk)  # (B, Hq, c*G, lk*G)
        live = qlive[rows, None] & klive[:, :, None, :]
        nonfinite = (live & ~torch.isfinite(z)).view(B, Hq, i1 - i0, G, lk, G).any(5).any(3)
        z = torch.where(live, z, torch.full((), neg, dtype=cdt, device=dev))
        best = z.view(B, Hq, i1 - i0, G, lk, G).amax((3, 5))
        out[:, :, i0:i1] = torch.where(nonfinite, torch.full((), float("nan"), dtype=cdt, device=dev), best)
    return out


def select_bfla(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    batch, heads_q, num_queries, _ = q.shape
    heads_kv, num_keys = k.shape[1], k.shape[2]
    key_length = reordering.key_index.shape[-1] if reordering.key_index is not None else num_keys
    coarse = planned_coarse_block(params, num_queries, key_length)
    tile_q, tile_k = params.tile_size_q, params.tile_size_kv
    dev = q.device
    # per KV head: the tile mask is shared by the group
    tile_vis = visibility(num_queries, num_keys, tile_q, tile_k, reordering, batch, heads_kv, dev)
    tile_visible = tile_vis != VISIBLE_NONE
    if params.mass_threshold >= 1.0:
        return finish_plan(tile_visible, tile_vis, tile_q, tile_k, reordering)

    # stage 1: coarse mass selection per query head, OR-ed over the GQA group
    coarse_visible = visibility(num_queries, num_keys, coarse, coarse, reordering, batch, heads_q, dev) != VISIBLE_NONE
    alpha = block_softmax_scale(params, scale)
    score = bfla_block_scores(q, k, coarse, params.group_size, reordering.key_index) * alpha
    mass = mass_keep(score, coarse_visible, params.mass_threshold)
    mass = mass.view(batch, heads_kv, heads_q // heads_kv, *mass.shape[2:]).any(2)  # (B, Hkv, Lq, Lk)

    # stage 2: expand to tiles, then band, sink and the two rescues
    nqt, nkt = tile_vis.shape[-2], tile_vis.shape[-1]
    i = torch.arange(nqt, device=dev)
    j = torch.arange(nkt, device=dev)
    keep = mass[:, :, (i * tile_q // coarse)][:, :, :, (j * tile_k // coarse)]
    off = num_keys - num_queries
    first = (off + i * tile_q) // tile_k - params.local_tiles
    last = (off + torch.clamp((i + 1) * tile_q, max=num_queries) - 1) // tile_k
    band = (j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])
    keep = keep | band | (j < params.sink_tiles)
    if params.stride > 0:
        dropped = tile_visible & ~keep
        chi = hash32(params.seed, i[:, None], j[None, :])
        keep = keep | (dropped & (chi % params.stride == 0))
    if params.random_rescue > 0:
        dropped = tile_visible & ~keep
        psi = hash32(params.seed ^ RANDOM_SALT, torch.arange(heads_kv, device=dev)[:, None, None], i[:, None],
                     j[None, :])
        keep = keep | (dropped & (psi < int(params.random_rescue * 2**32)))
    return finish_plan(keep, tile_vis, tile_q, tile_k, reordering)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def select_bfla_fast(q: torch.Tensor, k: torch.Tensor, scale: float, reordering: Reordering, params) -> BlockPlan:
    """= ``select_bfla`` (flatten-g mass per query head, OR over the group, tile rescue), per KV head."""
    from ..kernels.bfla import bfla_block_scores as block_scores_fast
    from ..kernels.bfla import bfla_tiles
    from ..kernels.mass import MassRule, mass_select
    from ..kernels.pooling import block_pool

    check_selectable(reordering)
    key_length = reordering.key_index.shape[-1] if reordering.key_index is not None else k.shape[2]
    coarse = planned_coarse_block(params, q.shape[2], key_length)
    tile_q, tile_k = params.tile_size_q, params.tile_size_kv
    segment = reordering.segment_size or 0
    permuted = reordering.key_index is not None
    rule = MassRule(threshold=params.mass_threshold, segment=segment,
                    scale=block_softmax_scale(params, scale))
    coarse_keep = None
    if not rule.keeps_all:
        coarse_positions = (block_pool(k, coarse, key_index=reordering.key_index, want_mean=False,
                                       want_positions=True) if permuted else None)
        score = block_scores_fast(q, k, coarse, params.group_size, reordering.key_index, segment_bound(reordering))
        coarse_keep = mass_select(tile_grid(q.shape, k.shape, q.device, reordering, coarse, coarse), rule, score,
                                  key_tiles=coarse_positions, keep_table=True)
    tile_positions = (block_pool(k, tile_k, key_index=reordering.key_index, want_mean=False, want_positions=True)
                      if permuted else None)
    tables = bfla_tiles(
        tile_grid(q.shape, k.shape, q.device, reordering, tile_q, tile_k), coarse_keep, coarse=coarse,
        local_tiles=params.local_tiles,
        sink_tiles=params.sink_tiles, stride=params.stride, stride_seed=params.seed,
        random_rescue=params.random_rescue, random_seed=params.seed ^ RANDOM_SALT, key_tiles=tile_positions,
        segment=segment,
    )
    return plan_from_tables(tile_q, tile_k, tables, reordering)


register_method(Method(
    name="bfla", params=BFLAParams, select=select_bfla, fast_select=select_bfla_fast,
    select_after=("none", "pbs"), density=DensityKnob("mass_threshold"), keep_all={"mass_threshold": 1.0},
    description="BFLA: flatten-g pooled block mass, then band, sink and stride rescue on the tile grid",
))
