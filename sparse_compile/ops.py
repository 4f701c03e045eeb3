"""The registered op the rewrite inserts, its run-time decision, and the eager ``sparse_attention`` entry point.

``torch.ops.sparse_compile.causal_attention`` is opaque to Inductor: the choice between dense and sparse is
made here, per call, from the actual shapes and the ``sparsity`` region in force. So one compiled graph serves
every prompt length and every region without recompiling.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from . import report
from .config import SparseConfig
from .context import resolve
from .dense import dense_attention, dense_causal_attention
from .padding import PaddingLayout, check_query_positions, padding_layout
from .parallel import active_sequence_group, is_dtensor, register_dtensor_sharding, run_sequence_parallel

__all__ = ["causal_attention", "sparse_attention", "config_to_json", "config_from_json", "decide"]

log = logging.getLogger("sparse_compile")

DENSE, SPARSE = "dense", "sparse"
SPARSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- configuration travels inside the graph as a JSON string: the graph describes itself ---------------------
def _non_default(value: dict, default: dict) -> dict:
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            sub = _non_default(item, default[key])
            if sub:
                out[key] = sub
        elif item != default[key]:
            out[key] = list(item) if isinstance(item, tuple) else item
    return out


def config_to_json(config: SparseConfig) -> str:
    """Compact: only the fields that differ from the defaults (``{}`` is the default configuration)."""
    return json.dumps(_non_default(dataclasses.asdict(config), dataclasses.asdict(SparseConfig())), sort_keys=True)


@functools.lru_cache(maxsize=64)
def config_from_json(text: str) -> SparseConfig:
    return SparseConfig(**json.loads(text))


# -- the run-time decision: small named rules, each with the reason it gives when it fails -----------------
@dataclass(frozen=True)
class CallInfo:
    q: Tensor
    k: Tensor
    config: SparseConfig
    chunked_allowed: bool  # eager entry point: q_len < kv_len means queries at the last positions


@dataclass(frozen=True)
class Rule:
    name: str
    holds: Callable[[CallInfo], bool]
    reason: Callable[[CallInfo], str]


RUNTIME_RULES: tuple[Rule, ...] = (
    Rule("enabled", lambda c: c.config.enabled, lambda c: "sparsity disabled in this region"),
    Rule("not_decode", lambda c: c.q.shape[-2] > 1, lambda c: "decode step (q_len == 1)"),
    Rule(
        "self_attention_lengths",
        lambda c: c.q.shape[-2] == c.k.shape[-2] or (c.chunked_allowed and c.q.shape[-2] < c.k.shape[-2]),
        lambda c: f"q_len {c.q.shape[-2]} != kv_len {c.k.shape[-2]}: SDPA's is_causal aligns top-left there; "
        "left dense",
    ),
    Rule(
        "long_enough",
        lambda c: c.q.shape[-2] >= c.config.min_seq_len,
        lambda c: f"q_len {c.q.shape[-2]} < min_seq_len {c.config.min_seq_len}",
    ),
    Rule(
        "dtype",
        lambda c: c.q.dtype in SPARSE_DTYPES and c.k.dtype == c.q.dtype,
        lambda c: f"dtype {c.q.dtype} not supported by the sparse path (float16, bfloat16, float32)",
    ),
    Rule(
        "inference",
        lambda c: not (torch.is_grad_enabled() and (c.q.requires_grad or c.k.requires_grad)),
        lambda c: "inputs require grad: the sparse path is forward-only (inference)",
    ),
)


def decide(q: Tensor, k: Tensor, config: SparseConfig, *, chunked_allowed: bool = False) -> tuple[str, str]:
    """(path, reason): the first rule that fails sends the call to dense attention."""
    info = CallInfo(q, k, config, chunked_allowed)
    for rule in RUNTIME_RULES:
        if not rule.holds(info):
            return DENSE, rule.reason(info)
    return SPARSE, f"method {config.method}"


def _kernel_for(q: Tensor, config: SparseConfig) -> str:
    if config.kernel != "auto":
        return config.kernel
    return "triton" if q.is_cuda else "reference"


def run_sparse(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig):
    """Build the method's plan and execute it. Returns (output or None, reason, per-head density or None).

    ``None`` output means the method declined (``Unsupported``); the caller runs dense with the reason.
    """
    from .methods import Unsupported, build_plan

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    try:
        plan = build_plan(q, k, scale, config)
    except Unsupported as exc:
        return None, f"method {config.method}: {exc}", None
    kernel = _kernel_for(q, config)
    if kernel == "triton" and q.dtype == torch.float32 and q.is_cuda:
        return None, "float32 on GPU: the Triton kernel runs bfloat16/float16; left dense", None
    want_visits = config.record_density
    if kernel == "triton":
        from .kernels import block_sparse_attention

        result = block_sparse_attention(q, k, v, plan, scale, return_visited=want_visits)
    else:
        from .plan import reference_attention

        result = reference_attention(q, k, v, plan, scale, return_visited=want_visits)
    density = None
    if want_visits:
        out, visited = result
        density = report.density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
    else:
        out = result
    return out, f"method {config.method} ({kernel})", density


def run(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig,
        dense: Callable[[], Tensor], *, chunked_allowed: bool = False):
    """Decide and run the method or ``dense()``: (output, path, reason, per-head density or None)."""
    path, reason = decide(q, k, config, chunked_allowed=chunked_allowed)
    out = density = None
    if path == SPARSE:
        out, reason, density = run_sparse(q, k, v, scale, config)
        if out is None:
            path = DENSE
    if out is None:
        out = dense()
    return out, path, reason, density


def dispatch(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
             dense: Callable[[], Tensor], *, chunked_allowed: bool = False) -> Tensor:
    """Decide, run the method or ``dense()``, and record what happened at ``site``."""
    out, path, reason, density = run(q, k, v, scale, config, dense, chunked_allowed=chunked_allowed)
    report.record_call(site, path, reason, tuple(q.shape), density)
    return out


def padded_dispatch(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], config: SparseConfig, site: str,
                    layout: PaddingLayout) -> Tensor:
    """Causal attention with key padding, queries at the last positions: each group of rows with the same valid
    keys runs as an ordinary causal prefill over those keys (``padding.py``); padded query rows give zeros."""
    offset = k.shape[-2] - q.shape[-2]  # absolute position of query row 0
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
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
        og, path, reason, density = run(qg, kg, vg, scale, config,
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
    reason = f"{distinct[0] if len(distinct) == 1 else ' | '.join(distinct)} (padded batch: {layout.describe()})"
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
    binary_padding: bool = False,
) -> Tensor:
    """Drop-in for the attention call the rewrite replaced.

    ``from_mask=False``: ``scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=...)``
    (causal aligned top-left). ``from_mask=True``: the call had a traced mask proven causal with the queries at
    the last positions, AND the key padding ``key_padding`` (batch, kv_len; nonzero = valid) when given;
    ``query_positions`` is the ``cache_position`` input the mask read, held to ``arange(kv_len - q_len, kv_len)``.
    ``binary_padding``: the mask was proven for 0/1 padding values only; other values are an error.
    """
    # sequence parallelism (parallel.sequence_parallel): q/k/v are this rank's chunk of one sequence; the Ulysses
    # all-to-all runs _causal_attention on whole sequences for this rank's share of the heads
    group = active_sequence_group()
    if group is not None:
        return run_sequence_parallel(_causal_attention, group, q, k, v, key_padding, query_positions, scale=scale,
                                     enable_gqa=enable_gqa, site=site, config=config, from_mask=from_mask,
                                     binary_padding=binary_padding)
    return _causal_attention(q, k, v, scale, enable_gqa, site, config, key_padding, query_positions, from_mask,
                             binary_padding)


def _causal_attention(q, k, v, scale, enable_gqa, site, config, key_padding=None, query_positions=None,
                      from_mask=False, binary_padding=False):
    config_in_force = resolve(config_from_json(config))
    if not from_mask:
        out = dispatch(q, k, v, scale, config_in_force, site,
                       lambda: dense_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa))
        # a fixed layout, whatever the backend returned: the fake below promises contiguous
        return out.contiguous()
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
    return out.contiguous()


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, enable_gqa, site, config, key_padding=None, query_positions=None,
                           from_mask=False, binary_padding=False):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# -- eager entry point ----------------------------------------------------------------------------------------
def _validate(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"sparse_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"sparse_attention: {name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"sparse_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"sparse_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SPARSE_DTYPES + (torch.float64,):
        raise ValueError(f"sparse_attention: unsupported dtype {q.dtype}; use float16, bfloat16, float32 (or float64)")
    if k.shape != v.shape:
        raise ValueError(f"sparse_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"sparse_attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sparse_attention: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"sparse_attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"sparse_attention: q_len {q.shape[-2]} > kv_len {k.shape[-2]}; queries are the last q_len positions"
        )
    if q.shape[-2] == 0:
        raise ValueError("sparse_attention: q_len must be at least 1")


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, config: Optional[SparseConfig] = None
) -> Tensor:
    """Causal attention through the configured sparse method, for code that calls attention itself.

    SDPA-shaped: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)`` with ``Hq`` a multiple of ``Hkv`` (GQA, never
    repeated). Queries are the last ``Nq`` positions (``Nq < Nk`` is chunked prefill). Short sequences, decode
    steps and anything the method cannot do run exact dense attention, as under the compiled backend; a
    ``sparsity(...)`` block in force applies here too.
    """
    _validate(q, k, v)
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"sparse_attention: config must be a SparseConfig, got {type(config).__name__}")
    if is_dtensor(q):  # tensor parallelism: the op's DTensor sharding rule runs each rank's heads (parallel.py)
        register_dtensor_sharding()
        return causal_attention(q, k, v, scale, True, "sparse_attention", config_to_json(config or SparseConfig()),
                                from_mask=True)
    return dispatch(q, k, v, scale, resolve(config or SparseConfig()), "sparse_attention",
                    lambda: dense_causal_attention(q, k, v, scale=scale), chunked_allowed=True)
