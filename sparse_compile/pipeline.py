"""What one attention call runs: the rules, the break-even prediction, the method's plan and its execution, the
record. Every entry (the compiled op, ``sparse_attention``, the transformers front door, Ulysses) ends here.

Per call: ``rules.RUNTIME_RULES`` (the first that fails sends the call to dense attention, with its reason), then
``breakeven.advise`` (where this site's last plan was too dense to win, dense without planning), then the method
(``methods.build_plan``, then ``methods.executor_of``: its own executor or ``plan.execute_plan``), then dense
attention if nothing ran, then one row in ``runtime_stats()``. ``Outcome`` says what happened: the path, the
reason, the density and whether the call only planned again for the break-even history.

The mask forms of the op (``attend_site``): ``is_causal=True`` (SDPA's top-left alignment), a mask proven causal
(queries at the last positions, optional key padding: ``attend_causal``), or a mask checked here at run time.
A padded batch runs as groups of rows with the same valid keys (``attend_padded``, ``padding.py``).

A sliding window or chunked local attention on top of causal (``local.Local``, from the site's proof, a mask checked
at run time or ``sparse_attention(window=, chunk=)``): where it binds nowhere (``Local.binds``) the call is plain
causal. Where it binds, the rules run without the length rule (one that fails: dense SDPA with the band as an
explicit mask, the only place that mask is built); then a short band (chunks, a window below ``min_seq_len``, or a
call shorter than that) runs the exact band plan (``plan.local_plan``) on the kernels, recorded sparse ("exact
band: ..."), and a long one runs the method's plan cut to the band (``plan.restrict_to_local``), or the exact band
plan where the method declines. Break-even is not consulted for banded calls. A padded row whose valid keys have
holes runs dense with the mask in its raw positions where the band binds. The full decision: docs/design.md
("Sliding windows and chunked local attention").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from . import report
from .breakeven import HISTORY, advise
from .config import SparseConfig
from .context import resolve
from .dense import QUERIES_LAST, DenseForm, run_dense
from .local import CAUSAL, Local
from . import methods  # its stages looked up per call: tools and tests may wrap them
from .methods import Unsupported
from .padding import PaddingLayout, check_query_positions, document_segments, padding_layout
from . import packed
from .plan import BlockPlan, execute_plan, local_plan, restrict_to_local
from .registry import method_spec
from .rules import RUNTIME_RULES, CallInfo, first_failure, prefill_length
from .runtime_mask import check_runtime_mask
from .site import SiteSpec

__all__ = ["Outcome", "DENSE", "SPARSE", "EAGER_SITE", "attend_site", "attend_eager", "attend_causal", "attend",
           "attend_padded", "attend_segments", "attempt", "run_method", "run_band", "method_in_band", "band_block",
           "dense_reason", "capturing"]

DENSE, SPARSE = "dense", "sparse"


@dataclass(frozen=True)
class Outcome:
    """What one call (or one group of a padded call) ran.

    ``output``: what the call returns. ``attempt`` and ``run_method`` leave it None where the method did not run (a
    rule, break-even, the method declining, or a re-plan kept for the break-even history): dense attention then
    fills it. ``density``: per query head, with
    ``record_density``. ``replanned``: the call ran dense, but planned again so that the next call decides on a
    fresh density. ``plan``: a sparse call whose plan runs later, in a packed launch (``run_method(defer=True)``)."""

    path: str
    reason: str
    output: Optional[Tensor] = None
    density: Optional[list[float]] = None
    replanned: bool = False
    plan: Optional[BlockPlan] = None


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
                runtime_mask: Optional[Tensor] = None, documents: Optional[Tensor] = None) -> Tensor:
    """One call of the op on whole sequences, in the form ``site`` says the replaced call had."""
    config = resolve(site.config).for_site(site.site)
    if documents is not None:  # documents packed in each row: each row's documents on their own
        rows = document_segments(documents, k.shape[-2])
        if all(row == rows[0] for row in rows):
            return attend_segments(q, k, v, scale, config, site.site, rows[0], note=f"; {DOCUMENT}")
        return torch.cat([attend_segments(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale, config, site.site, row,
                                          note=f"; {DOCUMENT}") for b, row in enumerate(rows)])
    if runtime_mask is None and not site.queries_last:  # is_causal=True: SDPA aligns the queries top-left
        return attend(q, k, v, scale, config, site.site, DenseForm(top_left=True, enable_gqa=site.enable_gqa))
    keys = _keys_seen(site, q.shape, k.shape[-2], key_padding, query_positions, runtime_mask)
    local = keys.local if not keys.local.is_causal else site.local
    if keys.segments:  # packed sequences (a continuous batch's block-diagonal mask): each on its own
        return attend_segments(q, k, v, scale, config, site.site, keys.segments, note=keys.note)
    if keys.not_causal is not None:  # a mask checked at run time, not causal: the call as it was, with its mask
        return attend(q, k, v, scale, config, site.site, DenseForm(enable_gqa=site.enable_gqa, mask=runtime_mask),
                      dense_because=keys.not_causal)
    if keys.count < k.shape[-2]:
        k, v = k[:, :, :keys.count], v[:, :, :keys.count]
    return attend_causal(q, k, v, scale, config, site.site, keys.layout, note=keys.note, local=local)


@dataclass(frozen=True)
class _Keys:
    """What a call's mask says of its keys: causal over the first ``count``, valid where ``layout`` says (None:
    all), ``note`` for the record; or, where a mask checked at run time is not causal, why (``not_causal``)."""

    count: int
    layout: Optional[PaddingLayout] = None
    note: str = ""
    not_causal: Optional[str] = None
    segments: tuple = ()  # packed sequences: (q_start, q_end, k_start, k_end) each
    local: Local = CAUSAL  # a mask checked at run time: its sliding window / chunks


def _keys_seen(site: SiteSpec, q_shape, num_keys: int, key_padding: Optional[Tensor],
               query_positions: Optional[Tensor], runtime_mask: Optional[Tensor]) -> _Keys:
    if runtime_mask is not None:  # a graph input: its values checked here, once per forward pass
        verdict = check_runtime_mask(runtime_mask, q_shape[0], q_shape[1], q_shape[-2], num_keys, local=True)
        if verdict.segments:
            return _Keys(num_keys, note=f"; {PACKED}", segments=verdict.segments)
        if not verdict.causal:
            return _Keys(num_keys, not_causal=verdict.reason)
        # keys past the last query's reach are masked for every row: not attended
        return _Keys(verdict.num_keys, padding_layout(verdict.key_valid, verdict.num_keys), f"; {verdict.reason}",
                     local=verdict.local)
    if query_positions is not None:
        check_query_positions(query_positions, q_shape[-2], num_keys)
    layout = None if key_padding is None else padding_layout(key_padding, num_keys)
    if site.binary_padding and layout is not None and not layout.binary:
        raise ValueError(
            f"sparse_compile ({site.site}): the attention_mask holds values other than 0 and 1; this model's traced "
            "mask treats such values differently, and the rewrite proved it for 0/1 masks only. Pass a 0/1 mask."
        )
    return _Keys(num_keys, layout)


EAGER_SITE = "sparse_attention"  # the site of calls that do not come through a compiled graph's op


def attend_eager(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
                 config: Optional[SparseConfig] = None, local: Local = CAUSAL) -> Tensor:
    """``sparse_attention`` on plain tensors: causal (AND ``local``), the queries at the last positions, at
    ``EAGER_SITE``."""
    return attend_causal(q, k, v, scale, resolve(config or SparseConfig()).for_site(EAGER_SITE), EAGER_SITE,
                         local=local)


def attend_causal(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                  layout: Optional[PaddingLayout] = None, note: str = "", local: Local = CAUSAL) -> Tensor:
    """Causal attention with the queries at the last positions, over the valid keys of ``layout`` (None: all),
    AND ``local`` (a sliding window / chunks, positions counted from each row's first valid key; module
    docstring)."""
    if not isinstance(local, Local):
        raise TypeError(f"attend_causal: local must be a sparse_compile.local.Local, got {type(local).__name__}")
    if layout is None or layout.all_valid:
        return attend(q, k, v, scale, config, site, QUERIES_LAST, chunked_allowed=True, note=note, local=local)
    return attend_padded(q, k, v, scale, config, site, layout, note, local=local)


# -- one call, decided, run and recorded ---------------------------------------------------------------------------
def attend(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
           dense: DenseForm = QUERIES_LAST, *, chunked_allowed: bool = False, note: str = "",
           dense_because: Optional[str] = None, local: Local = CAUSAL) -> Tensor:
    """Decide, run the method or the exact attention ``dense``, and record what happened at ``site`` (``note``
    appended to the reason). ``dense_because``: the call runs ``dense`` for that reason, no rule asked. ``local``:
    causal AND a sliding window / chunks (module docstring; ``dense`` is then ``QUERIES_LAST``)."""
    return _recorded(site, _run(q, k, v, scale, config, site, dense, chunked_allowed, dense_because, local),
                     q.shape, note)


def _run(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
         dense: DenseForm, chunked_allowed: bool, dense_because: Optional[str] = None,
         local: Local = CAUSAL) -> Outcome:
    """``attempt`` (unless ``dense_because``), then ``dense`` where the method did not run: an outcome with its
    output. Where ``local`` binds, the dense fallback is SDPA with the band as an explicit mask."""
    with _without_autocast(q):
        if dense_because is None:
            outcome = attempt(q, k, v, scale, config, site, chunked_allowed=chunked_allowed, local=local)
        else:
            outcome = Outcome(DENSE, dense_because)
        if outcome.output is None:
            if local.binds(k.shape[-2]) and dense is QUERIES_LAST:
                dense = _local_dense_form(q, k, local)
                outcome = dataclasses.replace(outcome, reason=f"{outcome.reason}; {local.describe()} as an explicit "
                                              "mask")
            outcome = dataclasses.replace(outcome, output=run_dense(q, k, v, scale, dense))
    return outcome


def _local_dense_form(q: Tensor, k: Tensor, local: Local, query_positions: Optional[Tensor] = None,
                      key_positions: Optional[Tensor] = None) -> DenseForm:
    """SDPA with ``local``'s bool mask (causal included), (Nq, Nk): queries at the last positions unless given.
    Only the dense fallback of a banded call builds it: SDPA takes no band but as a mask, and the replaced call
    (transformers' SDPA path) built the same (Nq, Nk) mask; the sparse paths never do."""
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    if key_positions is None:
        key_positions = torch.arange(num_keys, device=q.device)
    if query_positions is None:
        query_positions = torch.arange(num_keys - num_queries, num_keys, device=q.device)
    return DenseForm(enable_gqa=q.shape[1] != k.shape[1], mask=local.visible(query_positions, key_positions))


def _without_autocast(q: Tensor):
    """Autocast off while a call runs: its inputs arrive in the dtype autocast gives attention
    (``rules.autocast_inputs``), and the planners and kernels choose their own precisions inside."""
    kind = q.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def _recorded(site: str, outcome: Outcome, shape, note: str = "", rows: Optional[tuple] = None) -> Tensor:
    """``outcome``'s row in ``runtime_stats()``; returns its output."""
    report.record_call(site, outcome.path, outcome.reason + note, tuple(shape), outcome.density, rows)
    return outcome.output


PACKED = "one of the packed sequences of an attn_mask checked at run time"
DOCUMENT = "one of the documents packed in a row"


def attend_segments(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                    segments: tuple, note: str = "", *, joined: bool = True) -> Tensor:
    """Packed sequences: each ``(q_start, q_end, k_start, k_end)`` is causal attention of those query rows at the
    last positions of those keys (a fifth entry: AND a sliding window of that many keys), decided and recorded as a
    call of its own (a long prompt sparse, a decode token dense, each with its reason); rows in no sequence give
    zeros. Every method plan a packed launch takes (``packed.joinable``) and every dense sequence of at most
    ``SHORT_ROWS`` queries (decode tokens) run together in one launch (``packed.py``; decode tokens beside larger
    plan blocks in a second: ``_run_packed``); the others (a longer dense sequence: SDPA; a binding window, a method
    with an executor of its own, a plan the Hopper kernel serves) run one after another, as does every sequence with
    ``joined=False`` or dtypes the packed executors lack (float32 on a GPU; float64 on the kernels). On the PyTorch
    reference (the CPU) only the method plans join: dense sequences run SDPA each."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    kernel = _kernel_for(q, config)
    joined = joined and packed.executor(q, v, kernel)
    waiting = []  # (packed.Segment, Outcome) of the sequences the packed launch runs
    for q0, q1, k0, k1, *window in segments:
        local = Local(window=window[0]) if window else CAUSAL
        qs, ks, vs = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
        if not joined or local.binds(k1 - k0) or not 0 < q1 - q0 <= k1 - k0:
            out[:, :, q0:q1] = attend(qs, ks, vs, scale, config, site, QUERIES_LAST, chunked_allowed=True, note=note,
                                      local=local)
            continue
        with _without_autocast(q):
            outcome = attempt(qs, ks, vs, scale, config, site, chunked_allowed=True, defer=True)
            if outcome.output is None and outcome.plan is None and (kernel == "reference" or q1 - q0 > SHORT_ROWS):
                # dense past a decode step: SDPA. On the CPU the reference's padded blocks would only slow it down; on
                # a GPU the sparse kernel at every tile is 1.2-1.6x cuDNN at 8K (the break-even table's kernel
                # ratio), while decode tokens joined the launch measured faster than one call each
                outcome = dataclasses.replace(outcome, output=run_dense(qs, ks, vs, scale, QUERIES_LAST))
        if outcome.output is not None:  # its plan ran on its own
            out[:, :, q0:q1] = _recorded(site, outcome, qs.shape, note)
        else:  # dense (every causal tile) or its method's plan, in the packed launch
            waiting.append((packed.Segment(q0, q1, k0, k1, outcome.plan), outcome))
    if waiting:
        _run_packed(q, k, v, scale, config, site, waiting, kernel, out, note)
    return out


SHORT_ROWS = 16  # dense sequences of at most this many queries (decode tokens) launch apart from larger plan blocks


def _run_packed(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                waiting: list, kernel: str, out: Tensor, note: str) -> None:
    """The packed launch of ``attend_segments``' waiting sequences, written into ``out``, each recorded. Where the
    method plans' query blocks are larger than ``SHORT_ROWS``, the dense sequences of at most that many queries
    take a second launch of 16-row blocks (a decode token would fill one row of a 128-row block). A plan of another
    block size than the first, or every sequence of a launch whose kernel fails to compile, runs alone."""
    sizes = next(((s.plan.block_m, s.plan.block_n) for s, _ in waiting if s.plan is not None), None)
    alone, rest, short = [], [], []
    for w in waiting:
        s = w[0]
        if s.plan is not None:
            (rest if (s.plan.block_m, s.plan.block_n) == sizes else alone).append(w)
        else:
            (short if s.q1 - s.q0 <= SHORT_ROWS < (sizes or (0,))[0] else rest).append(w)
    value = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    for together in (rest, short):
        if not together:
            continue
        plan = packed.pack([s for s, _ in together], q.shape[1], k.shape[1], q.device)
        try:
            with _without_autocast(q):
                visited = packed.execute_packed(q, k, v, plan, value, kernel=kernel, out=out,
                                                return_visited=config.record_density,
                                                kernel_options=_launch(config)["kernel_options"])
        except Exception as exc:  # as in run_method: only a failed kernel compile runs the sequences alone
            if _compile_failure(exc) is None:
                raise
            alone += together
            continue
        for i, (s, outcome) in enumerate(together):
            queries, keys = s.q1 - s.q0, s.k1 - s.k0
            if visited is not None and s.plan is not None:
                seen = packed.segment_visits(visited, plan, i, s.plan, queries, keys)
                outcome = dataclasses.replace(outcome, density=report.density_from_visits(
                    seen, s.plan, queries, keys, q.shape[1]))
            _recorded(site, outcome, (q.shape[0], q.shape[1], queries, q.shape[-1]), note)
    for s, _ in alone:
        out[:, :, s.q0:s.q1] = attend(q[:, :, s.q0:s.q1], k[:, :, s.k0:s.k1], v[:, :, s.k0:s.k1], scale, config, site,
                                      QUERIES_LAST, chunked_allowed=True, note=note)


def attend_padded(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                  layout: PaddingLayout, note: str = "", local: Local = CAUSAL) -> Tensor:
    """Causal attention with key padding, queries at the last positions: each group of rows with the same valid
    keys runs as an ordinary causal prefill over those keys (``padding.py``); padded query rows give zeros.
    ``local``: positions counted from each row's first valid key; a row with holes in its valid keys where the band
    binds runs dense with the mask in its raw positions (its gathered keys are not the positions the band counts)."""
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
        if group.index is not None and local.binds(group.end - group.start):
            first = group.start  # raw positions from the row's first valid key
            form = _local_dense_form(qg, kg, local, query_positions=queries + offset - first,
                                     key_positions=keys - first)
            outcome = _run(qg, kg, vg, scale, config, site, form, True, dense_because=(
                f"{local.describe()} over a row whose valid keys have holes: the band counts raw positions, which "
                "gathered keys lose; dense with the mask"))
        else:
            outcome = _run(qg, kg, vg, scale, config, site, QUERIES_LAST, True, local=local)
        if isinstance(rows, slice):
            out[rows, :, queries] = outcome.output
        else:
            for i, row in enumerate(rows):
                out[row, :, queries] = outcome.output[i]
        outcomes.append((outcome, len(group.rows)))
    path = SPARSE if any(o.path == SPARSE for o, _ in outcomes) else DENSE
    distinct = sorted({o.reason for o, _ in outcomes})
    reason = f"{distinct[0] if len(distinct) == 1 else ' | '.join(distinct)} (padded batch: {layout.describe()})"
    densities = [o.density for o, _ in outcomes if o.density is not None]
    density = [sum(col) / len(col) for col in zip(*densities)] if densities else None
    # every row counted on the path it took; a row with no valid query took none
    rows = tuple((o.path, o.reason + note + " (padded batch)", n) for o, n in outcomes)
    return _recorded(site, Outcome(path, reason, out, density), q.shape, note, rows)


def dense_reason(q: Tensor, k: Tensor, v: Tensor, config: SparseConfig, site: str = "", *,
                 chunked_allowed: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """Why ``rules.RUNTIME_RULES`` send this call to dense attention, or None (the method may run)."""
    info = CallInfo(q, k, v, config, site, chunked_allowed, scale)
    failed = first_failure(RUNTIME_RULES, info)
    return None if failed is None else failed.reason(info)


def attempt(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str, *,
            chunked_allowed: bool = False, local: Local = CAUSAL, defer: bool = False) -> Outcome:
    """The rules, then break-even, then the method: what one call runs (nothing recorded, no dense run).
    ``local`` binding: the band's decision instead (module docstring). ``defer``: as ``run_method``'s."""
    if local.binds(k.shape[-2]):
        return _attempt_local(q, k, v, scale, config, site, chunked_allowed, local)
    capture = _CAPTURE.get()
    if capture is not None:
        capture(site, q, k, v, scale, chunked_allowed)
    why = dense_reason(q, k, v, config, site, chunked_allowed=chunked_allowed, scale=scale)
    if why is not None:
        return Outcome(DENSE, why)
    advice = advise(q.shape, k.shape, q.device, config, site)
    if advice.dense_reason is not None and not advice.replan:
        return Outcome(DENSE, advice.dense_reason)
    outcome = run_method(q, k, v, scale, config, advice.history_key, plan_only=advice.replan, defer=defer)
    if outcome.replanned:
        return Outcome(DENSE, f"{advice.dense_reason}; {outcome.reason}", replanned=True)
    return outcome


# -- a sliding window / chunks: the exact band plan, or the method inside the band -------------------------------
# every rule but the length rule, which decides between the band plan and the method instead
_LOCAL_RULES = tuple(rule for rule in RUNTIME_RULES if rule.name != "long_enough")


def _attempt_local(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                   chunked_allowed: bool, local: Local) -> Outcome:
    """What a call whose band binds runs (module docstring). Calibration's capture is not called: its samples are
    causal problems, which a banded call is not."""
    info = CallInfo(q, k, v, config, site, chunked_allowed, scale)
    failed = first_failure(_LOCAL_RULES, info)
    if failed is not None:
        return Outcome(DENSE, failed.reason(info))
    if not method_in_band(local, q.shape[-2], k.shape[-2], config.min_seq_len):
        return run_band(q, k, v, scale, config, local)
    outcome = run_method(q, k, v, scale, config, local=local)
    if outcome.path == SPARSE:
        return outcome
    return run_band(q, k, v, scale, config, local, because=outcome.reason)


def method_in_band(local: Local, num_queries: int, num_keys: int, min_seq_len: int) -> bool:
    """Whether a banded call runs the method cut to the band (a window of at least ``min_seq_len`` on a call that
    computes at least a ``min_seq_len`` prefill, no chunks) rather than the exact band plan."""
    return (local.chunk == 0 and local.window >= min_seq_len
            and prefill_length(num_queries, num_keys) >= min_seq_len)


def band_block(local: Local) -> int:
    """The band plan's tile size: 128 (the kernels' measured tiles), 64 for a band of at most 64 positions, which
    128-wide tiles would mostly spend on masked-out keys (a choice not measured on a GPU)."""
    extent = min(x for x in (local.window, local.chunk) if x > 0)
    return 64 if extent <= 64 else 128


def run_band(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, local: Local,
             because: str = "") -> Outcome:
    """The exact band plan (``plan.local_plan``, keep-all inside the band) on the kernels: a sparse ``Outcome``
    with its output, or a dense one without (float32 on a GPU, a failed kernel compile)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kernel = _kernel_for(q, config)
    if kernel == "triton" and q.dtype == torch.float32 and q.is_cuda:
        return Outcome(DENSE, "float32 on GPU: the Triton kernel runs bfloat16/float16; left dense")
    block = band_block(local)
    plan = local_plan(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], block, block, device=q.device,
                      window=local.window, chunk=local.chunk)
    try:
        result = execute_plan(q, k, v, plan, scale, kernel=kernel, return_visited=config.record_density,
                              **_launch(config))
    except Exception as exc:  # as in run_method: only a failed kernel compile goes dense
        failure = _compile_failure(exc)
        if failure is None:
            raise
        return Outcome(DENSE, f"exact band: {failure}; left dense")
    out, visited = result if config.record_density else (result, None)
    density = None
    if config.record_density:
        density = report.density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
    reason = f"exact band: {local.describe()} ({kernel})" + (f"; {because}" if because else "")
    return Outcome(SPARSE, reason, out, density)


