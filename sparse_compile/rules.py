"""Every decision with its reason, in one place: which attention sites the rewrite replaces, and which calls of the
replaced op run sparse. Each rule is small and named, and says why when it fails; the first rule that fails decides.

* ``REWRITE_RULES`` (compile time): a site that fails one stays exactly as it was; its ``SiteRecord`` gives the
  reason. Subject: the traced call (``rewrite.SdpaCall``, with the configuration compiled in).
* ``RUNTIME_RULES`` (every call of the op and of ``sparse_attention``): a call that fails one runs exact dense
  attention; ``runtime_stats()`` and ``explain`` give the reason. Subject: ``CallInfo``.

The q/k/v checks that every entry point shares come from the bottom layer (``kernels/validate.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import torch
import torch.fx as fx
from torch import Tensor
from torch.autograd import forward_ad

from .kernels.validate import MAX_HEAD_DIM, SUPPORTED_DTYPES, validate_qkv
from .state import STATE

__all__ = ["Rule", "first_failure", "REWRITE_RULES", "RUNTIME_RULES", "CallInfo", "validate_qkv",
           "SUPPORTED_DTYPES", "MIN_HEAD_DIM", "MAX_HEAD_DIM", "head_dim_supported", "layer_index", "excluded",
           "path_matches", "scale_problem",
           "forward_ad_active", "forward_transform", "autocast_inputs", "prefill_length", "too_short"]

Subject = TypeVar("Subject")


@dataclass(frozen=True)
class Rule(Generic[Subject]):
    name: str
    holds: Callable[[Subject], bool]
    reason: Callable[[Subject], str]


def first_failure(rules: Sequence[Rule], subject) -> Optional[Rule]:
    return next((rule for rule in rules if not rule.holds(subject)), None)


# -- shared predicates ----------------------------------------------------------------------------------------
# head dims the sparse kernels serve: powers of two run natively, other multiples of 8 are padded on chip
MIN_HEAD_DIM = 16


def _concrete(size: Any) -> Any:
    """An int for an int, the traced example value for a symbolic size (the run-time rule re-checks it)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else size
    return size


def head_dim_supported(dim: Any) -> bool:
    dim = _concrete(dim)
    return isinstance(dim, int) and MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM and dim % 8 == 0


@STATE.cached("rules.layer_index", 4096)  # asked on every call of the op: a regex per site, once
def layer_index(path: str) -> Optional[int]:
    """The first integer component of a module path: ``model.layers.3.self_attn`` -> 3."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


def path_matches(site: str, entry: str) -> bool:
    """Whether ``entry`` names whole components of the module path ``site``: ``"layers.1"`` matches
    ``model.layers.1.self_attn`` but not ``model.layers.10.self_attn`` (leading/trailing dots are ignored)."""
    entry = entry.strip(".")
    return bool(entry) and f".{entry}." in f".{site}."


def excluded(site: str, skip_layers: Sequence) -> Optional[str]:
    """Why ``site`` is skipped by ``skip_layers`` (an int: layer index; a str: whole components of the module
    path, ``path_matches``), or None."""
    index = layer_index(site)
    for item in skip_layers:
        if isinstance(item, int) and index == item:
            return f"layer {index} is in skip_layers"
        if isinstance(item, str) and path_matches(site, item):
            return f"module path matches skip_layers entry {item!r}"
    return None


def scale_problem(scale: Any) -> Optional[str]:
    """Why the sparse kernels cannot take SDPA's ``scale`` (they need a positive finite one), or None. SDPA itself
    accepts any scale, so such a call stays dense rather than failing."""
    if scale is None or isinstance(scale, (torch.SymFloat, torch.SymInt, fx.Node)):
        return None  # the default 1/sqrt(D), or known only at run time (the run-time rule checks it)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        return f"scale {scale!r} is not a number"
    if not (value > 0 and math.isfinite(value)):
        return f"scale {value!r}: the sparse kernels need a positive finite softmax scale; left dense"
    if value < _SMALLEST_SCALE:  # a subnormal in float32, where the kernels scale the scores
        return (f"scale {value!r} is below float32's smallest normal number ({_SMALLEST_SCALE:.3g}): the sparse "
                "kernels would compute another softmax than dense attention; left dense")
    return None


_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def forward_ad_active() -> bool:
    """A forward-mode AD level is open (``forward_ad.dual_level``). Cheap: read on every call."""
    return forward_ad._current_level >= 0


def forward_transform(*tensors: Tensor) -> Optional[str]:
    """Why attention here must keep its forward derivative or batching rule (the sparse path has neither, dense
    attention has both), or None: a ``torch.func`` transform is active, or forward-mode AD is (given tensors: one
    of them carries a tangent). Cheap when no such transform is active."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "inside a torch.func transform (vmap, jvp, grad): dense attention supports it, the sparse path not"
    if forward_ad_active() and (not tensors or any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)):
        if not tensors:
            return "forward-mode AD is active: the sparse path has no forward derivative, dense attention has"
        return "inputs carry forward-mode AD tangents: the sparse path has no forward derivative, dense attention has"
    return None


