"""GPU fast path of the reorder and select stages: the same plans as the PyTorch references, from Triton kernels.

Each function here has the signature of the reference stage it replaces and returns the same ``Reordering`` /
``BlockPlan`` (same shapes, same tile order, same ``key_index`` layout); the references are the specification and
``tests/test_selection_fast.py`` checks the agreement. What changes is how the numbers are computed
(``sparse_compile.kernels.selection``):

* one pass over Q and over K for all pooled statistics (means, SpargeAttn's self-similarity, the positions of a
  permuted tiling), read through ``key_index`` instead of a permuted copy of K;
* pooled scores only for causally visible tiles, per GQA group without repeating K;
* the cumulative-mass selection fused with writing the plan rows (no boolean tables, no int64 argsorts);
* BFLA's flatten-g scores as a tensor-core matmul with a max epilogue, its tile stage fused with the plan;
* PBS's importance in two Triton passes with the in-segment sort fused into the second;
* S2O's per-segment prefix ranking as one radix sort of packed (segment, score, position) keys.

Where exact agreement cannot hold: sums are accumulated in another order than PyTorch's (block means, dot
products, prefix masses), so a quantity that sits on a decision boundary within float32 rounding (a mass exactly
at tau, two keys with scores equal to ~1e-7 relative, a self-similarity exactly at theta) may fall the other way.

Inputs: CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, where bf16 runs in float32 because the
interpreter's bf16 ``tl.dot`` is wrong), float16/bfloat16/float32. Everything runs without host synchronisation;
host work is shape arithmetic, cached per shape.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..plan import BlockPlan
from ._common import Unsupported, cdiv
from .reorder import Reordering, s2o_layout

__all__ = [
    "available",
    "FAST_DTYPES",
    "FAST_REORDER_STAGES",
    "FAST_SELECT_STAGES",
    "reorder_none_fast",
    "reorder_pbs_fast",
    "reorder_s2o_fast",
    "select_pbs_fast",
    "select_sparge_fast",
    "select_bfla_fast",
    "select_s2o_fast",
]

FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def _selection():
    from ..kernels import selection  # imports Triton: only when the fast path is used

    return selection


def available(q: torch.Tensor, k: torch.Tensor) -> Optional[str]:
    """None when the fast path can run on these inputs, else the reason it cannot."""
    if q.dtype not in FAST_DTYPES or k.dtype not in FAST_DTYPES:
        return f"dtype {q.dtype}: the fast path runs float16, bfloat16 and float32"
    try:
        sel = _selection()
    except Exception as exc:  # noqa: BLE001 - no Triton (or a broken one): the references still work
        return f"Triton unavailable ({type(exc).__name__}: {exc})"
    if not q.is_cuda and not sel.interpreting():
        return "inputs are not on a CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return None


def _seg_bound(r: Reordering) -> int:
    # original positions of logical keys: in order, or permuted inside PBS segments
    return r.segment_size if (r.key_index is not None and r.segment_size) else 1


def _check_selectable(r: Reordering) -> None:
    # the fast selectors know the layouts of the built-in reorders only (bounds of the causal region)
    if r.query_index is not None or (r.key_index is not None and not r.segment_size):
        raise ValueError(f"fast selectors take the 'none' or 'pbs' reorder, got {r.name!r}")


# ---------------------------------------------------------------------------------------------------------------
# reorder stages


def reorder_none_fast(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    return Reordering("none")


def reorder_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """= ``reorder.reorder_pbs``: importance of the last query block, keys sorted inside segments."""
    p = config.pbs
    perm = _selection().pbs_key_permutation(q, k, scale, p.block_size, p.segment_size)
    return Reordering("pbs", key_index=perm, segment_size=p.segment_size)


@functools.lru_cache(maxsize=64)
def _s2o_width(n: int, segment: int, block_n: int):
    lay = s2o_layout(n, segment, block_n)
    width = max(a // block_n + b // block_n for a, b in zip(lay.intra_pad, lay.prefix_len))
    return lay, width


def reorder_s2o_fast(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """= ``reorder.reorder_s2o``: query sort inside segments, ranked causal prefixes, the logical key list."""
    p = config.s2o
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Nq != Nk:
        raise Unsupported(f"s2o: needs a full prefill (Nq == Nk), got Nq={Nq}, Nk={Nk}")
    sel = _selection()
    n, S, bn = Nk, p.segment_size, p.block_size_kv
    lay, _ = _s2o_width(n, S, bn)
    g = len(lay.seg_len)
    # k_guide (B, Hkv, D): the first segment's mean key (one reduction, float32 accumulation)
    guide = k[:, :, : lay.seg_len[0]].mean(2, dtype=torch.float32) if p.sort_queries else None
    # one pass over Q: per-head segment means (for the key ranking) and <Q[t], k_guide> sorted inside each
    # segment by the same program (the query order)
    pool = sel.block_pool(q, S, guide=guide, sort_guide=True)
    query_index = pool["order"] if p.sort_queries else None
    # the GQA group's mean of the segment means, once (averaging inside the ranking kernel re-read every head's
    # means in every program: 0.41 -> 0.58 ms at 128K, NOTES_selection.md)
    q_mean = pool["mean"].view(B, Hkv, Hq // Hkv, g, D).mean(2)
    ranked, tb = sel.s2o_rank_keys(k, q_mean, S)
    key_index = sel.s2o_assemble(ranked, tb, n, S, bn, lay.length)
    return Reordering("s2o", key_index=key_index, query_index=query_index, extras={"layout": lay})


# ---------------------------------------------------------------------------------------------------------------
# select stages


def _plan(bm, bn, tables, r: Reordering, **options) -> BlockPlan:
    offs, cnt, msk = tables[:3]
    return BlockPlan(block_m=bm, block_n=bn, tile_offsets=offs, tile_counts=cnt, masked_counts=msk,
                     key_index=r.key_index, query_index=r.query_index, **options)


def select_pbs_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``pbs.select_pbs`` (MeanPooling block selection)."""
    _check_selectable(r)
    sel = _selection()
    p = config.pbs
    bs = p.block_size
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = r.key_index.shape[-1] if r.key_index is not None else Nk
    nqb, nkt = cdiv(Nq, bs), cdiv(L, bs)
    keep_all = p.threshold >= 1.0
    kpool = None
    if r.key_index is not None or not keep_all:
        kpool = sel.block_pool(k, bs, key_index=r.key_index, want_mean=not keep_all,
                               want_pos=r.key_index is not None)
    logits = None
    if not keep_all:
        qbar = sel.block_pool(q, bs)["mean"]
        logits = sel.pooled_logits(qbar, kpool["mean"], block_m=bs, block_n=bs, num_queries=Nq, num_keys=Nk,
                                   seg_bound=_seg_bound(r))
    seg = r.segment_size or 0
    tables = sel.mass_select(
        logits, batch=B, heads=Hq, kv_heads=Hkv, num_query_blocks=nqb, num_key_tiles=nkt, num_queries=Nq,
        num_keys=Nk, block_m=bs, block_n=bs, scale=scale, tau=p.threshold, segment=seg,
        tile_pos=kpool if r.key_index is not None else None, exclude_diag=seg > 0, force_diag=True,
        force_first=p.keep_first_block, keep_all=keep_all, device=q.device,
    )
    return _plan(bs, bs, tables, r)


