"""The registered op the rewrite inserts, its run-time decision, and the eager entry points ``sparse_attention`` and
``ulysses_attention`` (the same over a sequence sharded across ranks).

``torch.ops.sparse_compile.causal_attention`` is opaque to Inductor: the choice between dense and sparse is
made here, per call, from the actual shapes and the ``sparsity`` region in force. So one compiled graph serves
every prompt length and every region without recompiling.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import json
import logging
import math
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import forward_ad

from . import report
from .config import SparseConfig
from .context import resolve
from .dense import dense_attention, dense_causal_attention
from .breakeven import HISTORY, break_even_density, has_table, lowest_density, plan_shape
from .masks import _example as example_value  # a graph node's traced (fake) value
from .padding import PaddingLayout, check_query_positions, padding_layout
from .plan import causal_tile_count, execute_plan
from .runtime_mask import check_runtime_mask
from .registry import method_spec
from .rules import RUNTIME_RULES, SUPPORTED_DTYPES, CallInfo, first_failure, validate_qkv
from .parallel import active_sequence_group, is_dtensor, register_dtensor_sharding, run_sequence_parallel
# the Ulysses collectives, for ulysses_attention below
from .parallel import _agree, _heads_to_sequence, _process_group, _sequence_to_heads

__all__ = ["causal_attention", "sparse_attention", "ulysses_attention", "precompile", "config_to_json",
           "config_from_json", "decide", "capturing"]

log = logging.getLogger("sparse_compile")

DENSE, SPARSE = "dense", "sparse"
REPLANNED = "re-planned"  # run_sparse's reason when it only built a plan for the density history


# -- configuration travels inside the graph as a JSON string: the graph describes itself ---------------------
def _non_default(value: dict, default: dict) -> dict:
    out = {}
    for key, item in value.items():
        if key not in default:  # an entry of a free-form mapping (site_params): kept whole
            out[key] = item
        elif isinstance(item, dict):
            sub = _non_default(item, default[key])
            if sub:
                out[key] = sub
        elif item != default[key]:
            out[key] = list(item) if isinstance(item, tuple) else item
    return out


def config_to_json(config: SparseConfig) -> str:
    """Compact: only the fields that differ from the defaults (``{}`` is the default configuration)."""
    return json.dumps(_non_default(config.to_dict(), SparseConfig().to_dict()), sort_keys=True)


@functools.lru_cache(maxsize=64)
def config_from_json(text: str) -> SparseConfig:
    return SparseConfig(**json.loads(text))


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


# -- the run-time decision: ``rules.RUNTIME_RULES``, the first that fails sends the call to dense attention ------
def decide(q: Tensor, k: Tensor, v: Tensor, config: SparseConfig, site: str = "", *,
           chunked_allowed: bool = False, scale: Optional[float] = None) -> tuple[str, str]:
    """(path, reason) of one call."""
    info = CallInfo(q, k, v, config, site, chunked_allowed, scale)
    failed = first_failure(RUNTIME_RULES, info)
    if failed is not None:
        return DENSE, failed.reason(info)
    return SPARSE, f"method {config.method}"


def _kernel_for(q: Tensor, config: SparseConfig) -> str:
    if config.kernel != "auto":
        return config.kernel
    return "triton" if q.is_cuda else "reference"


def run_sparse(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig,
               history_key: Optional[tuple] = None, *, plan_only: bool = False):
    """Build the method's plan and execute it. Returns (output or None, reason, per-head density or None).

    ``None`` output means the method declined (``Unsupported``) or, with ``plan_only``, that the plan was only
    built to be remembered; the caller runs dense. With a ``history_key`` the plan's density (visited tiles
    under early stop, which only running the plan tells: ``plan_only`` then runs it all the same) is remembered
    for the break-even decision.
    """
    from .methods import Unsupported, build_plan

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kernel = _kernel_for(q, config)
    if kernel == "triton" and q.dtype == torch.float32 and q.is_cuda:
        return None, "float32 on GPU: the Triton kernel runs bfloat16/float16; left dense", None
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    if plan_only and getattr(config.params_of(config.select_stage), "early_stop", 0) > 0:
        # early stop: only running the plan tells its cost. One KV head's group is planned and run (1/Hkv of the
        # selection's and the kernel's time, a different group at each re-plan); the whole call runs dense
        try:
            _probe_group(q, k, v, scale, config, kernel, history_key)
        except Unsupported as exc:
            return None, f"method {config.method}: {exc}", None
        return None, REPLANNED, None
    try:
        plan = build_plan(q, k, scale, config)
    except Unsupported as exc:
        return None, f"method {config.method}: {exc}", None
    if plan_only:
        HISTORY.record(history_key, _listed_or_visited(plan, q, k, v, scale, config, kernel),
                       plan_shape(plan, config.select_stage), config)
        return None, REPLANNED, None
    # early stop decides at run time how many tiles a plan costs: count the visits when the count is wanted
    want_visits = config.record_density or (history_key is not None and plan.early_stop > 0)
    result = _execute(q, k, v, plan, scale, config, kernel, want_visits)
    out, visited = result if want_visits else (result, None)
    if history_key is not None:
        if visited is not None:
            listed = _visited_density(visited, plan, num_queries, num_keys)
        else:
            listed = plan.density(num_queries, num_keys).mean()
        HISTORY.record(history_key, listed, plan_shape(plan, config.select_stage), config)
    density = None
    if config.record_density:
        density = report.density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
    return out, f"method {config.method} ({kernel})", density


def _execute(q: Tensor, k: Tensor, v: Tensor, plan, scale: float, config: SparseConfig, kernel: str,
             return_visited: bool):
    """``plan`` through its method's own executor (S2O: segment chunks), else ``execute_plan``."""
    executor = method_spec(config.select_stage).execute
    if executor is not None:
        return executor(q, k, v, plan, scale, config, kernel=kernel, return_visited=return_visited)
    return execute_plan(q, k, v, plan, scale, kernel=kernel, return_visited=return_visited)


