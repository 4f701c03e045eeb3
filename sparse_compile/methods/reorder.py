"""Stage 1, reorder: token permutations that are exact by the permutation properties of attention.

A reorder stage returns a ``Reordering``: the logical -> physical key map (``key_index``) and query map
(``query_index``) that the plan carries to the kernel, plus what the select stage needs to know about the
permutation. Causality is never derived from logical positions: selectors ask ``plan.block_visibility`` with
these indices, which works from the ORIGINAL positions.

* ``none``: identity.
* ``pbs``: PBS-Attn query-aware key permutation (Wang et al. 2025, Sec. 3.2-3.3).
* ``s2o``: S2O intra-segment query sort and per-segment causal-prefix key ranking (Zhang et al. 2026, Alg. 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ._common import (
    Unsupported,
    block_mean,
    cdiv,
    chunk_count,
    compute_dtype,
    group_scores,
    segmented_argsort_desc,
)

__all__ = ["Reordering", "S2OLayout", "reorder_none", "reorder_pbs", "reorder_s2o", "pbs_key_importance", "s2o_layout",
           "s2o_segment_tensors"]


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


def reorder_none(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    return Reordering("none")


# ---------------------------------------------------------------------------------------------------------------
# PBS


def pbs_key_importance(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """PBS Eq. (10): s = mean over the last query block's rows of softmax(Q_last K^T * scale), per KV head.

    ``rows`` = the last ``min(rows, Nq)`` query rows (a full block, even when Nq is not a multiple of the block).
    The softmax is causal (a row gives no mass to keys after its own position; with Nq == Nk only keys inside
    the last, always-kept segment are affected). GQA: the mean also runs over the group's query heads, so one
    key order serves the whole group and K/V are permuted once per KV head.
    Never forms the (rows x Nk) matrix whole: two passes over key chunks (log-sum-exp, then the mean).
    Returns (B, Hkv, Nk) in the compute dtype.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    m = Hq // Hkv
    r = min(rows, Nq)
    cdt = compute_dtype(q)
    ql = q[:, :, Nq - r:].to(cdt)  # (B, Hq, r, D)
    qpos = torch.arange(Nq - r, Nq, device=q.device) + (Nk - Nq)  # absolute positions of those rows
    step = chunk_count(B * Hq * r)
    neg = torch.finfo(cdt).min

    def logits(c0: int, c1: int) -> torch.Tensor:
        z = group_scores(ql, k[:, :, c0:c1].to(cdt)) * scale  # (B, Hq, r, c)
        vis = torch.arange(c0, c1, device=q.device)[None, :] <= qpos[:, None]
        return torch.where(vis, z, torch.full((), neg, dtype=cdt, device=q.device)), vis

    # pass 1: running max and sum of exp per row
    mx = torch.full((B, Hq, r), neg, dtype=cdt, device=q.device)
    se = torch.zeros((B, Hq, r), dtype=cdt, device=q.device)
    for c0 in range(0, Nk, step):
        z, vis = logits(c0, min(c0 + step, Nk))
        new = torch.maximum(mx, z.amax(-1))
        se = se * torch.exp(mx - new) + (torch.exp(z - new[..., None]) * vis).sum(-1)
        mx = new
    lse = mx + torch.log(se)
    # pass 2: probabilities, averaged over the rows of every query head of the group
    out = torch.empty((B, Hkv, Nk), dtype=cdt, device=q.device)
    for c0 in range(0, Nk, step):
        c1 = min(c0 + step, Nk)
        z, vis = logits(c0, c1)
        p = torch.exp(z - lse[..., None]) * vis
        out[:, :, c0:c1] = p.view(B, Hkv, m * r, c1 - c0).mean(2)
    return out


