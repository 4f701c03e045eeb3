"""What one attention call runs: the rules, the break-even prediction, the method's plan and its execution, the
record. Every entry (the compiled op, ``sparse_attention``, the transformers front door, Ulysses) ends here.

Per call: ``rules.RUNTIME_RULES`` (the first that fails sends the call to dense attention, with its reason), then
``breakeven.advise`` (where this site's last plan was too dense to win, dense without planning), then the method
(``methods.build_plan``, ``methods.execute``), then dense attention if nothing ran, then one row in
``runtime_stats()``. ``Outcome`` says what happened: the path, the reason, the density and whether the call only
planned again for the break-even history.

The mask forms of the op (``attend_site``): ``is_causal=True`` (SDPA's top-left alignment), a mask proven causal
(queries at the last positions, optional key padding: ``attend_causal``), or a mask checked here at run time.
A padded batch runs as groups of rows with the same valid keys (``attend_padded``, ``padding.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from . import report
from .breakeven import HISTORY, advise, plan_shape
from .config import SparseConfig
from .context import resolve
from .dense import dense_attention, dense_causal_attention
from . import methods  # its stages looked up per call: tools and tests may wrap them
from .methods import Unsupported
from .padding import PaddingLayout, check_query_positions, padding_layout
from .plan import causal_tile_count
from .registry import method_spec
from .rules import RUNTIME_RULES, CallInfo, first_failure
from .runtime_mask import check_runtime_mask
from .site import SiteSpec

__all__ = ["Outcome", "DENSE", "SPARSE", "EAGER_SITE", "attend_site", "attend_eager", "attend_causal", "attend",
           "attend_padded", "attempt", "run_method", "dense_reason", "capturing"]

DENSE, SPARSE = "dense", "sparse"


@dataclass(frozen=True)
class Outcome:
    """What one call (or one group of a padded call) ran.

    ``output`` is None where the method did not run (a rule, break-even, the method declining, or a re-plan only
    kept for the break-even history): the caller runs dense attention. ``density``: per query head, with
    ``record_density``. ``replanned``: the call ran dense, but planned again so that the next call decides on a
    fresh density."""

    path: str
    reason: str
    output: Optional[Tensor] = None
    density: Optional[list[float]] = None
    replanned: bool = False


# -- calibration: see what every call gets -------------------------------------------------------------------
_CAPTURE: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("sparse_compile_capture", default=None)


@contextlib.contextmanager
def capturing(callback: Callable) -> Iterator[None]:
    """Inside the block, every causal attention problem the op (or ``sparse_attention``) decides on is passed to
    ``callback(site, q, k, v, scale, chunked_allowed)`` first: one call per padded group, before any rule.
    ``calibrate`` collects its samples so."""
    token = _CAPTURE.set(callback)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


# -- the op's mask forms ---------------------------------------------------------------------------------------
def attend_site(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], site: SiteSpec,
                key_padding: Optional[Tensor] = None, query_positions: Optional[Tensor] = None,
                runtime_mask: Optional[Tensor] = None) -> Tensor:
    """One call of the op on whole sequences, in the form ``site`` says the replaced call had."""
    config = resolve(site.config).for_site(site.site)
    if runtime_mask is not None:
        return _checked_mask(q, k, v, scale, site, config, runtime_mask)
    if not site.queries_last:  # is_causal=True: SDPA aligns the queries top-left
        return attend(q, k, v, scale, config, site.site,
                      lambda: dense_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=site.enable_gqa))
    if query_positions is not None:
        check_query_positions(query_positions, q.shape[-2], k.shape[-2])
    layout = None if key_padding is None else padding_layout(key_padding, k.shape[-2])
    if site.binary_padding and layout is not None and not layout.binary:
        raise ValueError(
            f"sparse_compile ({site.site}): the attention_mask holds values other than 0 and 1; this model's traced "
            "mask treats such values differently, and the rewrite proved it for 0/1 masks only. Pass a 0/1 mask."
        )
    return attend_causal(q, k, v, scale, config, site.site, layout)


def _checked_mask(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], site: SiteSpec, config: SparseConfig,
                  mask: Tensor) -> Tensor:
    """The call ``sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=...)`` with a mask checked here."""
    verdict = check_runtime_mask(mask, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
    if not verdict.causal:
        out = dense_attention(q, k, v, is_causal=False, attn_mask=mask, scale=scale, enable_gqa=site.enable_gqa)
        report.record_call(site.site, DENSE, verdict.reason, tuple(q.shape))
        return out
    kept = verdict.num_keys  # keys past the last query's reach are masked for every row: not attended
    k, v = k[:, :, :kept], v[:, :, :kept]
    return attend_causal(q, k, v, scale, config, site.site, padding_layout(verdict.key_valid, kept),
                         note=f"; {verdict.reason}")


EAGER_SITE = "sparse_attention"  # the site of calls that do not come through a compiled graph's op


def attend_eager(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
                 config: Optional[SparseConfig] = None) -> Tensor:
    """``sparse_attention`` on plain tensors: causal, the queries at the last positions, at ``EAGER_SITE``."""
    return attend_causal(q, k, v, scale, resolve(config or SparseConfig()).for_site(EAGER_SITE), EAGER_SITE)


def attend_causal(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                  layout: Optional[PaddingLayout] = None, note: str = "") -> Tensor:
    """Causal attention with the queries at the last positions, over the valid keys of ``layout`` (None: all)."""
    if layout is None or layout.all_valid:
        return attend(q, k, v, scale, config, site, lambda: dense_causal_attention(q, k, v, scale=scale),
                      chunked_allowed=True, note=note)
    return attend_padded(q, k, v, scale, config, site, layout, note)


# -- one call, decided, run and recorded ---------------------------------------------------------------------------
def attend(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
           dense: Callable[[], Tensor], *, chunked_allowed: bool = False, note: str = "") -> Tensor:
    """Decide, run the method or ``dense()``, and record what happened at ``site`` (``note`` appended)."""
    outcome = attempt(q, k, v, scale, config, site, chunked_allowed=chunked_allowed)
    out = outcome.output if outcome.output is not None else dense()
    report.record_call(site, outcome.path, outcome.reason + note, tuple(q.shape), outcome.density)
    return out


def attend_padded(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                  layout: PaddingLayout, note: str = "") -> Tensor:
    """Causal attention with key padding, queries at the last positions: each group of rows with the same valid
    keys runs as an ordinary causal prefill over those keys (``padding.py``); padded query rows give zeros."""
    offset = k.shape[-2] - q.shape[-2]  # absolute position of query row 0
    out = torch.zeros_like(q)
    outcomes = []
    for group in layout.groups:
        rows = group.row_selector()
        if group.index is None:
            lo = max(group.start, offset)
            if group.end <= lo:
                continue  # no valid query in these rows
            queries = slice(lo - offset, group.end - offset)
            keys = slice(group.start, group.end)
        else:
            keys = group.index
            queries = keys[keys >= offset] - offset
            if queries.numel() == 0:
                continue
        qg, kg, vg = q[rows][:, :, queries], k[rows][:, :, keys], v[rows][:, :, keys]
        outcome = attempt(qg, kg, vg, scale, config, site, chunked_allowed=True)
        og = outcome.output if outcome.output is not None else dense_causal_attention(qg, kg, vg, scale=scale)
        if isinstance(rows, slice):
            out[rows, :, queries] = og
        else:
            for i, row in enumerate(rows):
                out[row, :, queries] = og[i]
        outcomes.append(outcome)
    path = SPARSE if any(o.path == SPARSE for o in outcomes) else DENSE
    distinct = sorted({o.reason for o in outcomes})
    reason = (f"{distinct[0] if len(distinct) == 1 else ' | '.join(distinct)} (padded batch: {layout.describe()})"
              f"{note}")
    densities = [o.density for o in outcomes if o.density is not None]
    density = [sum(col) / len(col) for col in zip(*densities)] if densities else None
    report.record_call(site, path, reason, tuple(q.shape), density)
    return out


def dense_reason(q: Tensor, k: Tensor, v: Tensor, config: SparseConfig, site: str = "", *,
                 chunked_allowed: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """Why ``rules.RUNTIME_RULES`` send this call to dense attention, or None (the method may run)."""
    info = CallInfo(q, k, v, config, site, chunked_allowed, scale)
    failed = first_failure(RUNTIME_RULES, info)
    return None if failed is None else failed.reason(info)


def attempt(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str, *,
            chunked_allowed: bool = False) -> Outcome:
    """The rules, then break-even, then the method: what one call runs (nothing recorded, no dense run)."""
    capture = _CAPTURE.get()
    if capture is not None:
        capture(site, q, k, v, scale, chunked_allowed)
    why = dense_reason(q, k, v, config, site, chunked_allowed=chunked_allowed, scale=scale)
    if why is not None:
        return Outcome(DENSE, why)
    advice = advise(q, k, config, site)
    if advice.dense_reason is not None and not advice.replan:
        return Outcome(DENSE, advice.dense_reason)
    outcome = run_method(q, k, v, scale, config, advice.history_key, plan_only=advice.replan)
    if outcome.replanned:
        return Outcome(DENSE, f"{advice.dense_reason}; {outcome.reason}", replanned=True)
    return outcome


# -- the method: plan, execute, remember the density ------------------------------------------------------------
def _kernel_for(q: Tensor, config: SparseConfig) -> str:
    if config.kernel != "auto":
        return config.kernel
    return "triton" if q.is_cuda else "reference"


def run_method(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig,
               history_key: Optional[tuple] = None, *, plan_only: bool = False) -> Outcome:
    """Build the method's plan and execute it: a sparse ``Outcome`` with its output, or a dense one without (the
    method declined: ``Unsupported``).

    With a ``history_key`` the plan's density (visited tiles under early stop, which only running the plan tells:
    ``plan_only`` then runs it all the same) is remembered for the break-even decision; ``plan_only`` builds the
    plan for that alone (``Outcome.replanned``) and the caller runs dense.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kernel = _kernel_for(q, config)
    if kernel == "triton" and q.dtype == torch.float32 and q.is_cuda:
        return Outcome(DENSE, "float32 on GPU: the Triton kernel runs bfloat16/float16; left dense")
    try:
        spec = method_spec(config.select_stage)
        if plan_only and spec.decided_at_run_time(config.params_of(spec.name)):
            # only running the plan tells its cost. One KV head's group is planned and run (1/Hkv of the
            # selection's and the kernel's time, a different group at each re-plan); the whole call runs dense
            q, k, v = _probe_group(q, k, v)
        plan = methods.build_plan(q, k, scale, config)
    except Unsupported as exc:
        return Outcome(DENSE, f"method {config.method}: {exc}")
    # a plan that decides at run time how many tiles it visits (early stop) tells its cost by running: count the
    # visits when the count is wanted
    want_visits = config.record_density or (history_key is not None and plan.early_stop > 0)
    if plan_only:
        want_visits = plan.early_stop > 0
        if not want_visits:
            _remember(history_key, plan.density(q.shape[-2], k.shape[-2]).mean(), plan, config)
            return Outcome(DENSE, "planned again, for the next call", replanned=True)
    result = methods.execute(q, k, v, plan, scale, config, kernel=kernel, return_visited=want_visits)
    out, visited = result if want_visits else (result, None)
    if history_key is not None:
        if visited is not None:
            listed = _visited_density(visited, plan, q.shape[-2], k.shape[-2])
        else:
            listed = plan.density(q.shape[-2], k.shape[-2]).mean()
        _remember(history_key, listed, plan, config)
    if plan_only:
        return Outcome(DENSE, "planned again, for the next call", replanned=True)
    density = None
    if config.record_density:
        density = report.density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
    return Outcome(SPARSE, f"method {config.method} ({kernel})", out, density)


def _remember(history_key: tuple, density: Tensor, plan, config: SparseConfig) -> None:
    HISTORY.record(history_key, density, plan_shape(plan, config.select_stage), config)


def _visited_density(visited: Tensor, plan, num_queries: int, num_keys: int) -> Tensor:
    """The share of the causal tiles that were computed (0-d, on visited's device: no sync)."""
    total = causal_tile_count(num_queries, num_keys, plan.block_m, plan.block_n) * visited[:, :, 0].numel()
    return visited.sum(dtype=torch.float32) / max(total, 1)


_PROBES = itertools.count()


def _probe_group(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One KV head's group, a different one at each call (every method's plan is per head: the group's plan is
    the same as the whole plan's slice)."""
    heads_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    kv_head = next(_PROBES) % heads_kv
    heads = slice(kv_head * group, (kv_head + 1) * group)
    return q[:, heads], k[:, kv_head:kv_head + 1], v[:, kv_head:kv_head + 1]
