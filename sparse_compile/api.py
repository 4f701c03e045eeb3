"""Entry points besides the compiled backend: ``sparse_attention`` for code that calls attention itself, and
``precompile``, which compiles the kernels ahead of the first long prompt (``precompile_kernels``: the backend's
share of it, per compiled graph)."""

from __future__ import annotations

import numbers
import time
import warnings
from typing import Optional

import torch
from torch import Tensor

from .attention_op import OP, causal_attention
from .config import SparseConfig
from .context import resolve
from .local import Local
from .masks import example_value
from .parallel import is_dtensor, register_dtensor_sharding
from .pipeline import EAGER_SITE, attend_eager, attend_segments, run_method
from .rules import SUPPORTED_DTYPES, autocast_inputs, prefill_length, too_short, validate_qkv
from .site import SiteSpec
from .state import STATE

__all__ = ["sparse_attention", "varlen_attention", "VARLEN_SITE", "precompile", "precompile_kernels",
           "PRECOMPILE_LENGTH", "PRECOMPILED_ENTRIES"]


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, config: Optional[SparseConfig] = None,
    window: Optional[int] = None, chunk: Optional[int] = None,
) -> Tensor:
    """Causal attention through the configured sparse method, for code that calls attention itself.

    SDPA-shaped: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)`` with ``Hq`` a multiple of ``Hkv`` (GQA, never
    repeated). Queries are the last ``Nq`` positions (``Nq < Nk`` is chunked prefill). Short sequences, decode
    steps and anything the method cannot do run exact dense attention, as under the compiled backend; a
    ``sparsity(...)`` block in force applies here too.

    At the defaults (``SparseConfig()``: ``min_seq_len=16384``) every call shorter than 16,384 tokens runs dense:
    its error against SDPA is exactly 0 and nothing is skipped. The first such prefill in a process says so once
    (a ``UserWarning`` naming ``min_seq_len``); to run the method on shorter inputs pass
    ``config=SparseConfig(min_seq_len=...)`` or open ``sparsity(min_seq_len=...)``. ``runtime_stats()
    ["sparse_attention"]`` records each call's path and reason.

    ``window`` (a positive int, None: none): a sliding window on top of causal, query ``i`` seeing key ``j`` only
    where ``i - j < window`` (transformers' ``sliding_window``); ``chunk`` (a positive int, None: none): chunked
    local attention, ``j // chunk == i // chunk`` (Llama 4's ``attention_chunk_size``); both may be given.
    Positions count from key 0, the queries being the last ``Nq``. A window shorter than ``min_seq_len`` (or a
    call shorter than it) and chunks run exactly, on the kernels, over only the tiles that meet the band ("exact
    band" in ``runtime_stats()``); a longer window runs the method inside it (``pipeline`` docstring). A call the
    rules send dense runs SDPA with the band as an explicit (Nq, Nk) mask.
    """
    q, k, v = autocast_inputs(q, k, v)  # as SDPA runs under autocast
    validate_qkv(q, k, v, who="sparse_attention", dtypes=SUPPORTED_DTYPES + (torch.float64,), empty_ok=True)
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"sparse_attention: config must be a SparseConfig, got {type(config).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"sparse_attention: scale must be a float or None (1/sqrt(head_dim)), got "
                        f"{type(scale).__name__}")
    local = Local(_band_argument("window", window), _band_argument("chunk", chunk))
    if not _WARNED_SHORT.value and not local.binds(k.shape[-2]):  # a binding band runs on the kernels, short too
        _warn_if_short(q, k, config)
    if is_dtensor(q):  # tensor parallelism: the op's DTensor sharding rule runs each rank's heads (parallel.py)
        register_dtensor_sharding()
        spec = SiteSpec(EAGER_SITE, config or SparseConfig(), enable_gqa=True, queries_last=True,
                        window=local.window, chunk=local.chunk)
        return causal_attention(q, k, v, scale, spec.to_json())
    return attend_eager(q, k, v, scale, config, local)


