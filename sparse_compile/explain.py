"""``explain(model, *args)``: compile with the backend, run once, and report every attention site."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import backend as _backend
from .config import SparseConfig
from .report import SiteRecord, SiteRuntime, runtime_stats

__all__ = ["explain", "ExplainReport"]


@dataclass
class ExplainReport:
    """One row per attention site (module path, shapes, decision, reason) and the graph diff.

    ``sites``: compile-time records; ``runtime``: what the example call did at each site (path, reason,
    density per head); ``diff``: unified diff of each traced graph before and after the rewrite.
    """

    config: SparseConfig
    sites: list[SiteRecord] = field(default_factory=list)
    runtime: dict[str, SiteRuntime] = field(default_factory=dict)
    diff: str = ""
    output: Any = None
    config_from: str = "the default configuration"  # where ``config`` came from

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten for r in self.sites)

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.sites:
            rt = self.runtime.get(r.site) if r.rewritten else None
            rows.append({
                "site": r.site,
                "q shape": "x".join(map(str, r.q_shape)),
                "kv shape": "x".join(map(str, r.k_shape)),
                "dtype": r.dtype,
                "rewrite": "sparse op" if r.rewritten else "left dense",
                "run": (rt.last_path if rt else "dense"),
                "reason": (rt.last_reason if rt else r.reason),
                "density": (f"{rt.mean_density:.3f}" if rt and rt.mean_density is not None else ""),
            })
        return rows

    def table(self) -> str:
        from tabulate import tabulate

        rows = self.rows()
        if not rows:
            return "no scaled_dot_product_attention call was traced"
        return tabulate(rows, headers="keys", tablefmt="simple")

    def __str__(self) -> str:
        head = (f"sparse_compile.explain: {self.rewritten} of {len(self.sites)} attention sites rewritten "
                f"(method {self.config.method}, min_seq_len {self.config.min_seq_len}; {self.config_from})")
        return f"{head}\n\n{self.table()}\n\n{self.diff or '(graph unchanged)'}"


def _delta(before: dict[str, SiteRuntime], after: dict[str, SiteRuntime]) -> dict[str, SiteRuntime]:
    out = {}
    for site, entry in after.items():
        old = before.get(site)
        calls = entry.calls - (old.calls if old else type(entry.calls)())
        if not calls:
            continue
        count = entry.density_count - (old.density_count if old else 0)
        total = entry.density_sum - (old.density_sum if old else 0.0)
        out[site] = SiteRuntime(calls, entry.last_shape, entry.last_path, entry.last_reason, total, count,
                                entry.last_density_per_head if count else None, entry.plain_sdpa)
    return out


def explain(model, *args, config: Optional[SparseConfig] = None, **kwargs) -> ExplainReport:
    """Compile ``model`` with ``sparse_prefill``, run ``model(*args, **kwargs)`` once under ``torch.no_grad()``,
    and return what was rewritten, what ran sparse or dense and why, the density, and the graph diff.

    ``model`` may be the model itself or what ``torch.compile(model, backend="sparse_prefill", options=...)`` or
    ``model.compile(...)`` made of it: the uncompiled model is explained, with the options it was compiled with.
    ``config`` (keyword only) is the ``SparseConfig`` to explain instead; density recording is switched on for the
    run.
    """
    target, holder = _uncompiled(model)
    config_from = "the given config"
    if config is None:
        found, options = _backend_options(holder) if holder is not None else (False, None)
        config = SparseConfig.from_options(options) if found else SparseConfig()
        config_from = "the compiled model's options" if found else "the default configuration"
    config = config.replace(record_density=True)
    report = ExplainReport(config=config, config_from=config_from)
    diffs: list[str] = []

    def listener(records, diff):
        report.sites.extend(records)
        if diff:
            diffs.append(diff)

    def backend(gm, example_inputs):
        return _backend.sparse_prefill(gm, example_inputs, options=config)

    compiled = torch.compile(target, backend=backend)
    before = runtime_stats()
    quiet = _backend._QUIET.set(True)  # the report says what the warnings would
    try:
        with _backend.on_rewrite(listener), torch.no_grad():
            report.output = compiled(*args, **kwargs)
    finally:
        _backend._QUIET.reset(quiet)
    report.runtime = _delta(before, runtime_stats())
    report.diff = "\n".join(diffs)
    return report


def _uncompiled(model) -> tuple[Any, Any]:
    """What torch.compile wrapped (a module's uncompiled call for ``model.compile()``), and the object that holds
    the backend torch.compile was given (None for a model that was not compiled)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        inner, _ = _uncompiled(model._orig_mod)
        return inner, model.dynamo_ctx
    if isinstance(model, torch.nn.Module) and getattr(model, "_compiled_call_impl", None) is not None:
        return model._call_impl, model._compiled_call_impl  # model.compile(): its own call, not the compiled one
    original = getattr(model, "_torchdynamo_orig_callable", None)  # a compiled function
    if original is not None:
        return original, model
    return model, None


def _is_sparse_prefill(fn) -> bool:
    for _ in range(8):
        if fn is _backend.sparse_prefill:
            return True
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            return False
    return False


def _backend_options(holder) -> tuple[bool, Any]:
    """Whether ``holder`` (what torch.compile returned, or its context) compiles with ``sparse_prefill``, and the
    options it was given. torch.compile keeps a named or callable backend and its options in a small wrapper
    (``compiler_fn``, ``kwargs``) a few attributes or closure cells deep; searched for, breadth first, as its
    layout differs between torch versions."""
    seen: set[int] = set()
    frontier = [holder]
    for _ in range(8):
        found = []
        for obj in frontier:
            if len(seen) > 4096:  # the wrapper sits a few steps away: don't walk Dynamo's caches
                return False, None
            if id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.Tensor, type, types.ModuleType)):
                continue
            seen.add(id(obj))
            compiler_fn, extra = getattr(obj, "compiler_fn", None), getattr(obj, "kwargs", None)
            if compiler_fn is not None and isinstance(extra, dict) and _is_sparse_prefill(compiler_fn):
                return True, extra.get("options", getattr(compiler_fn, "keywords", {}).get("options"))
            if isinstance(obj, functools.partial) and _is_sparse_prefill(obj.func):
                return True, obj.keywords.get("options")
            if isinstance(obj, types.FunctionType):
                for cell in obj.__closure__ or ():
                    try:
                        found.append(cell.cell_contents)
                    except ValueError:  # an empty cell
                        pass
            if hasattr(obj, "__wrapped__"):
                found.append(obj.__wrapped__)
            if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
                found.extend(vars(obj).values())
            elif isinstance(obj, types.FunctionType):
                found.extend(v for k, v in vars(obj).items() if k.startswith("_torchdynamo"))
        frontier = found
    return False, None