def autocast_inputs(*tensors: Tensor) -> tuple:
    """``tensors`` as autocast casts SDPA's inputs where it is in force on their device (SDPA is one of its
    lower-precision ops on the CPU and CUDA): floating tensors in the autocast dtype; else unchanged."""
    if not all(isinstance(t, Tensor) for t in tensors):
        return tensors  # the caller's validation names the problem
    kind = tensors[0].device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.is_floating_point() and t.device.type == kind else t for t in tensors)


def prefill_length(num_queries: int, num_keys: int) -> int:
    """The length of the whole causal prefill that computes as much as this call: ``num_queries`` queries at the
    last positions of ``num_keys`` keys attend to ``q (2k - q) / 2`` pairs, a prefill of ``L`` to ``L^2 / 2``. A
    prompt's own length for a whole prefill; for a chunk over a long cache, the work it really does (an 8K chunk
    over 120K keys is a 43K prefill's worth)."""
    if num_queries >= num_keys:
        return num_queries
    return math.isqrt(num_queries * (2 * num_keys - num_queries))


def too_short(num_queries: int, num_keys: int, min_seq_len: int) -> str:
    if num_queries >= num_keys:
        return f"q_len {num_queries} < min_seq_len {min_seq_len}"
    return (f"q_len {num_queries} over {num_keys} keys computes as much as a {prefill_length(num_queries, num_keys)}"
            f"-token prefill < min_seq_len {min_seq_len}")


# -- compile time -----------------------------------------------------------------------------------------------
def _is_const(call, name: str) -> bool:
    return not isinstance(call.args[name], fx.Node)


def _tensors_known(call) -> bool:
    return all(isinstance(t, torch.Tensor) for t in (call.q, call.k, call.v))


def _causal_form(call) -> Optional[str]:
    """None when the call is causal by ``is_causal=True`` or by a traced mask (proven by ``mask_proven``), else
    why it is not."""
    mask, causal = call.args["attn_mask"], call.args["is_causal"]
    if not _is_const(call, "is_causal"):
        return "is_causal is not a constant"
    if mask is None:
        if causal is True:
            return None
        if isinstance(call.q.shape[-2], int) and call.q.shape[-2] == 1:
            return "decode step (q_len == 1): one query attends to every key, dense"
        return "not causal (is_causal=False) and no mask: encoder or cross-attention"
    if causal:
        return "attn_mask together with is_causal=True"
    if _concrete(call.q.shape[-2]) == 1 and isinstance(call.q.shape[-2], int):
        return "decode step (q_len == 1) with a mask"
    return None


def _lengths_may_match(call) -> bool:
    nq, nk = call.q.shape[-2], call.k.shape[-2]
    if isinstance(nq, int) and isinstance(nk, int):
        # a proven mask puts the queries at the last positions (chunked prefill); is_causal aligns top-left
        return nq == nk or (call.args["attn_mask"] is not None and nq < nk)
    return True  # symbolic lengths: the op decides per call


def _grad_input(call) -> Optional[str]:
    """Which input of the call requires grad (the mask too: the op has no derivative for it), or None."""
    for name in ("query", "key", "value", "attn_mask"):
        value = call.value(name)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return "attn_mask requires grad" if name == "attn_mask" else "inputs require grad"
    return None


def _mask_problem(call) -> Optional[str]:
    from .masks import NotProven  # the analysis runs only for sites that passed every other rule

    mask = call.mask
    if isinstance(mask, NotProven) and call.runtime_mask is None:
        return f"explicit attn_mask not proven causal: {mask.reason}"
    return None


