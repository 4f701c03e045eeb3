"""BFLA (Wu et al. 2026), select stage ``bfla``: block-filtered selection (Wu et al. 2026, Sec. 3.2-3.3).

Stage 1, coarse blocks of b tokens (logical order), groups of g tokens, G = b/g groups per block:

1. Flatten-g pooling: each group of g rows becomes one g*D vector (Eq. 3); a ragged group is zero-padded and a
   group with no real token is ignored.
2. S[p, i, j] = max over group pairs (u, v) of <Phi(Q)_{p,i,u}, Phi(K)_{h,j,v}> (Eq. 4), query head p of KV head h.
3. Block-causal mask from original positions (Eq. 5-8: key block j visible iff its first key <= the block's last
   query position; chunked prefill supported through the absolute offset Nk - Nq).
4. A = softmax(alpha * S) over visible blocks (Eq. 9; alpha = ``score_scale``, by default the attention's scale
   1/sqrt(C) as the paper writes).
5. Keep the fewest top-A blocks with cumulative mass >= gamma (Eq. 10-12; ``top_mass``); gamma >= 1 keeps all.
6. GQA: the mass mask is computed per query head and OR-ed over the group: the paper's final tile mask (Eq. 14,
   20, 21) is indexed by KV head, so a group's heads share one tile list (and their K/V tile loads).

Stage 2, on the (tile_size_q x tile_size_kv) attention-tile grid (Eq. 13-20):

7. Expansion: tile (i, j) takes the mask of the coarse block containing it.
8. Local band (Eq. 15): key tiles from (the tile holding the query tile's first position) - n_local to the tile
   holding its last position. Interpretation: the paper's index range is garbled; we keep the query tile's own
   diagonal tiles plus n_local tiles before them, so every row sees its own key even with n_local = 0.
9. Sink (Eq. 16, written ``j < T``): the first ``sink_tiles`` key tiles.
10. Stride rescue (Eq. 18): a causal tile still dropped is kept when chi(i, j; seed) mod eta == 0, chi = ``hash32``
    (lowbias32 chain of seed, i, j; head-independent as written in the paper); eta = 0 disables it.
11. Random rescue (Eq. 19): a still-dropped causal tile is kept when psi(h, i, j; seed) < rho, psi =
    hash32(seed ^ 0x5851F42D, h, i, j) / 2^32 (h = KV head), compared exactly as hash < floor(rho * 2^32).
Only causally visible tiles are ever kept. Under a PBS permutation, band and sink use logical tile positions.

Memory: group scores are computed for chunks of coarse query blocks (at most ``CHUNK_ELEMENTS`` elements each);
the kept tables are (N/b)^2 and (N/tile)^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodParams, check_block, check_fraction, check_int, fail
from ..plan import VISIBLE_NONE, BlockPlan
from ..registry import DensityKnob, Method, register_method
from ._blocks import finish_plan, visibility
from ._common import (
    Reordering,
    bcast_heads,
    cdiv,
    chunk_count,
    compute_dtype,
    group_scores,
    hash32,
    logical_keys,
    masked_softmax,
    top_mass,
)
from ._fast import check_selectable, plan_from_tables, seg_bound, selection_kernels

__all__ = ["BFLAParams", "select_bfla", "select_bfla_fast", "bfla_block_scores", "RANDOM_SALT"]


@dataclass(frozen=True)
class BFLAParams(MethodParams):
    """BFLA (Wu et al. 2026): flatten-g pooled block mass selection, then tile-level rescue.

    Defaults are the paper's highlighted operating point (Table 5): b=256, g=64, γ=0.99, n_local=8, ρ=0, η=16.
    ``mass_threshold=1.0`` keeps every causal block.
    ``score_scale`` is α of Eq. 9; ``None`` uses the attention's scale (1/√C), as the paper writes. A flatten-g
    score sums g token products, so with α = 1/√C the block softmax is nearly one-hot on real models and γ has
    little effect; α = 1/(g·√C) puts block logits on the scale of token logits.
    """

    coarse_block_size: int = 256
    group_size: int = 64
    mass_threshold: float = 0.99
    tile_size_q: int = 128
    tile_size_kv: int = 64
    local_tiles: int = 8
    sink_tiles: int = 1
    stride: int = 16
    random_rescue: float = 0.0
    seed: int = 0
    score_scale: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block("BFLAParams", "coarse_block_size", self.coarse_block_size)
        check_int("BFLAParams", "group_size", self.group_size, low=1)
        if self.coarse_block_size % self.group_size:
            fail("BFLAParams", "group_size", f"must divide coarse_block_size={self.coarse_block_size}")
        check_fraction("BFLAParams", "mass_threshold", self.mass_threshold)
        check_block("BFLAParams", "tile_size_q", self.tile_size_q)
        check_block("BFLAParams", "tile_size_kv", self.tile_size_kv)
        for name in ("tile_size_q", "tile_size_kv"):
            if self.coarse_block_size % getattr(self, name):
                fail("BFLAParams", name, f"must divide coarse_block_size={self.coarse_block_size}")
        check_int("BFLAParams", "local_tiles", self.local_tiles)
        check_int("BFLAParams", "sink_tiles", self.sink_tiles)
        check_int("BFLAParams", "stride", self.stride)
        check_fraction("BFLAParams", "random_rescue", self.random_rescue)
        check_int("BFLAParams", "seed", self.seed)
        if self.score_scale is not None and (
            not isinstance(self.score_scale, (int, float)) or isinstance(self.score_scale, bool)
            or not self.score_scale > 0
        ):
            fail("BFLAParams", "score_scale", f"must be a positive number or None, got {self.score_scale!r}")


#: XOR-ed into the seed of the random-rescue hash so that it is independent of the stride-rescue hash.
RANDOM_SALT = 0x5851F42D


def bfla_block_scores(q: torch.Tensor, k: torch.Tensor, block: int, group: int, key_index=None) -> torch.Tensor:
    """Steps 1-2: max-over-group-pairs block scores (B, Hq, ceil(Nq/b), ceil(L/b)) (unscaled, unmasked)."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    cdt = compute_dtype(q)
    dev = q.device
    keys, valid = logical_keys(k, key_index)
    L = keys.shape[2]
    G = block // group
    lq, lk = cdiv(Nq, block), cdiv(L, block)
    pk = torch.nn.functional.pad(keys.to(cdt), (0, 0, 0, lk * block - L)).reshape(B, Hkv, lk * G, group * D)
    qlive = torch.arange(lq * G, device=dev) * group < Nq
    klive = torch.nn.functional.pad(valid, (0, lk * block - L)).view(*valid.shape[:2], lk * G, group).any(-1)
    klive = bcast_heads(klive, Hq)  # (B|1, Hq, lk*G)
    neg = torch.finfo(cdt).min
    out = torch.empty(B, Hq, lq, lk, dtype=cdt, device=dev)
    step = chunk_count(B * Hq * G * lk * G)
    for i0 in range(0, lq, step):
        i1 = min(i0 + step, lq)
        rows = slice(i0 * G, i1 * G)
        qc = q[:, :, i0 * block: min(i1 * block, Nq)].to(cdt)  # cast chunk by chunk
        qc = torch.nn.functional.pad(qc, (0, 0, 0, (i1 - i0) * block - qc.shape[2]))
        z = group_scores(qc.reshape(B, Hq, (i1 - i0) * G, group * D), pk)  # (B, Hq, c*G, lk*G)
        z = torch.where(qlive[rows, None] & klive[:, :, None, :], z, torch.full((), neg, dtype=cdt, device=dev))
        out[:, :, i0:i1] = z.view(B, Hq, i1 - i0, G, lk, G).amax((3, 5))
    return out