def _visited_density(visited: Tensor, plan, num_queries: int, num_keys: int) -> Tensor:
    """The share of the causal tiles that were computed (0-d, on visited's device: no sync)."""
    total = causal_tile_count(num_queries, num_keys, plan.block_m, plan.block_n) * visited[:, :, 0].numel()
    return visited.sum(dtype=torch.float32) / max(total, 1)


_PROBES = itertools.count()


def _probe_group(q: Tensor, k: Tensor, v: Tensor, scale: float, config: SparseConfig, kernel: str,
                 history_key: tuple) -> None:
    """Plan and run one KV head's group (every method's plan is per head: the same as the whole plan's slice) and
    remember the tiles it visited (the density under early stop)."""
    from .methods import build_plan

    heads_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    kv_head = next(_PROBES) % heads_kv
    heads = slice(kv_head * group, (kv_head + 1) * group)
    qs, ks, vs = q[:, heads], k[:, kv_head:kv_head + 1], v[:, kv_head:kv_head + 1]
    plan = build_plan(qs, ks, scale, config)
    HISTORY.record(history_key, _listed_or_visited(plan, qs, ks, vs, scale, config, kernel),
                   plan_shape(plan, config.select_stage), config)


def _listed_or_visited(plan, q: Tensor, k: Tensor, v: Tensor, scale: float, config: SparseConfig,
                       kernel: str) -> Tensor:
    """The density a re-plan remembers: the tiles listed, or under early stop the tiles visited (run it)."""
    if plan.early_stop == 0:
        return plan.density(q.shape[-2], k.shape[-2]).mean()
    _, visited = _execute(q, k, v, plan, scale, config, kernel, True)
    return _visited_density(visited, plan, q.shape[-2], k.shape[-2])


def _break_even(q: Tensor, k: Tensor, config: SparseConfig, site: str) -> tuple[Optional[str], Optional[tuple], bool]:
    """(why this call should run dense, or None; the history key when the decision depends on history; whether
    to plan again although the call runs dense)."""
    if not config.dense_when_faster or not has_table(q.device):
        return None, None, False  # no measured table for this device: the configured method runs
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    key = HISTORY.key(site, config, q, k)
    predicted = HISTORY.prediction(key)
    shape = predicted[1] if predicted is not None else HISTORY.shape_of(config)
    limit = None if shape is None else break_even_density(q.device, shape, num_keys)
    if limit is not None:
        lowest = lowest_density(shape, num_queries, num_keys)
        if limit < lowest:  # no plan can win at this length: do not even plan
            return (f"break-even density {limit:.2f} is below the least any {shape} plan keeps at {num_keys} keys "
                    f"({lowest:.2f})"), None, False
    if predicted is None or limit is None:
        return None, key, False
    density = predicted[0]
    if density <= limit:
        HISTORY.went_sparse(key)
        return None, key, False
    reason = f"plan density {density:.2f} above break-even {limit:.2f} (this site's last plan, {shape} tiles)"
    return reason, key, HISTORY.should_probe(key)


