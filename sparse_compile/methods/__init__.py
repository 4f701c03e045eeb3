"""The sparse methods, one module each, and ``build_plan``: reorder, then select, into one ``BlockPlan``.

Each module (``pbs``, ``sparge``, ``bfla``, ``s2o``, and our own selectors ``sampled``, ``peak`` and ``antidiag``)
declares its parameters, its stages (each receives its own method's parameters, never the configuration) and ends
with one ``register_method(...)`` call (``registry.py``); importing it below is its one line here. A method
registered from outside the package joins the same way.
``build_plan(q, k, scale, config)`` runs ``config.reorder_stage`` then ``config.select_stage`` and returns the
plan that ``plan.execute_plan`` runs. Everything here is exact PyTorch, vectorised over batch and heads,
deterministic and free of host syncs; memory is O(N*D) plus block-level tables.

A selector works after its own method's reorder and after the reorders it declares (``Method.select_after``):
PBS's permutation feeds the ``pbs``, ``sparge`` and ``bfla`` selectors (any selector on any key order, as the PBS
paper says); ``reorder="none"`` gives a permuting method's selector alone (PBS's MeanPooling baseline); S2O's
per-segment key lists feed only its own selector.

Inputs a method cannot handle raise ``Unsupported(reason)``; the caller runs dense attention instead.

Two implementations of the stages: the PyTorch references (the specification) and the GPU fast path (Triton
kernels, same plans). ``build_plan`` picks per stage: ``implementation`` (or ``config.planner``) "reference", "fast"
(the fast twin of every stage that has one, the reference otherwise), or "auto" (fast when the inputs are on CUDA,
Triton imports and the dtype is float16/bfloat16/float32; reference otherwise).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..plan import BlockPlan, execute_plan
from ..registry import NO_REORDER, check_stage_pair, method_spec
from . import fast_path
from .scoring import Reordering, Unsupported
# the built-in methods, one line each: importing a method's module registers it
from . import antidiag  # noqa: F401,E402
from . import bfla  # noqa: F401,E402
from . import pbs  # noqa: F401,E402
from . import peak  # noqa: F401,E402
from . import s2o  # noqa: F401,E402
from . import sampled  # noqa: F401,E402
from . import sparge  # noqa: F401,E402

__all__ = ["build_plan", "execute", "executor_of", "Unsupported", "Reordering", "stage_functions"]


def _no_reorder(q: torch.Tensor, k: torch.Tensor, scale: float, params) -> Reordering:
    return Reordering(NO_REORDER)


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
    if q.numel() == 0 or k.numel() == 0:
        raise Unsupported(f"empty input (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if nq > nk:
        raise Unsupported(f"more queries than keys (Nq={nq} > Nk={nk}): not a causal prefill")


def _use_fast(implementation: str, q: torch.Tensor, k: torch.Tensor) -> bool:
    if implementation == "reference":
        return False
    reason = fast_path.available(q.device, q.dtype, k.dtype)
    if implementation == "fast":
        if reason is not None:
            raise ValueError(f"build_plan(implementation='fast'): {reason}")
        return True
    # auto: never the interpreter (it exists for tests), only real GPU kernels
    return reason is None and q.is_cuda


def stage_functions(reorder: str, select: str, use_fast: bool) -> tuple[Callable, Callable]:
    """The (reorder, select) functions ``build_plan`` runs: the fast twin of a stage when asked and there is one."""
    if reorder == NO_REORDER:
        reorder_fn = _no_reorder
    else:
        spec = method_spec(reorder)
        reorder_fn = (spec.fast_reorder if use_fast and spec.fast_reorder else spec.reorder)
    spec = method_spec(select)
    select_fn = spec.fast_select if use_fast and spec.fast_select else spec.select
    return reorder_fn, select_fn


def build_plan(q: torch.Tensor, k: torch.Tensor, scale: Optional[float], config, *,
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
    reorder_fn, select_fn = stage_functions(reorder, select, _use_fast(impl, q, k))
    with torch.no_grad():  # each stage receives its own method's parameters, nothing else of the configuration
        reordering = reorder_fn(q, k, scale, None if reorder == NO_REORDER else config.params_of(reorder))
        return select_fn(q, k, scale, reordering, config.params_of(select))


def execute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float, config, *,
            kernel: str, return_visited: bool = False, backend: str = "auto", kernel_options=None):
    """``plan`` through its method's own executor (S2O: segment chunks), else ``plan.execute_plan``; ``backend``
    and ``kernel_options`` as ``execute_plan`` takes them."""
    run, params = executor_of(config)
    return run(q, k, v, plan, scale, *params, kernel=kernel, return_visited=return_visited, backend=backend,
               kernel_options=kernel_options)


def executor_of(config) -> tuple[Callable, tuple]:
    """(what runs ``config``'s method's plans, the arguments it takes after ``scale``): its own executor with its
    parameters (S2O: segment chunks), else ``plan.execute_plan`` with none. Chosen from the configuration alone, so
    a caller holding the tensors calls the executor itself."""
    executor = method_spec(config.select_stage).execute
    if executor is not None:
        return executor, (config.params_of(config.select_stage),)
    return execute_plan, ()
