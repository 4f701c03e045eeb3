"""Shared pieces of the GPU fast path of the reorder and select stages: the same plans as the PyTorch references, from Triton kernels.

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
from ._common import Reordering

__all__ = ["available", "FAST_DTYPES", "selection_kernels", "plan_from_tables", "seg_bound", "check_selectable"]

FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def selection_kernels():
    from ..kernels import selection  # imports Triton: only when the fast path is used

    return selection


def available(q: torch.Tensor, k: torch.Tensor) -> Optional[str]:
    """None when the fast path can run on these inputs, else the reason it cannot."""
    if q.dtype not in FAST_DTYPES or k.dtype not in FAST_DTYPES:
        return f"dtype {q.dtype}: the fast path runs float16, bfloat16 and float32"
    try:
        sel = selection_kernels()
    except Exception as exc:  # noqa: BLE001 - no Triton (or a broken one): the references still work
        return f"Triton unavailable ({type(exc).__name__}: {exc})"
    if not q.is_cuda and not sel.interpreting():
        return "inputs are not on a CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return None


def seg_bound(r: Reordering) -> int:
    # original positions of logical keys: in order, or permuted inside PBS segments
    return r.segment_size if (r.key_index is not None and r.segment_size) else 1


def check_selectable(r: Reordering) -> None:
    # the fast selectors know the layouts of the built-in reorders only (bounds of the causal region)
    if r.query_index is not None or (r.key_index is not None and not r.segment_size):
        raise ValueError(f"fast selectors take the 'none' or 'pbs' reorder, got {r.name!r}")


def plan_from_tables(bm, bn, tables, r: Reordering, **options) -> BlockPlan:
    offs, cnt, msk = tables[:3]
    return BlockPlan(block_m=bm, block_n=bn, tile_offsets=offs, tile_counts=cnt, masked_counts=msk,
                     key_index=r.key_index, query_index=r.query_index, **options)