def select_bfla(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    p = config.params_of("bfla")
    b, tq, tk = p.coarse_block_size, p.tile_size_q, p.tile_size_kv
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dev = q.device
    tvis = visibility(Nq, Nk, tq, tk, r, B, Hkv, dev)  # per KV head: the tile mask is shared by the group
    tvisible = tvis != VISIBLE_NONE
    if p.mass_threshold >= 1.0:
        return finish_plan(tvisible, tvis, tq, tk, r)

    # stage 1: coarse mass selection per query head, OR-ed over the GQA group
    cvis = visibility(Nq, Nk, b, b, r, B, Hq, dev) != VISIBLE_NONE
    alpha = p.score_scale if p.score_scale is not None else scale
    score = bfla_block_scores(q, k, b, p.group_size, r.key_index) * alpha
    mass = top_mass(masked_softmax(score, cvis), cvis, p.mass_threshold)
    mass = mass.view(B, Hkv, Hq // Hkv, *mass.shape[2:]).any(2)  # (B, Hkv, Lq, Lk)

    # stage 2: expand to tiles, then band, sink and the two rescues
    nqt, nkt = tvis.shape[-2], tvis.shape[-1]
    i = torch.arange(nqt, device=dev)
    j = torch.arange(nkt, device=dev)
    keep = mass[:, :, (i * tq // b)][:, :, :, (j * tk // b)]
    off = Nk - Nq
    first = (off + i * tq) // tk - p.local_tiles
    last = (off + torch.clamp((i + 1) * tq, max=Nq) - 1) // tk
    band = (j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])
    keep = keep | band | (j < p.sink_tiles)
    if p.stride > 0:
        dropped = tvisible & ~keep
        chi = hash32(p.seed, i[:, None], j[None, :])
        keep = keep | (dropped & (chi % p.stride == 0))
    if p.random_rescue > 0:
        dropped = tvisible & ~keep
        psi = hash32(p.seed ^ RANDOM_SALT, torch.arange(Hkv, device=dev)[:, None, None], i[:, None], j[None, :])
        keep = keep | (dropped & (psi < int(p.random_rescue * 2**32)))
    return finish_plan(keep, tvis, tq, tk, r)


# -- GPU fast path: the same plans from Triton kernels ----------------------------------------------------------
def select_bfla_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``bfla.select_bfla`` (flatten-g mass per query head, OR over the group, tile rescue), per KV head."""
    check_selectable(r)
    sel = selection_kernels()
    p = config.params_of("bfla")
    b, tq, tk = p.coarse_block_size, p.tile_size_q, p.tile_size_kv
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = r.key_index.shape[-1] if r.key_index is not None else Nk
    seg = r.segment_size or 0
    tpos = None
    if r.key_index is not None:
        tpos = sel.block_pool(k, tk, key_index=r.key_index, want_mean=False, want_pos=True)
    keep_all = p.mass_threshold >= 1.0
    mass = None
    if not keep_all:
        cpos = None
        if r.key_index is not None:
            cpos = sel.block_pool(k, b, key_index=r.key_index, want_mean=False, want_pos=True)
        score = sel.bfla_block_scores(q, k, b, p.group_size, r.key_index, seg_bound(r))
        mass = sel.mass_select(
            score, batch=B, heads=Hq, kv_heads=Hkv, num_query_blocks=cdiv(Nq, b), num_key_tiles=cdiv(L, b),
            num_queries=Nq, num_keys=Nk, block_m=b, block_n=b,
            scale=p.score_scale if p.score_scale is not None else scale, tau=p.mass_threshold, segment=seg,
            tile_pos=cpos, write_plan=False, write_keep=True, device=q.device,
        )[3]
    tables = sel.bfla_tiles(
        mass, batch=B, kv_heads=Hkv, group=Hq // Hkv, num_queries=Nq, num_keys=Nk, key_len=L, coarse=b,
        tile_q=tq, tile_k=tk, local_tiles=p.local_tiles, sink_tiles=p.sink_tiles, stride=p.stride,
        random_rescue=p.random_rescue, seed=p.seed, tile_pos=tpos, keep_all=keep_all, segment=seg,
        device=q.device,
    )
    return plan_from_tables(tq, tk, tables, r)


register_method(Method(
    name="bfla", params=BFLAParams, select=select_bfla, fast_select=select_bfla_fast,
    select_after=("none", "pbs"), density=DensityKnob("mass_threshold"), keep_all={"mass_threshold": 1.0},
    description="BFLA: flatten-g pooled block mass, then band, sink and stride rescue on the tile grid",
))
