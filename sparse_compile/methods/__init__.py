"""The sparse methods as compositions of a reorder stage and a select stage, each producing a ``BlockPlan``.

``build_plan(q, k, scale, config)`` runs ``config.reorder_stage`` then ``config.select_stage`` (the four named
methods are presets of the pair, see ``SparseConfig``) and returns the plan that ``plan.reference_attention`` and
the Triton kernel execute. Everything here is exact PyTorch, vectorised over batch and heads, deterministic and
free of host syncs; memory is O(N*D) plus block-level tables (and S2O's O(N^2/S) ranked key list).

Stages (papers in ``shared/seeds``; every interpretation choice is documented in the stage's module):

===========  ==================================================================================================
reorder      ``none`` (identity), ``pbs`` (query-aware key permutation in segments, ``reorder.reorder_pbs``),
             ``s2o`` (intra-segment query sort + per-segment ranked causal prefix, ``reorder.reorder_s2o``)
select       ``pbs`` (MeanPooling, PBS App. B.1), ``xattention`` (antidiagonal scoring), ``sparge`` (SpargeAttn
             self-similarity + TopCdf + P.V skip), ``bfla`` (flatten-g mass + tile rescue), ``s2o`` (ranked tiles
             with early stop after a dense intra-segment pass)
===========  ==================================================================================================

Valid pairs: ``none`` or ``pbs`` reorder with the ``pbs``, ``xattention``, ``sparge`` or ``bfla`` selector (a
selector works on any key order; PBS + XAttention is the paper's App. B.2, none + pbs its MeanPooling baseline),
and ``s2o`` + ``s2o`` (the S2O selector needs S2O's ranked key list, and S2O's per-segment lists cannot feed a
selector over one global tiling). Other pairs raise ``ValueError``.

Inputs a method cannot handle raise ``Unsupported(reason)``; the caller runs dense attention instead.

Two implementations of the stages: the PyTorch references (this package's stage modules, the specification) and
the GPU fast path (``fast``: Triton kernels, same plans). ``build_plan`` picks per stage: ``implementation``
(or ``config.planner``) "reference", "fast" (the fast version of every stage that has one; a stage without one,
or a stage replaced through ``register_*``, runs its registered function), or "auto" (fast when the inputs are
on CUDA, Triton imports and the dtype is float16/bfloat16/float32; reference otherwise).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..config import SparseConfig
from ..plan import BlockPlan, causal_tile_count, expand_heads
from ._common import Unsupported
from . import fast
from .bfla import select_bfla
from .pbs import select_pbs
from .reorder import Reordering, reorder_none, reorder_pbs, reorder_s2o
from .s2o import select_s2o
from .sparge import select_sparge
from .xattention import select_xattention

__all__ = [
    "build_plan",
    "plan_density",
    "Unsupported",
    "Reordering",
    "REORDER_STAGES",
    "SELECT_STAGES",
    "VALID_PAIRS",
    "check_stage_pair",
    "register_reorder",
    "register_select",
    "stage_functions",
]

ReorderFn = Callable[[torch.Tensor, torch.Tensor, float, SparseConfig], Reordering]
SelectFn = Callable[[torch.Tensor, torch.Tensor, float, Reordering, SparseConfig], BlockPlan]

#: name -> reorder stage ``fn(q, k, scale, config) -> Reordering``
REORDER_STAGES: dict[str, ReorderFn] = {"none": reorder_none, "pbs": reorder_pbs, "s2o": reorder_s2o}
#: name -> select stage ``fn(q, k, scale, reordering, config) -> BlockPlan``
SELECT_STAGES: dict[str, SelectFn] = {
    "pbs": select_pbs,
    "xattention": select_xattention,
    "sparge": select_sparge,
    "bfla": select_bfla,
    "s2o": select_s2o,
}
#: the (reorder, select) pairs that make sense
VALID_PAIRS: set[tuple[str, str]] = {
    (r, s) for r in ("none", "pbs") for s in ("pbs", "xattention", "sparge", "bfla")
} | {("s2o", "s2o")}


def register_reorder(name: str, fn: ReorderFn, selectors=()) -> None:
    """Add a reorder stage and declare which selectors it pairs with."""
    REORDER_STAGES[name] = fn
    VALID_PAIRS.update((name, s) for s in selectors)


def register_select(name: str, fn: SelectFn, reorders=()) -> None:
    """Add a select stage and declare which reorder stages it pairs with."""
    SELECT_STAGES[name] = fn
    VALID_PAIRS.update((r, name) for r in reorders)


def check_stage_pair(reorder: str, select: str) -> None:
    """ValueError naming the valid pairs unless (reorder, select) is one of them."""
    if reorder not in REORDER_STAGES:
        raise ValueError(f"unknown reorder stage {reorder!r}; valid: {sorted(REORDER_STAGES)}")
    if select not in SELECT_STAGES:
        raise ValueError(f"unknown select stage {select!r}; valid: {sorted(SELECT_STAGES)}")
    if (reorder, select) not in VALID_PAIRS:
        pairs = ", ".join(f"{r}+{s}" for r, s in sorted(VALID_PAIRS))
        raise ValueError(f"reorder {reorder!r} cannot be combined with select {select!r}; valid pairs "
                         f"(reorder+select): {pairs}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, N, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.device != k.device:
        raise ValueError(f"q on {q.device}, k on {k.device}")
    if not (q.is_floating_point() and k.is_floating_point()):
        raise Unsupported(f"floating-point inputs only, got {q.dtype} and {k.dtype}")
    nq, nk = q.shape[2], k.shape[2]
    if nq == 0 or nk == 0:
        raise Unsupported("empty sequence")
    if nq > nk:
        raise Unsupported(f"more queries than keys (Nq={nq} > Nk={nk}): not a causal prefill")


_BUILTIN_REORDER = dict(REORDER_STAGES)
_BUILTIN_SELECT = dict(SELECT_STAGES)


def _use_fast(implementation: str, q: torch.Tensor, k: torch.Tensor) -> bool:
    if implementation == "reference":
        return False
    reason = fast.available(q, k)
    if implementation == "fast":
        if reason is not None:
            raise ValueError(f"build_plan(implementation='fast'): {reason}")
        return True
    # auto: never the interpreter (it exists for tests), only real GPU kernels
    return reason is None and q.is_cuda


def stage_functions(reorder: str, select: str, use_fast: bool):
    """The (reorder, select) functions ``build_plan`` runs: the fast version of a built-in stage when asked."""
    r_fn, s_fn = REORDER_STAGES[reorder], SELECT_STAGES[select]
    if use_fast:
        # only stages still bound to the built-in reference have a fast twin (register_* replaces both)
        if r_fn is _BUILTIN_REORDER.get(reorder) and reorder in fast.FAST_REORDER_STAGES:
            r_fn = fast.FAST_REORDER_STAGES[reorder]
        if s_fn is _BUILTIN_SELECT.get(select) and select in fast.FAST_SELECT_STAGES:
            s_fn = fast.FAST_SELECT_STAGES[select]
    return r_fn, s_fn


def build_plan(q: torch.Tensor, k: torch.Tensor, scale: Optional[float], config: SparseConfig, *,
               implementation: Optional[str] = None) -> BlockPlan:
    """Reorder then select: the ``BlockPlan`` of ``config``'s method for causal attention of ``q`` over ``k``.

    q (B, Hq, Nq, D), k (B, Hkv, Nk, D) with Hq a multiple of Hkv; queries are the last Nq positions (Nq < Nk is
    chunked prefill). ``scale`` is the attention's softmax scale (None: 1/sqrt(D)); the selectors use it too.
    ``implementation`` ("auto", "fast", "reference"; default ``config.planner``) picks the stages' implementation
    (module docstring); "fast" raises ``ValueError`` where the fast path cannot run (CPU without the Triton
    interpreter, float64). Raises ``ValueError`` for an invalid stage pair or malformed inputs and
    ``Unsupported`` when the method cannot handle the input.
    """
    reorder, select = config.reorder_stage, config.select_stage
    check_stage_pair(reorder, select)
    _check_inputs(q, k)
    impl = config.planner if implementation is None else implementation
    if impl not in ("auto", "fast", "reference"):
        raise ValueError(f"build_plan: implementation must be 'auto', 'fast' or 'reference', got {impl!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    r_fn, s_fn = stage_functions(reorder, select, _use_fast(impl, q, k))
    with torch.no_grad():
        r = r_fn(q, k, scale, config)
        return s_fn(q, k, scale, r, config)


def plan_density(plan: BlockPlan, num_queries: int, num_keys: int, num_heads: Optional[int] = None) -> torch.Tensor:
    """Fraction of the causal tiles that ``plan`` lists, per (batch, query head): float32 (B, H).

    The denominator is ``causal_tile_count`` (identity tiling at the plan's block sizes). H is ``num_heads`` if
    given, else the largest head count among the plan's tensors (a per-KV-head plan gives Hkv columns unless
    ``num_heads`` is passed). The numerator counts listed tiles: for S2O it is an upper bound (early stopping
    happens at run time; ``reference_attention(..., return_visited=True)`` counts visited tiles). A plan can
    exceed 1: under a key permutation (PBS) or S2O's query sort, the on-diagonal segment is computed as a full
    square of tiles rather than a triangle.
    """
    heads = num_heads
    if heads is None:
        heads = max(x.shape[1] for x in (plan.tile_counts, plan.key_index, plan.query_index) if x is not None)
    counts = expand_heads(plan.tile_counts, heads).sum(-1, dtype=torch.int64)
    total = causal_tile_count(num_queries, num_keys, plan.block_m, plan.block_n)
    return counts.to(torch.float32) / max(total, 1)