REWRITE_RULES: tuple[Rule, ...] = (
    Rule("tensors_known", _tensors_known, lambda c: "no example tensors on the node"),
    Rule("four_d", lambda c: all(t.dim() == 4 for t in (c.q, c.k, c.v)),
         lambda c: f"inputs are not 4-D (q {tuple(c.q.shape)})"),
    Rule("causal", lambda c: _causal_form(c) is None, lambda c: _causal_form(c) or ""),
    Rule("no_dropout", lambda c: _is_const(c, "dropout_p") and float(c.args["dropout_p"]) == 0.0,
         lambda c: f"dropout_p={c.args['dropout_p']} (training)"),
    Rule("dtype", lambda c: c.dtypes[0] in SUPPORTED_DTYPES and len(set(c.dtypes)) == 1,
         lambda c: f"dtype {c.dtypes[0]} not supported (float16, bfloat16, float32)" if len(set(c.dtypes)) == 1
         else f"q, k, v dtypes differ ({', '.join(str(d).replace('torch.', '') for d in c.dtypes)})"),
    Rule("head_dim", lambda c: head_dim_supported(c.q.shape[-1]) and str(c.v.shape[-1]) == str(c.q.shape[-1]),
         lambda c: f"head dim {c.q.shape[-1]} (value {c.v.shape[-1]}) not supported; supported: multiples of 8 "
                   f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] with an equal value dim"),
    Rule("heads", lambda c: c.q.shape[1] % c.k.shape[1] == 0
         and (c.q.shape[1] == c.k.shape[1] or (_is_const(c, "enable_gqa") and c.args["enable_gqa"] is True)),
         lambda c: f"query heads {c.q.shape[1]} vs key/value heads {c.k.shape[1]} without enable_gqa"),
    Rule("self_attention", _lengths_may_match,
         lambda c: f"q_len {c.q.shape[-2]} != kv_len {c.k.shape[-2]} (cross-attention or cached prefill)"),
    Rule("inference", lambda c: _grad_input(c) is None,
         lambda c: f"{_grad_input(c)}: the sparse path is forward-only (inference)"),
    Rule("scale", lambda c: scale_problem(c.args["scale"]) is None, lambda c: scale_problem(c.args["scale"]) or ""),
    Rule("layer_selected", lambda c: excluded(c.site, c.config.skip_layers) is None,
         lambda c: excluded(c.site, c.config.skip_layers) or ""),
    # last: the only rule that evaluates anything (the mask's slice at small sizes). A mask the graph cannot prove
    # passes when it is a graph input (a view or dtype conversion of one), 4-D, bool or floating: the op checks
    # its values at run time (mask checked at run time: causal AND key padding sparse, anything else dense SDPA
    # with the mask, reason recorded)
    Rule("mask_proven", lambda c: _mask_problem(c) is None, lambda c: _mask_problem(c) or ""),
)


# -- run time ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallInfo:
    q: Tensor
    k: Tensor
    v: Tensor
    config: Any  # the SparseConfig in force
    site: str
    chunked_allowed: bool  # queries at the last positions (eager API, traced masks): q_len < kv_len is fine
    scale: Optional[float] = None  # SDPA's scale (None: 1/sqrt(D))


RUNTIME_RULES: tuple[Rule, ...] = (
    Rule("enabled", lambda c: c.config.enabled, lambda c: "sparsity disabled in this region"),
    Rule("layer_selected", lambda c: excluded(c.site, c.config.skip_layers) is None,
         lambda c: excluded(c.site, c.config.skip_layers) or ""),
    Rule("real_tensors", lambda c: c.q.device.type != "meta", lambda c: "meta tensors: shapes only"),
    Rule("not_empty", lambda c: c.q.numel() > 0 and c.k.numel() > 0,
         lambda c: f"empty input (q {tuple(c.q.shape)}, k {tuple(c.k.shape)}): nothing to select"),
    Rule("no_forward_transform", lambda c: forward_transform(c.q, c.k, c.v) is None,
         lambda c: forward_transform(c.q, c.k, c.v) or ""),
    Rule("scale", lambda c: scale_problem(c.scale) is None, lambda c: scale_problem(c.scale) or ""),
    Rule("not_decode", lambda c: c.q.shape[-2] > 1, lambda c: "decode step (q_len == 1)"),
    Rule("self_attention_lengths",
         lambda c: c.q.shape[-2] == c.k.shape[-2] or (c.chunked_allowed and c.q.shape[-2] < c.k.shape[-2]),
         lambda c: f"q_len {c.q.shape[-2]} != kv_len {c.k.shape[-2]}: SDPA's is_causal aligns top-left there; "
                   "left dense"),
    Rule("long_enough", lambda c: prefill_length(c.q.shape[-2], c.k.shape[-2]) >= c.config.min_seq_len,
         lambda c: too_short(c.q.shape[-2], c.k.shape[-2], c.config.min_seq_len)),
    Rule("dtype", lambda c: c.q.dtype in SUPPORTED_DTYPES and c.k.dtype == c.q.dtype,
         lambda c: f"dtype {c.q.dtype} not supported by the sparse path (float16, bfloat16, float32)"),
    Rule("head_dim", lambda c: head_dim_supported(c.q.shape[-1]) and c.v.shape[-1] == c.q.shape[-1],
         lambda c: f"head dim {c.q.shape[-1]} (value {c.v.shape[-1]}) not served by the sparse kernels "
                   f"(multiples of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}])"),
    Rule("inference",
         lambda c: not (torch.is_grad_enabled() and (c.q.requires_grad or c.k.requires_grad or c.v.requires_grad)),
         lambda c: "inputs require grad: the sparse path is forward-only, dense attention is differentiable"),
)
