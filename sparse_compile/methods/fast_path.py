"""Shared pieces of the GPU fast path of the reorder and select stages: the same plans as the PyTorch references,
from Triton kernels.

Each method module's ``*_fast`` stages have the signature of the reference stage they replace and return the same
``Reordering`` / ``BlockPlan`` (same shapes, same tile order, same ``key_index`` layout); the references are the
specification and ``tests/test_selection_fast.py`` checks the agreement. What changes is how the numbers are
computed (``sparse_compile.kernels``: ``pooling``, ``mass``, ``sorting``, ``pbs``, ``bfla``, ``s2o``):

* one pass over Q and over K for all pooled statistics (means, SpargeAttn's self-similarity, the positions of a
  permuted tiling), read through ``key_index`` instead of a permuted copy of K;
* pooled scores only for causally visible tiles, per GQA group without repeating K;
* the cumulative-mass selection fused with writing the plan rows (no boolean tables, no int64 argsorts), driven
  by a ``MassRule`` that each method builds;
* BFLA's flatten-g scores as a tensor-core matmul with a max epilogue, its tile stage fused with the plan;
* PBS's importance in two Triton passes with the in-segment sort fused into the second;
* S2O's per-segment prefix ranking as one radix sort of packed (segment, score, position) keys.

Where exact agreement cannot hold: sums are accumulated in another order than PyTorch's (block means, dot
products, prefix masses), so a quantity that sits on a decision boundary within float32 rounding (a mass exactly
at tau, two keys with scores equal to ~1e-7 relative, a self-similarity exactly at theta) may fall the other way.

Inputs: CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, where bf16 runs in float32 because the
interpreter's bf16 ``tl.dot`` is wrong), in ``kernels.validate.SUPPORTED_DTYPES``. Everything runs without host
synchronisation; host work is shape arithmetic, cached per shape.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.validate import SUPPORTED_DTYPES
from ..plan import BlockPlan
from .scoring import Reordering

__all__ = ["available", "tile_grid", "plan_from_tables", "segment_bound", "check_selectable", "budget_plan"]


def available(device: torch.device, *dtypes: torch.dtype) -> Optional[str]:
    """None when the fast path can run on inputs of ``dtypes`` on ``device``, else the reason it cannot."""
    for dtype in dtypes:
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            return f"dtype {dtype}: the fast path runs {names}"
    try:
        from ..kernels import common  # imports Triton: only when the fast path is asked for
    except Exception as exc:  # noqa: BLE001 - no Triton (or a broken one): the references still work
        return f"Triton unavailable ({type(exc).__name__}: {exc})"
    if device.type != "cuda" and not common.interpreting():
        return "inputs are not on a CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return None


def tile_grid(q_shape: torch.Size, k_shape: torch.Size, device: torch.device, reordering: Reordering, block_m: int,
              block_n: int):
    """The ``kernels.common.TileGrid`` of queries and keys of these (B, H, N, D) shapes on ``device``, in
    ``reordering``'s logical key order."""
    from ..kernels.common import TileGrid

    key_length = reordering.key_index.shape[-1] if reordering.key_index is not None else k_shape[2]
    return TileGrid(batch=q_shape[0], heads=q_shape[1], kv_heads=k_shape[1], num_queries=q_shape[2],
                    num_keys=k_shape[2], key_length=key_length, block_m=block_m, block_n=block_n, device=device)


def segment_bound(reordering: Reordering) -> int:
    """Original positions of logical keys: in order (1), or permuted inside PBS segments (the segment)."""
    return reordering.segment_size if (reordering.key_index is not None and reordering.segment_size) else 1


def check_selectable(reordering: Reordering) -> None:
    """The fast selectors know the layouts of the built-in reorders only (bounds of the causal region)."""
    if reordering.query_index is not None or (reordering.key_index is not None and not reordering.segment_size):
        raise ValueError(f"fast selectors take the 'none' or 'pbs' reorder, got {reordering.name!r}")


def plan_from_tables(block_m: int, block_n: int, tables, reordering: Reordering, **options) -> BlockPlan:
    """The ``BlockPlan`` of ``kernels.common.PlanTables`` in ``reordering``'s order (options: early stop, P.V skip)."""
    return BlockPlan(block_m=block_m, block_n=block_n, tile_offsets=tables.tile_offsets,
                     tile_counts=tables.tile_counts, masked_counts=tables.masked_counts,
                     key_index=reordering.key_index, query_index=reordering.query_index, **options)


def scores_wanted(reordering: Reordering, params, selector: str) -> bool:
    """Whether a fixed-share selector's tile scores are needed (not when ``params.budget`` keeps every tile): the
    selector computes them, then ``budget_plan``. Keys and queries in order (``selector`` names the refusal)."""
    if reordering.key_index is not None or reordering.query_index is not None:
        raise ValueError(f"the {selector} selector takes keys and queries in order (reorder 'none')")
    return params.budget < 1.0


def budget_plan(scores: Optional[torch.Tensor], q, k, reordering: Reordering, params, mass_target: float = 0.0,
                min_budget: float = 0.0) -> BlockPlan:
    """= ``tiles.finish_budget_plan`` on the GPU: ``scores`` (B, Hq, nqb, nkt) float32 tile scores, None where
    ``scores_wanted`` said none are needed, ranked and written into plan rows by ``kernels.budget``."""
    from ..kernels.budget import budget_select

    bs = params.block_size
    tables = budget_select(tile_grid(q.shape, k.shape, q.device, reordering, bs, bs), scores, params.budget,
                           keep_first_key=params.keep_first_block, local=params.local_tiles,
                           mass_target=mass_target, min_budget=min_budget)
    tail = 0 if scores is None else params.exact_tail_blocks * bs  # keep-all: every row is exact already
    return plan_from_tables(bs, bs, tables, reordering, exact_tail=tail)