def run(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
        dense: Callable[[], Tensor], *, chunked_allowed: bool = False):
    """Decide and run the method or ``dense()``: (output, path, reason, per-head density or None)."""
    capture = _CAPTURE.get()
    if capture is not None:
        capture(site, q, k, v, scale, chunked_allowed)
    path, reason = decide(q, k, v, config, site, chunked_allowed=chunked_allowed, scale=scale)
    out = density = None
    if path == SPARSE:
        slower, history_key, replan = _break_even(q, k, config, site)
        if slower is not None and not replan:
            path, reason = DENSE, slower
        else:
            out, reason, density = run_sparse(q, k, v, scale, config, history_key, plan_only=replan)
            if out is None:
                path = DENSE
                if reason == REPLANNED:
                    reason = f"{slower}; planned again, for the next call"
    if out is None:
        out = dense()
    return out, path, reason, density


def dispatch(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
             dense: Callable[[], Tensor], *, chunked_allowed: bool = False, note: str = "") -> Tensor:
    """Decide, run the method or ``dense()``, and record what happened at ``site`` (``note`` appended)."""
    out, path, reason, density = run(q, k, v, scale, config, site, dense, chunked_allowed=chunked_allowed)
    report.record_call(site, path, reason + note, tuple(q.shape), density)
    return out


def padded_dispatch(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                    layout: PaddingLayout, note: str = "") -> Tensor:
    """Causal attention with key padding, queries at the last positions: each group of rows with the same valid
    keys runs as an ordinary causal prefill over those keys (``padding.py``); padded query rows give zeros."""
    offset = k.shape[-2] - q.shape[-2]  # absolute position of query row 0
    out = torch.zeros_like(q)
    paths, reasons, densities = [], [], []
    for group in layout.groups:
        rows = group.row_selector()
        if group.index is None:
            lo = max(group.start, offset)
            if group.end <= lo:
                continue  # no valid query in these rows
            queries = slice(lo - offset, group.end - offset)
            qg, kg, vg = q[rows][:, :, queries], k[rows][:, :, group.start:group.end], v[rows][:, :, group.start:group.end]
        else:
            keys = group.index
            queries = keys[keys >= offset] - offset
            if queries.numel() == 0:
                continue
            qg, kg, vg = q[rows][:, :, queries], k[rows][:, :, keys], v[rows][:, :, keys]
        og, path, reason, density = run(qg, kg, vg, scale, config, site,
                                        lambda: dense_causal_attention(qg, kg, vg, scale=scale), chunked_allowed=True)
        if isinstance(rows, slice):
            out[rows, :, queries] = og
        else:
            for i, row in enumerate(rows):
                out[row, :, queries] = og[i]
        paths.append(path)
        reasons.append(reason)
        if density is not None:
            densities.append(density)
    path = SPARSE if SPARSE in paths else DENSE
    distinct = sorted(set(reasons))
    reason = (f"{distinct[0] if len(distinct) == 1 else ' | '.join(distinct)} (padded batch: {layout.describe()})"
              f"{note}")
    density = [sum(col) / len(col) for col in zip(*densities)] if densities else None
    report.record_call(site, path, reason, tuple(q.shape), density)
    return out