def reorder_pbs(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """Query-aware key permutation (PBS Sec. 3.3): keys sorted by descending importance inside segments of S.

    Segments are the first floor(Nk/S) * S keys (paper Sec. 3.2); the trailing Nk mod S keys keep their order.
    Ties keep the original order (stable sort). Queries are not permuted (the paper's main method; the card: with
    GQA, permuting queries would cost per query head). Works for chunked prefill (Nq < Nk): segments are over
    the absolute key positions.
    """
    p = config.pbs
    Nk = k.shape[2]
    s = pbs_key_importance(q, k, scale, p.block_size)
    perm = segmented_argsort_desc(s, p.segment_size, Nk // p.segment_size)
    return Reordering("pbs", key_index=perm.to(torch.int32).contiguous(), segment_size=p.segment_size)


# ---------------------------------------------------------------------------------------------------------------
# S2O


@dataclass(frozen=True)
class S2OLayout:
    """The logical key list of S2O: per segment n, [its own keys, padded to block_n] + [its ranked prefix].

    Pure shape arithmetic (Python ints, no device work), one entry per segment: ``seg_len`` (own keys),
    ``intra_pad`` (own keys rounded up to whole tiles), ``prefix_len`` (= n*S) and ``base`` (offset of the
    segment's part in the list); ``length`` is the list's total length.
    """

    segment: int
    seg_len: tuple[int, ...]
    intra_pad: tuple[int, ...]
    prefix_len: tuple[int, ...]
    base: tuple[int, ...]
    length: int


def s2o_segment_tensors(seg: torch.Tensor, n: int, segment: int, block_n: int):
    """``(base, seg_len, intra_pad)`` of the segments ``seg`` (a device tensor), equal to ``S2OLayout``'s lists.

    Closed forms computed on the device (a host list copied to the GPU could synchronise): only the last segment
    can be short, so every segment before n is full and base[n] = sum_{m<n} (S + mS) = S * n * (n + 1) / 2.
    """
    base = segment * seg * (seg + 1) // 2
    seg_len = torch.clamp(n - seg * segment, max=segment)
    intra_pad = (seg_len + block_n - 1) // block_n * block_n
    return base, seg_len, intra_pad


def s2o_layout(n: int, segment: int, block_n: int) -> S2OLayout:
    g = cdiv(n, segment)
    seg_len = [min(segment, n - i * segment) for i in range(g)]
    intra_pad = [cdiv(x, block_n) * block_n for x in seg_len]
    prefix_len = [i * segment for i in range(g)]
    base, acc = [], 0
    for i in range(g):
        base.append(acc)
        acc += intra_pad[i] + prefix_len[i]
    return S2OLayout(segment, tuple(seg_len), tuple(intra_pad), tuple(prefix_len), tuple(base), acc)


def reorder_s2o(q: torch.Tensor, k: torch.Tensor, scale: float, config) -> Reordering:
    """S2O Algorithm 1 (intra-segment lightweight ranking), laid out as one logical key list for the plan.

    * Segments of S over the sequence; the last one may be shorter (it is treated like the others).
    * Query permutation (if ``sort_queries``): inside each segment, queries sorted by descending
      <Q[t], k_guide>, k_guide = mean of the first segment's keys (per KV head; Eq. 1). Per query head.
    * Key ranking: segment n's causal prefix [0, nS) sorted by descending <q_mean[n], K[t]> (Eq. 2), q_mean[n]
      the mean query of segment n. GQA choice: one ranking per KV group, using the mean of the group's query
      heads' q_mean (= ranking by the group's mean score). Per query head would multiply the (N/S) x N index
      table by the group size; the group shares K/V loads.
    * Logical key list (``key_index``, int32 (B, Hkv, L), L = sum_n (pad(len_n) + nS) ~ N^2 / 2S): for every
      segment its own keys in original order (padded with -1 to a multiple of block_size_kv), then its ranked
      prefix. The select stage points each query block at its segment's part. Memory O(N^2/S) int32: this is
      the paper's KV_perm table itself; at N=128K, S=2048 about 17 MB per KV head.
    Requires Nq == Nk (the paper's segments describe a full prefill).
    """
    p = config.s2o
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Nq != Nk:
        raise Unsupported(f"s2o: needs a full prefill (Nq == Nk), got Nq={Nq}, Nk={Nk}")
    n, S, bn = Nk, p.segment_size, p.block_size_kv
    m = Hq // Hkv
    cdt = compute_dtype(q)
    dev = q.device
    lay = s2o_layout(n, S, bn)
    g = len(lay.seg_len)

    query_index = None
    if p.sort_queries:
        k_guide = k[:, :, : lay.seg_len[0]].to(cdt).mean(2)  # (B, Hkv, D)
        s_q = torch.empty(B, Hq, n, dtype=cdt, device=dev)
        step = chunk_count(B * Hq * D)
        for r0 in range(0, n, step):  # Q cast chunk by chunk
            r1 = min(r0 + step, n)
            qc = q[:, :, r0:r1].to(cdt).view(B, Hkv, m, r1 - r0, D)
            s_q[:, :, r0:r1] = (qc * k_guide[:, :, None, None, :]).sum(-1).view(B, Hq, r1 - r0)
        query_index = segmented_argsort_desc(s_q, S, g).to(torch.int32).contiguous()

    # segment query means, averaged over the GQA group -> (B, Hkv, g, D)
    base, seg_len, intra_pad = s2o_segment_tensors(torch.arange(g, device=dev), n, S, bn)
    q_mean = block_mean(q, S, dtype=cdt).view(B, Hkv, m, g, D).mean(2)

    length = lay.length
    key_index = torch.empty((B, Hkv, length), dtype=torch.int32, device=dev)
    kc = k.to(cdt)
    # segments in chunks: the (chunk, prefix) score table is the only large intermediate
    step = chunk_count(B * Hkv * n)
    for n0 in range(0, g, step):
        n1 = min(n0 + step, g)
        s0 = lay.base[n0]
        s1 = lay.base[n1] if n1 < g else length
        slots = torch.arange(s0, s1, device=dev)
        seg = torch.searchsorted(base, slots, right=True) - 1
        local = slots - base[seg]
        intra = local < intra_pad[seg]
        own = seg * S + local
        own = torch.where(local < seg_len[seg], own, torch.full_like(own, -1))
        plen = (n1 - 1) * S  # longest prefix in this chunk
        if plen > 0:
            sc = torch.matmul(q_mean[:, :, n0:n1], kc[:, :, :plen].transpose(-1, -2))  # (B, Hkv, c, plen)
            # rank only the causal prefix [0, nS): later keys get -inf and sort last (stable)
            lim = torch.arange(n0, n1, device=dev)[:, None] * S
            sc = sc.masked_fill(torch.arange(plen, device=dev)[None, :] >= lim, float("-inf"))
            ranked = torch.argsort(sc, dim=-1, descending=True, stable=True)  # (B, Hkv, c, plen)
            rank = (local - intra_pad[seg]).clamp(0, plen - 1)
            flat = (seg - n0) * plen + rank
            pref = torch.gather(ranked.flatten(2), 2, flat.expand(B, Hkv, -1))
            vals = torch.where(intra, own.expand(B, Hkv, -1), pref)
        else:
            vals = own.expand(B, Hkv, -1)
        key_index[:, :, s0:s1] = vals.to(torch.int32)
    return Reordering("s2o", key_index=key_index, query_index=query_index, extras={"layout": lay})
