"""Checks and small helpers shared by the kernels' host wrappers and the package above them.

The bottom layer: plain tensors and Python numbers, no Triton import, nothing from ``sparse_compile``. The op, the
eager ``sparse_attention``, the kernels' host wrappers and ``check_plan`` all validate q/k/v here, so a bad input
gets the same message whichever door it came through.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

__all__ = ["SUPPORTED_DTYPES", "MAX_HEAD_DIM", "KERNEL_OPTIONS", "cdiv", "validate_qkv", "validate_passes",
           "expand_heads", "check_kernel_options"]

#: the Triton kernel's launch parameters a caller may set over its default choice (``block_sparse_attention(options=)``,
#: ``SparseConfig(kernel_options=...)``): name -> (allowed values, what it sets)
KERNEL_OPTIONS = {
    "num_warps": ((1, 2, 4, 8, 16), "warps per program"),
    "num_stages": (tuple(range(1, 9)), "software-pipelining depth of the loop over unmasked tiles"),
    "masked_stages": ((None,) + tuple(range(1, 9)), "the same for the loop over masked tiles (None: min(stages, 2))"),
    "use_tma": ((None, True, False), "TMA loads (None: where the GPU and layout allow)"),
}


def check_kernel_options(options, who: str) -> None:
    """ValueError naming the first key or value of ``options`` (a mapping) that ``KERNEL_OPTIONS`` does not allow."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{who}: must be a dict of launch parameters, got {type(options).__name__}")
    for name, value in options.items():
        if name not in KERNEL_OPTIONS:
            raise ValueError(f"{who}: unknown launch parameter {name!r}; valid: {sorted(KERNEL_OPTIONS)}")
        allowed = KERNEL_OPTIONS[name][0]
        # exact types: True is not 1 warp, 2.0 is not 2 stages
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise ValueError(f"{who}[{name!r}]: must be one of {list(allowed)} ({KERNEL_OPTIONS[name][1]}), "
                             f"got {value!r}")


#: the dtypes the sparse path (kernels, planners, reference) serves
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the largest head dim the attention kernel serves (smaller ones that are not powers of two are padded on chip)
MAX_HEAD_DIM = 256


def cdiv(a: int, b: int) -> int:
    """Ceil division of non-negative integers."""
    return -(-a // b)


def validate_passes(q, out, lse, resume: bool, *, who: str) -> None:
    """ValueError naming the first problem of a two-pass call's ``out`` / ``lse`` / ``resume`` (the kernels' host
    wrappers: ``kernels.attention.block_sparse_attention`` documents them)."""
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"{who}: out must be a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    if lse is not None and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                            or lse.shape != q.shape[:3] or lse.device != q.device):
        raise ValueError(f"{who}: lse must be a float32 tensor of shape {tuple(q.shape[:3])} (B, Hq, Nq) on "
                         f"{q.device}, got {getattr(lse, 'dtype', type(lse).__name__)} "
                         f"{tuple(getattr(lse, 'shape', ()))}")
    if resume and (out is None or lse is None):
        raise ValueError(f"{who}: resume=True continues from a first pass: it needs that pass's out and lse")


def validate_qkv(q, k, v, *, who: str, dtypes: tuple = SUPPORTED_DTYPES, empty_ok: bool = False,
                 longer_queries_ok: bool = False, passes: Optional[tuple] = None) -> None:
    """ValueError (TypeError for non-tensors) naming the first problem of an attention call's q, k, v.

    q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq a multiple of Hkv, 1 <= Nq <= Nk (queries are the last Nq
    positions), one device, one dtype among ``dtypes``. Entry points that fall back to dense attention pass
    ``empty_ok`` (zero-size dimensions: SDPA returns an empty result) and ``longer_queries_ok`` (``is_causal``
    SDPA aligns top-left, so Nq > Nk is a valid call there). ``passes``: a kernel's ``(out, lse, resume)``, checked
    by ``validate_passes`` after the inputs.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        # sparse, nested and other layouts fail deep inside with messages that name no argument
        if t.is_nested or t.layout != torch.strided:
            layout = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            how = "torch.nested.to_padded_tensor" if t.is_nested else ".to_dense()"
            raise ValueError(f"{who}: {name} must be a dense (strided) tensor, got a {layout} one; convert it with "
                             f"{how}")
        if t.dim() != 4:
            raise ValueError(f"{who}: {name} must be 4-D (batch, heads, seq_len, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{who}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{who}: q, k, v: unsupported dtype {q.dtype}; use {names}")
    if k.shape != v.shape:
        raise ValueError(f"{who}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    batch, heads_q, num_queries, dim = q.shape
    _, heads_kv, num_keys, dim_k = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"{who}: batch sizes differ: q {batch}, k {k.shape[0]}")
    if dim_k != dim:
        raise ValueError(f"{who}: head dims differ: q {dim}, k {dim_k}")
    if (dim == 0 or heads_q == 0 or heads_kv == 0) and not empty_ok:
        raise ValueError(f"{who}: empty head dimension: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if heads_kv and heads_q % heads_kv or (heads_q and not heads_kv):
        raise ValueError(f"{who}: q's heads ({heads_q}) must be a multiple of key/value heads ({heads_kv}, k's "
                         "and v's)")
    if num_queries > num_keys and not longer_queries_ok:
        raise ValueError(f"{who}: q_len {num_queries} > kv_len {num_keys}; queries are the last q_len positions")
    if num_queries == 0 and not empty_ok:
        raise ValueError(f"{who}: q_len must be at least 1")
    if passes is not None:
        validate_passes(q, *passes, who=who)


def expand_heads(x: Optional[torch.Tensor], num_heads: int) -> Optional[torch.Tensor]:
    """Broadcast a per-KV-head tensor (dim 1: 1, Hkv or ``num_heads``) to ``num_heads`` query heads: a view for 1,
    a repeat for a KV-head table (only ever used on index and block-level tables, never on K/V)."""
    if x is None or x.shape[1] == num_heads:
        return x
    if x.shape[1] == 1:
        return x.expand(x.shape[0], num_heads, *x.shape[2:])
    if num_heads % x.shape[1]:
        raise ValueError(f"head dimension {x.shape[1]} does not divide the {num_heads} query heads")
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)
