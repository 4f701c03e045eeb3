"""The ``sparse_prefill`` torch.compile backend: rewrite attention, then hand the graph to Inductor."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch.autograd import forward_ad

from .config import SparseConfig
from .padding import per_forward
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


_LOG_LEVELS = {"": None, "0": None, "false": None, "no": None, "off": None,
               "1": logging.INFO, "true": logging.INFO, "yes": logging.INFO, "on": logging.INFO,
               "info": logging.INFO, "debug": logging.DEBUG}


def log_level() -> Optional[int]:
    """``SPARSE_COMPILE_LOG`` as users write it (case-insensitive): unset, 0/false/no/off: no log; 1/true/yes/on/info:
    INFO; debug: DEBUG. Any other value is an error naming the valid ones."""
    value = os.environ.get(LOG_ENV_VAR, "").strip().lower()
    if value not in _LOG_LEVELS:
        raise ValueError(f"{LOG_ENV_VAR}={os.environ[LOG_ENV_VAR]!r}: unknown value; valid (any case): 1, true, yes, "
                         "on, info, debug to log; 0, false, no, off (or unset) not to")
    return _LOG_LEVELS[value]


def _check_environment() -> None:
    """Every SPARSE_COMPILE_ variable is read when the backend compiles, so a typo fails there, named."""
    try:
        from .kernels.attention import env_backend
    except ImportError:  # no Triton: the variable selects nothing
        return
    env_backend()


def _maybe_enable_logging() -> None:
    level = log_level()
    if level is None:
        return
    if not any(getattr(h, "_sparse_compile", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[sparse_compile] %(message)s"))
        handler._sparse_compile = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)


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
    _check_environment()
    _maybe_enable_logging()
    want_diff = bool(_LISTENERS) or log.isEnabledFor(logging.INFO)
    before = gm.code if want_diff else ""
    original = _graph_copy(gm)
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
    if any(r.rewritten for r in records):
        compiled = _eager_under_transforms(per_forward(compiled), original)
    return compiled


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as Dynamo traced it (sharing gm's parameters and buffers), before any rewrite."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _under_forward_transform() -> bool:
    """Forward-mode AD (a dual level is open) or a torch.func transform is active: the rewritten op has no forward
    derivative nor batching rule (PyTorch's custom ops would drop the tangent silently)."""
    return forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


def _eager_under_transforms(compiled: Callable, original: fx.GraphModule) -> Callable:
    """``compiled``, except that a call under forward AD or a torch.func transform runs the graph as traced (plain
    SDPA, eagerly): what the model does uncompiled, tangents included."""
    boxed = getattr(compiled, "_boxed_call", False)

    def guarded(*args, **kwargs):
        if _under_forward_transform():
            log.debug("forward-mode AD or a torch.func transform is active: running the traced graph eagerly")
            # a boxed call passes one list of inputs (graph inputs are never lists themselves)
            unboxed = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
            return original(*unboxed, **kwargs)
        return compiled(*args, **kwargs)

    guarded._boxed_call = boxed  # Dynamo's calling convention, passed through
    return guarded


def _log_records(records: list[SiteRecord], diff: str) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    rewritten = sum(r.rewritten for r in records)
    log.info("rewrote %d of %d attention sites", rewritten, len(records))
    for r in records:
        log.info("  %-40s q%s %s: %s", r.site, list(r.q_shape), "sparse" if r.rewritten else "dense", r.reason)
    if diff:
        log.info("graph diff:\n%s", diff)