# -- the registered op ---------------------------------------------------------------------------------------
# run-time decisions and host-side bookkeeping must run on every call: never capture the op in a CUDA graph
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("sparse_compile::causal_attention", mutates_args=(), tags=_TAGS)
def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], enable_gqa: bool, site: str, config: str,
    key_padding: Optional[Tensor] = None, query_positions: Optional[Tensor] = None, from_mask: bool = False,
    binary_padding: bool = False, heads_inner: bool = True, runtime_mask: Optional[Tensor] = None,
) -> Tensor:
    """Drop-in for the attention call the rewrite replaced.

    ``from_mask=False``: ``scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=...)``
    (causal aligned top-left). ``from_mask=True``: the call had a traced mask proven causal with the queries at
    the last positions, AND the key padding ``key_padding`` (batch, kv_len; nonzero = valid) when given;
    ``query_positions`` is the ``cache_position`` input the mask read, held to ``arange(kv_len - q_len, kv_len)``.
    ``binary_padding``: the mask was proven for 0/1 padding values only; other values are an error.
    ``heads_inner``: the output's memory layout, the one the replaced call returned (see ``output_layout``).
    ``runtime_mask``: the call's ``attn_mask``, a graph input the rewrite could not prove: checked here, per forward
    pass (``runtime_mask.py``); causal AND key padding runs as a proven mask, anything else as the original call.
    """
    # an empty call, or (is_causal, top-left) more queries than keys: valid SDPA calls, run dense (RUNTIME_RULES)
    validate_qkv(q, k, v, who=f"sparse_compile.causal_attention ({site})", empty_ok=True,
                 longer_queries_ok=not from_mask or runtime_mask is not None)
    if forward_ad._current_level >= 0:
        # PyTorch's custom ops drop forward-mode tangents silently: refuse rather than return a tangent-less result
        # (the backend runs a graph called under forward AD without this op, and sparse_attention goes dense)
        raise RuntimeError(
            f"sparse_compile.causal_attention ({site}): called under forward-mode AD (forward_ad.dual_level); this "
            "op has no forward derivative. Call the compiled model or sparse_attention instead: they run such "
            "calls through dense attention."
        )
    # sequence parallelism (parallel.sequence_parallel): q/k/v are this rank's chunk of one sequence; the Ulysses
    # all-to-all runs _causal_attention on whole sequences for this rank's share of the heads
    group = active_sequence_group()
    if group is not None and runtime_mask is not None:
        # each rank holds its chunk of the mask: it cannot be checked for, or applied to, the whole sequence
        raise RuntimeError(
            f"sparse_compile.causal_attention ({site}): this site's attn_mask arrives as a graph input (checked at "
            "run time), which sequence_parallel does not support: each rank's mask covers its own chunk only. "
            "Build the mask inside the compiled function, or pass is_causal=True."
        )
    if group is not None:
        out = run_sequence_parallel(_causal_attention, group, q, k, v, key_padding, query_positions, scale=scale,
                                    enable_gqa=enable_gqa, site=site, config=config, from_mask=from_mask,
                                    binary_padding=binary_padding)
    else:
        out = _causal_attention(q, k, v, scale, enable_gqa, site, config, key_padding, query_positions, from_mask,
                                binary_padding, runtime_mask)
    return in_output_layout(out, heads_inner)


def _causal_attention(q, k, v, scale, enable_gqa, site, config, key_padding=None, query_positions=None,
                      from_mask=False, binary_padding=False, runtime_mask=None):
    config_in_force = resolve(config_from_json(config)).for_site(site)
    if runtime_mask is not None:
        return _checked_mask_attention(q, k, v, scale, enable_gqa, site, config_in_force, runtime_mask)
    if not from_mask:
        return dispatch(q, k, v, scale, config_in_force, site,
                        lambda: dense_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa))
    if query_positions is not None:
        check_query_positions(query_positions, q.shape[-2], k.shape[-2])
    layout = None if key_padding is None else padding_layout(key_padding, k.shape[-2])
    if binary_padding and layout is not None and not layout.binary:
        raise ValueError(
            f"sparse_compile ({site}): the attention_mask holds values other than 0 and 1; this model's traced mask "
            "treats such values differently, and the rewrite proved it for 0/1 masks only. Pass a 0/1 mask."
        )
    if layout is None or layout.all_valid:
        out = dispatch(q, k, v, scale, config_in_force, site,
                       lambda: dense_causal_attention(q, k, v, scale=scale), chunked_allowed=True)
    else:
        out = padded_dispatch(q, k, v, scale, config_in_force, site, layout)
    return out


