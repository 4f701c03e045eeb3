"""``explain(model, *args)``: compile with the backend, run once, and report every attention site."""

from __future__ import annotations

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
                f"(method {self.config.method}, min_seq_len {self.config.min_seq_len})")
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
                                entry.last_density_per_head if count else None)
    return out


def explain(model, *args, config: Optional[SparseConfig] = None, **kwargs) -> ExplainReport:
    """Compile ``model`` with ``sparse_prefill``, run ``model(*args, **kwargs)`` once under ``torch.no_grad()``,
    and return what was rewritten, what ran sparse or dense and why, the density, and the graph diff.

    ``config`` (keyword only) is the ``SparseConfig`` to explain; density recording is switched on for the run.
    """
    config = (config or SparseConfig()).replace(record_density=True)
    report = ExplainReport(config=config)
    diffs: list[str] = []

    def listener(records, diff):
        report.sites.extend(records)
        if diff:
            diffs.append(diff)

    def backend(gm, example_inputs):
        return _backend.sparse_prefill(gm, example_inputs, options=config)

    compiled = torch.compile(model, backend=backend)
    before = runtime_stats()
    with _backend.on_rewrite(listener), torch.no_grad():
        report.output = compiled(*args, **kwargs)
    report.runtime = _delta(before, runtime_stats())
    report.diff = "\n".join(diffs)
    return report
