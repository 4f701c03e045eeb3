"""The ``sparse_prefill`` torch.compile backend: rewrite attention, then hand the graph to Inductor."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch.fx as fx

from .config import SparseConfig
from .report import SiteRecord
from .rewrite import rewrite_graph

__all__ = ["sparse_prefill", "on_rewrite", "LOG_ENV_VAR"]

log = logging.getLogger("sparse_compile")
LOG_ENV_VAR = "SPARSE_COMPILE_LOG"

_LISTENERS: list = []  # callbacks of the on_rewrite blocks in force


@contextlib.contextmanager
def on_rewrite(callback: Callable[[list, str], None]) -> Iterator[None]:
    """Inside the block, ``callback(records, diff)`` is called for every graph the backend compiles: the per-site
    ``SiteRecord`` list and the unified diff of the graph before and after the rewrite (what ``explain`` shows)."""
    _LISTENERS.append(callback)
    try:
        yield
    finally:
        _LISTENERS.remove(callback)


def graph_diff(before: str, after: str, name: str = "graph") -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"{name} (before)", tofile=f"{name} (after sparse rewrite)",
    )
    return "".join(lines)


def _maybe_enable_logging() -> None:
    level = os.environ.get(LOG_ENV_VAR, "")
    if not level or level == "0":
        return
    if not any(getattr(h, "_sparse_compile", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[sparse_compile] %(message)s"))
        handler._sparse_compile = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.DEBUG if level.lower() == "debug" else logging.INFO)


def sparse_prefill(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: Optional[str] = None,
    options: Optional[Mapping[str, Any]] = None,
):
    """``torch.compile(model, backend="sparse_prefill", options={...})``.

    ``options`` keys are ``SparseConfig`` fields (an unknown key is an error naming the valid ones). Eligible
    causal self-attention calls become ``torch.ops.sparse_compile.causal_attention``; everything else, and the
    rewritten graph, is compiled by Inductor (``compile_fx``) with ``mode``'s Inductor options.
    """
    config = SparseConfig.from_options(options)
    _maybe_enable_logging()
    want_diff = bool(_LISTENERS) or log.isEnabledFor(logging.INFO)
    before = gm.code if want_diff else ""
    records = rewrite_graph(gm, config)
    diff = graph_diff(before, gm.code) if want_diff else ""
    _log_records(records, diff)
    for listener in list(_LISTENERS):
        listener(records, diff)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    if any(r.rewritten for r in records):
        from .ops import precompile_kernels

        precompile_kernels(gm, config)
    patches = list_mode_options(mode) if mode else None
    compiled = compile_fx(gm, example_inputs, config_patches=patches)
    left_as_sdpa = [r for r in records if not r.rewritten]
    if left_as_sdpa:  # plain SDPA cannot follow sequence_parallel: refuse there rather than attend within a chunk
        from .parallel import refuse_under_sequence_parallel

        compiled = refuse_under_sequence_parallel(compiled, left_as_sdpa)
    return compiled


def _log_records(records: list[SiteRecord], diff: str) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    rewritten = sum(r.rewritten for r in records)
    log.info("rewrote %d of %d attention sites", rewritten, len(records))
    for r in records:
        log.info("  %-40s q%s %s: %s", r.site, list(r.q_shape), "sparse" if r.rewritten else "dense", r.reason)
    if diff:
        log.info("graph diff:\n%s", diff)