# -- the method: plan, execute, remember the density ------------------------------------------------------------
def _kernel_for(q: Tensor, config: SparseConfig) -> str:
    """The executor ``execute_plan`` takes: the kernels ("triton") or the PyTorch reference."""
    if config.kernel != "auto":
        return "reference" if config.kernel == "reference" else "triton"
    return "triton" if q.is_cuda else "reference"


def _launch(config: SparseConfig) -> dict:
    """What the kernels receive of the configuration (``execute_plan``'s keywords): which kernel serves a call
    (``kernel="triton"``, or any ``kernel_options``, which tune it: the Triton kernel only; "auto": the Gluon Hopper
    kernel where it serves the call, ``SPARSE_COMPILE_ATTENTION_BACKEND=triton`` overriding that) and its launch
    parameters."""
    backend = "triton" if config.kernel == "triton" or config.kernel_options else "auto"
    return {"backend": backend, "kernel_options": dict(config.kernel_options)}


def run_method(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig,
               history_key: Optional[tuple] = None, *, plan_only: bool = False, local: Local = CAUSAL,
               defer: bool = False) -> Outcome:
    """Build the method's plan and execute it: a sparse ``Outcome`` with its output, or a dense one without (the
    method declined: ``Unsupported``).

    With a ``history_key`` the plan's density is remembered for the break-even decision; ``plan_only`` builds the
    plan for that alone (``Outcome.replanned``) and the caller runs dense. A plan that decides at run time how many
    tiles it visits (early stop) tells its cost only by running it: such a re-plan runs the whole call sparse and
    returns its output (a part of the call, one KV head's group, would be a shape the kernels never ran: a Triton
    compile of seconds inside a server's call).

    ``local`` (binding): the method's plan cut to the band (``plan.restrict_to_local``): its own choices inside it.

    ``defer``: a plan a packed launch can take (``packed.joinable``, the method without an executor of its own) is
    returned unexecuted, in ``Outcome.plan``; others run here.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kernel = _kernel_for(q, config)
    if kernel == "triton" and q.dtype == torch.float32 and q.is_cuda:
        return Outcome(DENSE, "float32 on GPU: the Triton kernel runs bfloat16/float16; left dense")
    try:
        spec = method_spec(config.select_stage)
        plan_only = plan_only and not spec.decided_at_run_time(config.params_of(spec.name))
        plan = methods.build_plan(q, k, scale, config)
        banded = local.binds(k.shape[-2])
        if banded:
            plan = restrict_to_local(plan, q.shape[-2], k.shape[-2], window=local.window, chunk=local.chunk)
        # a plan that decides at run time how many tiles it visits (early stop) tells its cost only by running:
        # count the visits where the count is wanted
        want_visits = config.record_density or (history_key is not None and plan.early_stop > 0)
        out = visited = None
        launch = _launch(config)
        defer = (defer and not plan_only and not banded and spec.execute is None
                 and packed.joinable(plan, q, k, v, backend=launch["backend"]))
        if not plan_only and not defer:
            run, params = methods.executor_of(config)
            result = run(q, k, v, plan, scale, *params, kernel=kernel, return_visited=want_visits, **launch)
            out, visited = result if want_visits else (result, None)
    except Unsupported as exc:
        return Outcome(DENSE, f"method {config.method}: {exc}")
    except Exception as exc:  # out of memory, a device fault, a bug: the caller's; a failed kernel compile: dense
        failure = _compile_failure(exc)
        if failure is None:
            raise
        return Outcome(DENSE, f"method {config.method}: {failure}; left dense")
    if history_key is not None:
        HISTORY.remember(history_key, plan, config, q.shape[-2], k.shape[-2], visited)
    if plan_only:
        return Outcome(DENSE, "planned again, for the next call", replanned=True)
    if defer:
        return Outcome(SPARSE, f"method {config.method} ({kernel})", plan=plan)
    density = None
    if config.record_density:
        density = report.density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
    inside = f" inside the {local.describe()}" if banded else ""
    return Outcome(SPARSE, f"method {config.method} ({kernel}){inside}", out, density)


def _compile_failure(exc: Exception) -> Optional[str]:
    """What a Triton kernel's failed compile said, or None where ``exc`` is no such failure. Nothing of the call
    was recorded yet, so dense attention takes it whole; the next call tries the compile again."""
    try:
        from .kernels.attention import is_triton_compile_failure
    except ImportError:  # no Triton: no Triton compile could have failed
        return None
    if not is_triton_compile_failure(exc):
        return None
    said = (str(exc).strip().splitlines() or [""])[-1][:300]
    return f"a Triton kernel failed to compile ({type(exc).__name__}: {said})"