def select_sparge_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``sparge.select_sparge`` (self-similarity judge + TopCdf; P.V skip to the plan)."""
    _check_selectable(r)
    sel = _selection()
    p = config.sparge
    bm, bn = p.block_size_q, p.block_size_kv
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    L = r.key_index.shape[-1] if r.key_index is not None else Nk
    nqb, nkt = cdiv(Nq, bm), cdiv(L, bn)
    keep_all = p.cdf_threshold >= 1.0
    kpool = None
    if r.key_index is not None or not keep_all:
        kpool = sel.block_pool(k, bn, key_index=r.key_index, want_mean=not keep_all, want_sim=not keep_all,
                               want_pos=r.key_index is not None)
    logits = judge = None
    if not keep_all:
        qpool = sel.block_pool(q, bm, want_sim=True)
        logits = sel.pooled_logits(qpool["mean"], kpool["mean"], block_m=bm, block_n=bn, num_queries=Nq,
                                   num_keys=Nk, seg_bound=_seg_bound(r))
        judge = (kpool["sim"], qpool["sim"], p.similarity_threshold)
    tables = sel.mass_select(
        logits, batch=B, heads=Hq, kv_heads=Hkv, num_query_blocks=nqb, num_key_tiles=nkt, num_queries=Nq,
        num_keys=Nk, block_m=bm, block_n=bn, scale=scale, tau=p.cdf_threshold, segment=r.segment_size or 0,
        tile_pos=kpool if r.key_index is not None else None, force_diag=True, judge=judge, keep_all=keep_all,
        device=q.device,
    )
    return _plan(bm, bn, tables, r, pv_skip=p.pv_threshold)


def select_bfla_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``bfla.select_bfla`` (flatten-g mass per query head, OR over the group, tile rescue), per KV head."""
    _check_selectable(r)
    sel = _selection()
    p = config.bfla
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
        score = sel.bfla_block_scores(q, k, b, p.group_size, r.key_index, _seg_bound(r))
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
    return _plan(tq, tk, tables, r)


def select_s2o_fast(q: torch.Tensor, k: torch.Tensor, scale: float, r: Reordering, config) -> BlockPlan:
    """= ``s2o.select_s2o``: intra-segment masked tiles, then the ranked prefix; early stop in the kernel."""
    p = config.s2o
    lay = r.extras["layout"]
    B, Hq, N, _ = q.shape
    Hkv = k.shape[1]
    _, width = _s2o_width(N, lay.segment, p.block_size_kv)
    heads = Hq if r.query_index is not None else Hkv
    tables = _selection().s2o_select(r.query_index, batch=B, heads=heads, n=N, segment=lay.segment,
                                     block_m=p.block_size_q, block_n=p.block_size_kv, width=width, device=q.device)
    return _plan(p.block_size_q, p.block_size_kv, tables, r, early_stop=float(p.early_stop))


#: reference stage name -> fast version (same signature)
FAST_REORDER_STAGES = {"none": reorder_none_fast, "pbs": reorder_pbs_fast, "s2o": reorder_s2o_fast}
FAST_SELECT_STAGES = {"pbs": select_pbs_fast, "sparge": select_sparge_fast, "bfla": select_bfla_fast,
                      "s2o": select_s2o_fast}
