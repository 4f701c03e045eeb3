"""Observability as data: what the rewrite decided per site, what each call did at run time, and density.

Compile-time decisions are ``SiteRecord`` rows; run-time decisions are counted per site in a small
thread-safe log (``runtime_stats()``). Both also go to the ``sparse_compile`` logger.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .plan import causal_tiles_per_block
from .state import STATE

__all__ = ["SiteRecord", "SiteRuntime", "RuntimeStats", "runtime_stats", "reset_runtime_stats", "record_call",
           "register_plain_sdpa", "record_plain_sdpa_calls", "density_from_visits", "PLAIN_SDPA",
           "MAX_REASONS_PER_PATH", "OTHER_REASONS"]

PLAIN_SDPA = "dense"  # the path of a call of a site that a compiled graph kept as plain SDPA
PLAIN_SDPA_REASON = "kept as plain SDPA at compile time: "  # and the start of its reason


@dataclass(frozen=True)
class SiteRecord:
    """One ``scaled_dot_product_attention`` call site in a traced graph, and what the rewrite did with it."""

    site: str  # module path, e.g. "model.layers.3.self_attn"
    node: str  # FX node name
    q_shape: tuple
    k_shape: tuple
    dtype: str
    rewritten: bool
    reason: str  # why it was left alone, or the method it now runs
    rule: str = ""  # the name of the rewrite rule that failed (``rules.REWRITE_RULES``), "" when rewritten


@dataclass
class SiteRuntime:
    """Run-time record of one site: how many calls went each way and why, and the density seen (with
    ``record_density``: the fraction of the causal tiles computed, in [0, 1]; ``density_from_visits``)."""

    calls: Counter = field(default_factory=Counter)  # (path, reason) -> count
    last_shape: Optional[tuple] = None
    last_path: Optional[str] = None
    last_reason: Optional[str] = None
    density_sum: float = 0.0
    density_count: int = 0
    last_density_per_head: Optional[list[float]] = None
    # why compiled graphs kept this site as plain SDPA (one reason per distinct decision): those graphs never run
    # it sparse. Empty when every graph that has the site rewrote it.
    plain_sdpa: tuple = ()
    # (path, reason) -> batch rows that took it: a padded call whose rows took different paths is one call (under
    # its joined reason) and shows every path here
    rows: Counter = field(default_factory=Counter)

    @property
    def mean_density(self) -> Optional[float]:
        return self.density_sum / self.density_count if self.density_count else None


_LOCK = STATE.lock("report.lock")
_RUNTIME: dict[str, SiteRuntime] = STATE.add("report.runtime", {})  # site -> its record
# Reasons name sizes ("q_len 37 < min_seq_len 64", a padded batch's rows): a site sees as many as its inputs have
# lengths. Past this many distinct reasons on one path (sparse, dense), a site counts further new reasons of that
# path under OTHER_REASONS: the counts stay exact, the memory bounded, and one path's many reasons never hide
# another path's few.
MAX_REASONS_PER_PATH = 32
OTHER_REASONS = f"other reasons (past the first {MAX_REASONS_PER_PATH} distinct ones; last_reason: the latest)"


def _count(entry: SiteRuntime, path: str, reason: str, rows: int = 0, counter: str = "calls") -> None:
    counts = getattr(entry, counter)
    key = (path, reason)
    if key not in counts and sum(p == path for p, _ in counts) >= MAX_REASONS_PER_PATH:
        key = (path, OTHER_REASONS)
    counts[key] += rows if counter == "rows" else 1


def record_call(site: str, path: str, reason: str, shape: tuple, density: Optional[list[float]] = None,
                rows: Optional[tuple] = None) -> None:
    """One call at ``site``. ``rows``: ``(path, reason, number of batch rows)`` per group of rows that ran
    differently (a padded batch); by default every row took ``path``."""
    with _LOCK:
        entry = _RUNTIME.setdefault(site, SiteRuntime())
        _count(entry, path, reason)
        for row_path, row_reason, count in rows if rows is not None else ((path, reason, shape[0] if shape else 1),):
            _count(entry, row_path, row_reason, count, "rows")
        entry.last_shape, entry.last_path, entry.last_reason = shape, path, reason
        if density is not None:
            entry.last_density_per_head = density
            entry.density_sum += sum(density) / max(len(density), 1)
            entry.density_count += 1


def register_plain_sdpa(site: str, reason: str) -> None:
    """A compiled graph kept ``site`` as plain SDPA for ``reason``: listed from compile time on, before any call."""
    with _LOCK:
        entry = _RUNTIME.setdefault(site, SiteRuntime())
        if reason not in entry.plain_sdpa:
            entry.plain_sdpa += (reason,)


def record_plain_sdpa_calls(calls: tuple) -> None:
    """One call of a compiled graph that kept sites dense: ``calls`` holds ``(site, reason, shape, said)`` per such
    site (the compile-time reason and shape, symbolic sizes by name, and the call's reason, e.g. PLAIN_SDPA_REASON
    + reason). One lock for the whole graph call."""
    with _LOCK:
        for site, reason, shape, said in calls:
            entry = _RUNTIME.setdefault(site, SiteRuntime())
            _count(entry, PLAIN_SDPA, said)
            _count(entry, PLAIN_SDPA, said, shape[0] if shape and isinstance(shape[0], int) else 1, "rows")
            entry.last_shape, entry.last_path, entry.last_reason = shape, PLAIN_SDPA, said
            if reason not in entry.plain_sdpa:  # registered before a reset_runtime_stats()
                entry.plain_sdpa += (reason,)


def _reasons(by_reason: Counter) -> str:
    """The most frequent reason, and the next ones where there are several (a second method stays visible)."""
    shown = by_reason.most_common(SHOWN_REASONS)
    if len(shown) == 1:
        return shown[0][0]
    said = " | ".join(f"{reason} ({n}x)" for reason, n in shown)
    hidden = len(by_reason) - len(shown)
    return said + (f" (+{hidden} other reasons)" if hidden else "")


SHOWN_REASONS = 2  # reasons a table row shows per site and path


class RuntimeStats(dict):
    """site -> ``SiteRuntime``, printed as a table: one row per site and path, with the calls, the mean density of
    the sparse calls and the reason (the most frequent one where a path had several)."""

    def __str__(self) -> str:
        if not self:
            return "runtime_stats: no attention call recorded"
        rows, measured = [], False
        for site, entry in self.items():
            for i, path in enumerate(sorted({p for p, _ in entry.calls} | {p for p, _ in entry.rows})):
                by_reason = Counter({r: n for (p, r), n in entry.calls.items() if p == path})
                if by_reason:
                    reason = _reasons(by_reason)
                else:  # rows of padded calls counted under another path
                    in_rows = Counter({r: n for (p, r), n in entry.rows.items() if p == path})
                    reason = f"{sum(in_rows.values())} rows of padded calls: {_reasons(in_rows)}"
                density = entry.mean_density if path == "sparse" else None
                measured |= density is not None
                rows.append((site if i == 0 else "", path, str(sum(by_reason.values())),
                             "-" if density is None else f"{density:.3f}", reason))
            if not entry.calls:
                said = f"{PLAIN_SDPA_REASON}{entry.plain_sdpa[0]}" if entry.plain_sdpa else "no call yet"
                rows.append((site, PLAIN_SDPA if entry.plain_sdpa else "-", "0", "-", said))
        head = ("site", "path", "calls", "density", "reason")
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
        lines = ["  ".join([c.ljust(widths[0]), c2.ljust(widths[1]), n.rjust(widths[2]), d.rjust(widths[3]), r])
                 for c, c2, n, d, r in [head] + rows]
        if not measured:
            lines.append("density: not measured (SparseConfig(record_density=True) records it, one host sync per "
                         "call)")
        return "\n".join(lines)

    __repr__ = __str__


def runtime_stats() -> RuntimeStats:
    """A snapshot of the run-time log: site -> ``SiteRuntime`` (a dict; ``print`` shows a table). Every attention site
    of every graph compiled by ``sparse_prefill`` is there: a rewritten one from its first call, one the rewrite kept
    as plain SDPA (or attention the graph computes by hand, without SDPA) from compile time on, with the reason in
    ``plain_sdpa`` and its calls counted on the path ``"dense"``."""
    with _LOCK:
        return RuntimeStats({
            site: SiteRuntime(Counter(e.calls), e.last_shape, e.last_path, e.last_reason, e.density_sum,
                              e.density_count, list(e.last_density_per_head or []) or None, e.plain_sdpa,
                              Counter(e.rows))
            for site, e in _RUNTIME.items()
        })


def reset_runtime_stats() -> None:
    with _LOCK:
        _RUNTIME.clear()


def density_from_visits(visited: torch.Tensor, plan, num_queries: int, num_keys: int, num_heads: int) -> list[float]:
    """Per-query-head fraction of the causal tiles computed (batch-averaged), in [0, 1]. Syncs with the host.

    Each query block counts at most the tiles dense causal attention computes for it: a layout that computes more
    than dense does for a block (PBS's permuted diagonal segment is a full square of tiles, S2O's key lists are
    tile-padded per segment) reads as 1 there, not above. What a plan costs against dense attention, which can
    exceed 1, is ``plan.density`` (tiles listed over causal tiles).

    Where the plan reorders the queries (``query_index``), a block holds rows from anywhere in its segment: it is
    counted against the tiles its own rows reach (its last row's causal prefix), so an exact plan reads as 1.

    A plan with a sliding window or chunks (``plan.local_plan``, ``plan.restrict_to_local``) is counted the same
    way, against the causal tiles: the exact band plan reads as the band's share of them, below 1."""
    if plan.query_index is not None:
        return _density_of_reordered_queries(visited, plan, num_queries, num_keys)
    blocks = -(-num_queries // plan.block_m)
    total = int(causal_tiles_per_block(blocks, num_queries, num_keys, plan.block_m, plan.block_n).sum())
    causal = causal_tiles_per_block(visited.shape[-1], num_queries, num_keys, plan.block_m, plan.block_n)
    kept = torch.minimum(visited.to(torch.float64), causal.to(visited.device, torch.float64))
    per_head = kept.sum(dim=2).mean(dim=0) / max(total, 1)
    return [float(x) for x in per_head.cpu()]


def _density_of_reordered_queries(visited: torch.Tensor, plan, num_queries: int, num_keys: int) -> list[float]:
    batch, heads, blocks = visited.shape
    index = plan.query_index.to(visited.device, torch.int64)  # (B, Hq' dividing heads, Nq): each row's position
    padded = torch.nn.functional.pad(index, (0, blocks * plan.block_m - index.shape[-1]), value=-1)
    last = padded[..., :blocks * plan.block_m].reshape(*index.shape[:2], blocks, plan.block_m).amax(-1)
    reach = torch.where(last >= 0, (last + num_keys - num_queries) // plan.block_n + 1, 0).to(torch.float64)
    reach = reach.repeat_interleave(heads // reach.shape[1], dim=1).expand(batch, heads, blocks)
    kept = torch.minimum(visited.to(torch.float64), reach)
    per_head = (kept.sum(dim=2) / reach.sum(dim=2).clamp_min(1)).mean(dim=0)
    return [float(x) for x in per_head.cpu()]
