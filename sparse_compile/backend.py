"""The ``sparse_prefill`` torch.compile backend: rewrite attention, then hand the graph to Inductor."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import logging
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from . import report
from .config import SparseConfig
from .eager_attention import EAGER_RULE, FUSED_RULE, SOFTCAP_RULE, find_eager_attention, is_eager
from .padding import forward_scope
from .report import SiteRecord
from .rewrite import reads_mutated_input, rewrite_graph
from .rules import forward_transform
from .state import STATE
from .transformers_attention import register as register_transformers_attention

__all__ = ["sparse_prefill", "on_rewrite", "CompiledGraph", "LOG_ENV_VAR", "OptionsError"]

log = logging.getLogger("sparse_compile")
LOG_ENV_VAR = "SPARSE_COMPILE_LOG"

# callbacks of the on_rewrite blocks in force: each block removes its own at its end, so a reset leaves them
_LISTENERS: list = STATE.add("backend.listeners", [], kept="each on_rewrite block removes its own callback")


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


log_level()  # a bad SPARSE_COMPILE_LOG fails at import, in one line (the backend reads it again at each compile)


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


try:  # Dynamo re-raises these from a backend as they are, where it wraps any other error in BackendCompilerFailed
    from torch._dynamo.exc import ShortenTraceback as _PassedThrough
except ImportError:  # pragma: no cover - older torch: the error arrives wrapped
    _PassedThrough = None

if _PassedThrough is not None:
    class OptionsError(ValueError, _PassedThrough):  # type: ignore[misc]
        """Invalid ``sparse_prefill`` options: a ``ValueError`` that reaches the caller of the compiled model as it
        is (torch.compile calls the backend, with its options, only at the first call)."""

        first_useful_frame = None  # the backend's frame, set where raised: Dynamo's frames are cut from the traceback

        # Dynamo appends advice for reporting its own bugs to any error carrying the traced user stack: this one
        # is about options, so it takes no stack
        real_stack = property(lambda self: _no_stack(), lambda self, value: None)

    def _no_stack():
        raise AttributeError("real_stack")
else:  # pragma: no cover
    class OptionsError(ValueError):  # type: ignore[no-redef]
        """Invalid ``sparse_prefill`` options."""


# explain() reports every site itself: no warnings from the graphs it compiles
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("sparse_compile_quiet", default=False)


def sparse_prefill(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: Optional[str] = None,
    options: Optional[Mapping[str, Any]] = None,
):
    """``torch.compile(model, backend="sparse_prefill", options={...})``.

    ``options`` keys are ``SparseConfig`` fields, or parameters of the configured method (``{"threshold": 0.5}``
    for pbs), the names ``sparsity(...)`` takes; an unknown key is an ``OptionsError`` (a ``ValueError``) naming
    the valid ones, raised at the first call (torch.compile hands the options to the backend only then). Eligible
    causal self-attention calls become ``torch.ops.sparse_compile.causal_attention``; everything else, and the
    rewritten graph, is compiled by Inductor (``compile_fx``) with ``mode``'s Inductor options. Attention sites
    kept as plain SDPA, and attention the graph computes without SDPA (matmul, softmax, matmul: never rewritten),
    are listed in ``runtime_stats()`` with the reason, their calls counted, and one warning per graph names them.
    """
    try:
        config = SparseConfig.from_options(options)
    except ValueError as exc:
        error = OptionsError(str(exc))
        error.first_useful_frame = sys._getframe()
        raise error from None
    _check_environment()
    _maybe_enable_logging()
    register_transformers_attention()  # the front door's name too, now that transformers may be imported
    want_diff = bool(_LISTENERS) or log.isEnabledFor(logging.INFO)
    before = gm.code if want_diff else ""
    original = _graph_copy(gm)
    records = rewrite_graph(gm, config)
    records += find_eager_attention(gm)  # attention computed by hand: listed and warned about, never rewritten
    diff = graph_diff(before, gm.code) if want_diff else ""
    _log_records(records, diff)
    for listener in list(_LISTENERS):
        listener(records, diff)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    if any(r.rewritten for r in records):
        from .api import precompile_kernels

        precompile_kernels(gm, config)
    patches = list_mode_options(mode) if mode else None
    compiled = compile_fx(gm, example_inputs, config_patches=patches)
    rewritten = any(r.rewritten for r in records)
    compiled = CompiledGraph(compiled, original if rewritten else None,
                             [r for r in records if not r.rewritten],
                             per_forward=rewritten and not reads_mutated_input(gm))
    if not _QUIET.get():
        _warn_plain_sdpa(gm, records)
        _warn_recompile_limit(gm, records)
    return compiled


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as Dynamo traced it (sharing gm's parameters and buffers), before any rewrite."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


class CompiledGraph:
    """What the backend hands Dynamo: Inductor's compiled graph, and around each call the package's steps, in the
    order ``__call__`` takes them."""

    def __init__(self, compiled: Callable, traced: Optional[fx.GraphModule], left_as_sdpa: Sequence[SiteRecord],
                 *, per_forward: bool):
        self.compiled = compiled
        self.traced = traced  # the graph before the rewrite, where a site was rewritten
        self.per_forward = per_forward
        # sites kept as plain SDPA: registered now, counted per call (a plain SDPA call has no hook of its own)
        self.plain_sdpa = tuple((r.site, r.reason, _shape_of(r.q_shape),
                                 _KEPT.get(r.rule, report.PLAIN_SDPA_REASON) + r.reason) for r in left_as_sdpa)
        for r in left_as_sdpa:
            report.register_plain_sdpa(r.site, r.reason)
        self.refusal = "; ".join(f"{r.site}: {r.reason}" for r in left_as_sdpa)
        self._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo's calling convention, passed through

    def __call__(self, *args, **kwargs):
        # 1. forward AD or a torch.func transform: the traced graph, eagerly (the rewritten op has no forward
        #    derivative nor batching rule: a custom op would drop a tangent silently), what the model does uncompiled
        if self.traced is not None and forward_transform() is not None:
            log.debug("forward-mode AD or a torch.func transform is active: running the traced graph eagerly")
            # a boxed call passes one list of inputs (graph inputs are never lists themselves)
            unboxed = args[0] if self._boxed_call and len(args) == 1 and isinstance(args[0], list) else args
            return self.traced(*unboxed, **kwargs)
        # 2. plain SDPA cannot follow sequence_parallel: refuse there rather than attend within a chunk
        if self.refusal:
            from .parallel import refuse_plain_sdpa_under_sequence_parallel

            refuse_plain_sdpa_under_sequence_parallel(self.refusal, args, kwargs)
        # 3. every site kept as plain SDPA: one dense call each
        if self.plain_sdpa:
            report.record_plain_sdpa_calls(self.plain_sdpa)
        # 4. the graph, with a mask's summary read once per call (unless the graph writes that mask in place)
        if not self.per_forward:
            return self.compiled(*args, **kwargs)
        with forward_scope():
            return self.compiled(*args, **kwargs)


# -- sites kept as plain SDPA: listed, counted, and said once per graph -----------------------------------------
def _shape_of(shape: tuple) -> tuple:
    # the compile-time shape, a symbolic size by its name (no SymInt, and so no shape environment, is kept alive)
    return tuple(d if isinstance(d, int) else str(d) for d in shape)


# how a call's reason starts where the site is no SDPA call (else report.PLAIN_SDPA_REASON)
_KEPT = {rule: "left dense at compile time: " for rule in (EAGER_RULE, SOFTCAP_RULE, FUSED_RULE)}

# What the user can do about a site kept as plain SDPA, by the rewrite rule it failed (``rules.REWRITE_RULES``).
_REMEDIES = {
    "causal": "for causal attention pass is_causal=True, or build the causal mask inside the compiled function",
    "mask_proven": "build the mask inside the compiled function from the inputs' sizes, or pass it in as a 4-D "
                   "bool or float tensor (a graph input is checked at run time), or pass is_causal=True without a "
                   "mask",
    "no_dropout": "call model.eval() (attention dropout must be off)",
    "inference": "run under torch.no_grad() or torch.inference_mode()",
    "dtype": "run attention in float16, bfloat16 or float32",
    "heads": "pass enable_gqa=True to scaled_dot_product_attention",
    EAGER_RULE: "compute it with torch.nn.functional.scaled_dot_product_attention; a transformers model: set "
                "attn_implementation='sdpa' where the model supports it",
    FUSED_RULE: "project q, k, v yourself and call torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                "is_causal=True)",
}

_WARNED_LOCK = STATE.lock("backend.warned_lock")
# Dynamo frame id -> warnings given for its graphs (a recompile says nothing new); the least recently compiled
# frame forgotten past WARNED_FRAMES (a frame compiled again after that may repeat its warning once)
WARNED_FRAMES = 256
_WARNED = STATE.lru("backend.warned", WARNED_FRAMES)


def _compile_id(gm: fx.GraphModule):
    cid = gm.meta.get("dynamo_compile_id") if hasattr(gm, "meta") else None
    if cid is None:
        try:
            from torch._guards import CompileContext

            cid = CompileContext.current_compile_id()
        except Exception:  # pragma: no cover - outside Dynamo, or another torch
            cid = None
    return cid if getattr(cid, "frame_compile_id", None) is not None else None


def _first_time(gm: fx.GraphModule, message: Any) -> bool:
    """False when an earlier graph of the same Dynamo frame already gave ``message``."""
    cid = _compile_id(gm)
    if cid is None:
        return True
    with _WARNED_LOCK:
        if cid.frame_compile_id == 0:  # a frame's first compile (frame ids restart after torch._dynamo.reset())
            _WARNED.pop(cid.frame_id, None)
        given = _WARNED.get(cid.frame_id)
        if given is None:
            given = set()
            _WARNED.put(cid.frame_id, given)
        if message in given:
            return False
        given.add(message)
        return True


def _warn_plain_sdpa(gm: fx.GraphModule, records: list[SiteRecord]) -> None:
    """One warning per graph naming its sites that will never run sparse, why, and what to do. Not said: sites the
    user left dense (skip_layers) and decode steps (one query: nothing to gain)."""
    unexpected = [r for r in records if not r.rewritten and r.rule != "layer_selected"
                  and not (len(r.q_shape) >= 3 and isinstance(r.q_shape[-2], int) and r.q_shape[-2] == 1)]
    if not unexpected:
        return
    lines = []
    for r in unexpected:
        remedy = _REMEDIES.get(r.rule)
        lines.append(f"  {r.site}: {r.reason}" + (f" (to run it sparse: {remedy})" if remedy else ""))
    how = "stay plain SDPA" if not any(map(is_eager, unexpected)) else "stay dense"
    message = (f"sparse_compile: {len(unexpected)} of {len(records)} attention sites of this compiled graph {how} "
               f"and will never run sparse:\n" + "\n".join(lines) +
               "\nruntime_stats() lists them (SiteRuntime.plain_sdpa); sparse_compile.explain(model, *inputs) shows "
               "every site and the graph diff")
    if _first_time(gm, message):
        warnings.warn(message, UserWarning, stacklevel=2)


def _warn_recompile_limit(gm: fx.GraphModule, records: list[SiteRecord]) -> None:
    """Dynamo runs a frame eagerly once it has compiled it ``recompile_limit`` times: from then on, calls that match
    none of its compiled versions run plain dense attention and no sparse op is ever called to say so. Warn at the
    last compile Dynamo allows."""
    cid = _compile_id(gm)
    if cid is None:
        return
    # a torch.compile(recompile_limit=...) is patched in here; older torch names it cache_size_limit
    name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(torch._dynamo.config, n)), None)
    try:
        limit = int(getattr(torch._dynamo.config, name))
    except (TypeError, ValueError):  # pragma: no cover
        return
    if cid.frame_compile_id + 1 != limit:
        return
    where, cause = _frame_and_recompile_reason()
    rewritten = sum(r.rewritten for r in records)
    # a frame without attention matters too: the frames it calls (a layer's attention after a graph break) are
    # then run, and compiled again, from eager code
    what = (f"this graph's {len(records)} attention sites ({rewritten} rewritten) then run plain dense SDPA, never "
            "sparse, with nothing in runtime_stats()" if records else
            "attention that this frame reaches then runs uncompiled, dense, where no other compiled frame takes it")
    message = (f"sparse_compile: Dynamo has now compiled {where} {limit} times, torch._dynamo.config.{name} "
               f"({limit}): calls that match none of its compiled versions now run eagerly, and {what}. {cause}"
               f"Raise torch._dynamo.config.{name}, or stop the recompiles: TORCH_LOGS=recompiles gives each "
               "reason; a size that changes between calls can be marked dynamic (torch._dynamo.mark_dynamic, or "
               "torch.compile(..., dynamic=True))")
    if _first_time(gm, ("recompile_limit", cid.frame_compile_id)):  # once, whichever of the frame's graphs
        warnings.warn(message, UserWarning, stacklevel=2)


def _frame_and_recompile_reason() -> tuple[str, str]:
    """The function Dynamo is compiling and why it recompiles, where this torch says (else generic words)."""
    where, cause = "this function", ""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
        where = f"{code.co_name!r} ({code.co_filename}:{code.co_firstlineno})"
    except Exception:
        pass
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
        if reason:
            guard = reason.splitlines()[0].split("#")[0].strip()
            cause = f"The last recompile was caused by the guard failure {guard!r}. "
    except Exception:
        pass
    return where, cause


def _log_records(records: list[SiteRecord], diff: str) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    rewritten = sum(r.rewritten for r in records)
    log.info("rewrote %d of %d attention sites", rewritten, len(records))
    for r in records:
        log.info("  %-40s q%s %s: %s", r.site, list(r.q_shape), "sparse" if r.rewritten else "dense", r.reason)
    if diff:
        log.info("graph diff:\n%s", diff)