def _checked_mask_attention(q, k, v, scale, enable_gqa, site, config: SparseConfig, mask: Tensor) -> Tensor:
    """The call ``sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)`` with a mask checked here."""
    verdict = check_runtime_mask(mask, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
    if not verdict.causal:
        out = dense_attention(q, k, v, is_causal=False, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        report.record_call(site, DENSE, verdict.reason, tuple(q.shape))
        return out
    kept = verdict.num_keys  # keys past the last query's reach are masked for every row: not attended
    k, v = k[:, :, :kept], v[:, :, :kept]
    note = f"; {verdict.reason}"
    layout = padding_layout(verdict.key_valid, kept)
    if layout.all_valid:
        return dispatch(q, k, v, scale, config, site, lambda: dense_causal_attention(q, k, v, scale=scale),
                        chunked_allowed=True, note=note)
    return padded_dispatch(q, k, v, scale, config, site, layout, note=note)


def output_layout(example: Tensor) -> bool:
    """``heads_inner`` for the op that replaces an attention call whose (fake) output is ``example``: True when its
    memory is (B, N, H, D) (what SDPA's fused GPU kernels return, and what CPU SDPA returns for the usual
    transposed projections), False for contiguous (B, H, N, D). The op returns the replaced call's layout, so a
    program that views the output (``o.view(B, H * N, D)``) keeps working; strides are compared only where they
    are known without a guard (symbolic lengths: contiguous (B, H, N, D) has stride(1) = N * D)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if example.dim() != 4 or example.shape[1] == 1:
        return True
    return bool(statically_known_true(example.stride(1) < example.stride(2)))


def _output_strides(shape, heads_inner: bool) -> tuple[int, ...]:
    batch, heads, length, dim = shape
    if heads_inner:
        return length * heads * dim, dim, heads * dim, 1
    return heads * length * dim, length * dim, dim, 1


def in_output_layout(out: Tensor, heads_inner: bool = True) -> Tensor:
    """``out`` (B, H, N, D) in the memory layout the fake below promises, whatever the path returned.

    A fixed layout per site, so Inductor's stride assumptions hold however it lays q out. The usual one is
    heads-inner ((B, N, H, D) memory): what attention outputs are read in next (``out.transpose(1, 2).reshape(B,
    N, H * D)``), so that step copies nothing; SDPA's fused kernels and the sparse kernel (which mirrors q's
    projection layout) already return it: no copy then. Sizes of 1 carry no layout: any stride passes there.
    """
    expected = _output_strides(out.shape, heads_inner)
    if all(size == 1 or stride == want for size, stride, want in zip(out.shape, out.stride(), expected)):
        return out
    if heads_inner:
        fixed = out.new_empty((out.shape[0], out.shape[2], out.shape[1], out.shape[3])).transpose(1, 2)
    else:
        fixed = out.new_empty(out.shape)
    return fixed.copy_(out)


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, enable_gqa, site, config, key_padding=None, query_positions=None,
                           from_mask=False, binary_padding=False, heads_inner=True, runtime_mask=None):
    if heads_inner:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[-1]))


# -- kernels compiled ahead of the first long prompt ---------------------------------------------------------------
_PRECOMPILED: set = set()
PRECOMPILE_LENGTH = 4096  # past every method's default block and segment: each kernel of the plan's path runs


def _run_once(device, dtype, heads: int, kv_heads: int, head_dim: int, value_dim: int, length: int,
              config: SparseConfig) -> bool:
    """Run ``config``'s method once on random inputs of this specialisation (once per process); True if it ran."""
    key = (str(device), dtype, heads, kv_heads, head_dim, value_dim, length, config_to_json(config))
    if key in _PRECOMPILED:
        return False
    _PRECOMPILED.add(key)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn((1, h, length, d), generator=generator, device=device, dtype=dtype)
               for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, value_dim)))
    with torch.no_grad():
        run_sparse(q, k, v, None, config)
    return True


def precompile_kernels(gm: torch.fx.GraphModule, config: SparseConfig) -> int:
    """Run the configured method once on a short random problem of each rewritten site's dtype, head dims and GQA
    group, on its GPU (the backend calls this after the rewrite). Kernels whose specialisation does not depend
    on the length are then compiled with the graph, reported as compile time, instead of inside the first
    prompt's attention. CPU graphs are left alone (the reference path compiles nothing). Returns how many ran."""
    ran = 0
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.sparse_compile.causal_attention.default):
        q, k, v = (example_value(arg) for arg in node.args[:3])
        if not all(isinstance(t, Tensor) and t.device.type == "cuda" for t in (q, k, v)):
            continue
        dims = (q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])
        if all(isinstance(d, int) for d in dims) and q.dtype in (torch.float16, torch.bfloat16):
            ran += _run_once(q.device, q.dtype, *dims, PRECOMPILE_LENGTH, config)
    return ran