def _band_argument(name: str, value) -> int:
    """``window=`` / ``chunk=`` of ``sparse_attention`` as ``Local`` takes it (0: none), or the error naming it."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"sparse_attention: {name} must be a positive int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"sparse_attention: {name} must be a positive int or None (no {name}), got {value}")
    return int(value)


_WARNED_SHORT = STATE.value("api.warned_short", False)  # the first prefill below min_seq_len has said so


def _warn_if_short(q: Tensor, k: Tensor, config: Optional[SparseConfig]) -> None:
    """Once per process: a ``UserWarning`` at the first prefill (more than one query) that runs dense only because
    it is shorter than ``min_seq_len`` (an exact result that reads as "sparse and exact" otherwise)."""
    resolved = resolve(config or SparseConfig())
    queries, keys = q.shape[-2], k.shape[-2]
    if not resolved.enabled or queries < 2 or prefill_length(queries, keys) >= resolved.min_seq_len:
        return
    _WARNED_SHORT.value = True
    warnings.warn(f"sparse_attention: {too_short(queries, keys, resolved.min_seq_len)}: this call runs exact dense "
                  "attention (error 0 against SDPA, no speedup), as does every call shorter than min_seq_len; to run "
                  "the sparse method on shorter inputs pass config=SparseConfig(min_seq_len=...) or open "
                  "sparse_compile.sparsity(min_seq_len=...) (said once per process)", UserWarning, stacklevel=3)


VARLEN_SITE = "varlen_attention"  # the site of varlen_attention's calls in runtime_stats()


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     scale: Optional[float] = None, config: Optional[SparseConfig] = None) -> Tensor:
    """Causal attention over packed sequences, in ``flash_attn_varlen_func``'s convention.

    q ``(T_q, Hq, D)``, k and v ``(T_k, Hkv, D)``: the sequences one after another; ``cu_seqlens_q`` /
    ``cu_seqlens_k``: ``(S + 1,)`` integer offsets from 0 to ``T_q`` / ``T_k``. Sequence ``s`` is the queries
    ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``, the last positions of its keys ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``
    (a whole prompt, a chunk over its cache, or one decode token). Each sequence is decided by the same rules as a
    call of its own and recorded as one in ``runtime_stats()`` (site ``"varlen_attention"``): long ones run the
    method, short ones and decode tokens dense, each with its reason. Returns ``(T_q, Hq, D)``. Reads the offsets on
    the host once per call; on the kernels the sequences then run in one launch (``sparse_compile/packed.py``;
    docs/design.md, "Serving", says what runs apart).
    """
    lengths = _varlen_segments(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"varlen_attention: config must be a SparseConfig, got {type(config).__name__}")
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in autocast_inputs(q, k, v))
    validate_qkv(q4, k4, v4, who="varlen_attention", dtypes=SUPPORTED_DTYPES + (torch.float64,), empty_ok=True,
                 longer_queries_ok=True)
    resolved = resolve(config or SparseConfig()).for_site(VARLEN_SITE)
    out = attend_segments(q4, k4, v4, scale, resolved, VARLEN_SITE, lengths)
    return out[0].transpose(0, 1)


def _varlen_segments(q, k, v, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """The (q_start, q_end, k_start, k_end) of each sequence, or a ValueError naming the argument at fault."""
    who = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{who}: {name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    offsets = {}
    for name, cu, tensor in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{who}: {name} must be 1-D with at least one offset, got shape {tuple(cu.shape)}")
        if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.is_complex():
            raise ValueError(f"{who}: {name} must hold integers (int32 or int64), got {cu.dtype}")
        if cu.device != tensor.device:
            raise ValueError(f"{who}: {name} is on {cu.device}, the tensors on {tensor.device}")
        values = cu.tolist()
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{who}: {name} must start at 0 and never decrease, got {values[:8]}"
                             f"{'...' if len(values) > 8 else ''}")
        if values[-1] != tensor.shape[0]:
            raise ValueError(f"{who}: {name} ends at {values[-1]}, but {'q' if tensor is q else 'k'} holds "
                             f"{tensor.shape[0]} tokens")
        offsets[name] = values
    starts_q, starts_k = offsets["cu_seqlens_q"], offsets["cu_seqlens_k"]
    if len(starts_q) != len(starts_k):
        raise ValueError(f"{who}: cu_seqlens_q and cu_seqlens_k describe {len(starts_q) - 1} and "
                         f"{len(starts_k) - 1} sequences")
    segments = []
    for s, (q0, q1, k0, k1) in enumerate(zip(starts_q, starts_q[1:], starts_k, starts_k[1:])):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"{who}: sequence {s} has {q1 - q0} queries but {k1 - k0} keys (the queries are the "
                             "last positions of their keys)")
        if q1 > q0:
            segments.append((q0, q1, k0, k1))
    return tuple(segments)


# -- kernels compiled ahead of the first long prompt ---------------------------------------------------------------
# the specialisations already run (device, dtype, heads, dims, length, configuration): one each per process,
# least recently used dropped past PRECOMPILED_ENTRIES (running one again costs a short call, never a wrong result)
PRECOMPILED_ENTRIES = 256
_PRECOMPILED = STATE.lru("api.precompiled", PRECOMPILED_ENTRIES)
PRECOMPILE_LENGTH = 4096  # past every method's default block and segment: each kernel of the plan's path runs


def _run_once(device, dtype, heads: int, kv_heads: int, head_dim: int, value_dim: int, length: int,
              config: SparseConfig) -> bool:
    """Run ``config``'s method once on random inputs of this specialisation (once per process); True if it ran."""
    key = (str(device), dtype, heads, kv_heads, head_dim, value_dim, length, config.to_json())
    if _PRECOMPILED.touch(key):
        return False
    _PRECOMPILED.put(key, None)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn((1, h, length, d), generator=generator, device=device, dtype=dtype)
               for h, d in ((heads, head_dim), (kv_heads, head_dim), (kv_heads, value_dim)))
    with torch.no_grad():
        run_method(q, k, v, None, config)
    return True


def precompile_kernels(gm: torch.fx.GraphModule, config: SparseConfig) -> int:
    """Run the configured method once on a short random problem of each rewritten site's dtype, head dims and GQA
    group, on its GPU (the backend calls this after the rewrite). Kernels whose specialisation does not depend
    on the length are then compiled with the graph, reported as compile time, instead of inside the first
    prompt's attention. CPU graphs are left alone (the reference path compiles nothing). Returns how many ran."""
    ran = 0
    for node in gm.graph.find_nodes(op="call_function", target=OP):
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
    This runs each method (default: the configuration's) on two GQA groups (``group`` query heads per key/value
    head) at every power-of-two length from 4096 to ``max_len``; other lengths and head counts (above one) reuse
    those kernels (``kernels.common.LENGTH_ARGS``). Triton keeps compiled kernels in its on-disk
    cache, so later processes on the machine load them instead of compiling: run it once per machine (and Triton
    or package version), e.g. ``python -c "import sparse_compile; sparse_compile.precompile(1 << 20)"``.
    """
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
            _run_once(device, dtype, 2 * group, 2, head_dim, head_dim, min(length, max_len), base.replace(method=name))
        if length >= max_len:
            break
        length *= 2
    torch.cuda.synchronize(device)
    return time.perf_counter() - started