def precompile(max_len: int, *, methods=None, head_dim: int = 128, group: int = 4,
               dtype: torch.dtype = torch.bfloat16, device=None, config: Optional[SparseConfig] = None) -> float:
    """Compile every kernel a prompt of up to ``max_len`` tokens runs, ahead of time; returns the seconds it took.

    The planning kernels are specialised by the power of two of the key tiles a row sees, so each doubling of the
    length compiles new variants; on a first prompt of 512K-1M tokens that compile would land inside the call.
    This runs each method (default: the configuration's) on one GQA group (``group`` query heads, one key/value
    head) at every power-of-two length from 4096 to ``max_len``. Triton keeps compiled kernels in its on-disk
    cache, so later processes on the machine load them instead of compiling: run it once per machine (and Triton
    or package version), e.g. ``python -c "import sparse_compile; sparse_compile.precompile(1 << 20)"``.
    """
    import time

    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"precompile: max_len must be a positive int, got {max_len!r}")
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise ValueError(f"precompile: kernels are compiled for a CUDA device, got {device}")
    base = resolve(config or SparseConfig())
    names = (base.method,) if methods is None else tuple(methods)
    started = time.perf_counter()
    length = PRECOMPILE_LENGTH
    while True:
        for name in names:
            _run_once(device, dtype, group, 1, head_dim, head_dim, min(length, max_len), base.replace(method=name))
        if length >= max_len:
            break
        length *= 2
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


# -- eager entry point ----------------------------------------------------------------------------------------
def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, config: Optional[SparseConfig] = None
) -> Tensor:
    """Causal attention through the configured sparse method, for code that calls attention itself.

    SDPA-shaped: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)`` with ``Hq`` a multiple of ``Hkv`` (GQA, never
    repeated). Queries are the last ``Nq`` positions (``Nq < Nk`` is chunked prefill). Short sequences, decode
    steps and anything the method cannot do run exact dense attention, as under the compiled backend; a
    ``sparsity(...)`` block in force applies here too.
    """
    validate_qkv(q, k, v, who="sparse_attention", dtypes=SUPPORTED_DTYPES + (torch.float64,), empty_ok=True)
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"sparse_attention: config must be a SparseConfig, got {type(config).__name__}")
    if is_dtensor(q):  # tensor parallelism: the op's DTensor sharding rule runs each rank's heads (parallel.py)
        register_dtensor_sharding()
        return causal_attention(q, k, v, scale, True, "sparse_attention", config_to_json(config or SparseConfig()),
                                from_mask=True)
    site = "sparse_attention"
    return dispatch(q, k, v, scale, resolve(config or SparseConfig()).for_site(site), site,
                    lambda: dense_causal_attention(q, k, v, scale=scale), chunked_allowed=True)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, scale: Optional[float] = None,
                      config: Optional[SparseConfig] = None) -> Tensor:
    """``sparse_attention`` over a sequence sharded across ``group`` (default: the whole world), for code that
    calls attention itself.

    q ``(B, Hq, n, D)``, k and v ``(B, Hkv, n, D)``: this rank's chunk of the sequence (chunks in rank order;
    lengths may differ between ranks). Returns this rank's chunk of causal attention over the whole sequence,
    ``(B, Hq, n, D)``. Hq and Hkv must be divisible by the group size. Inference only.
    """
    validate_qkv(q, k, v, who="ulysses_attention", dtypes=SUPPORTED_DTYPES + (torch.float64,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("ulysses_attention: inference only (the all-to-all has no backward); "
                           "call it under torch.no_grad()")
    group = _process_group(group, "ulysses_attention")
    chunks = _agree("ulysses_attention", group, q, k, v)
    if chunks.world == 1:
        return sparse_attention(q, k, v, scale=scale, config=config)
    q_heads, k_heads, v_heads = _sequence_to_heads((q, k, v), group, chunks)
    out = sparse_attention(q_heads, k_heads, v_heads, scale=scale, config=config)
    return _heads_to_sequence(out, group, chunks, dist.get_rank(group))
