"""Serving through transformers' kernels route: the attention implementation ``"sparse-compile/flash-sparse-prefill"``.

transformers' continuous batching takes a flash implementation named like a Hub kernel (``org/name``), loaded by the
``kernels`` package (``pip install sparse_compile[serving]``) from the local path in its ``LOCAL_KERNELS`` variable
(``repo_id=path``), so nothing is downloaded. The package ships that kernel repository (``sparse_compile/hub_kernel``)
whose module exposes this module's ``flash_attn_varlen_func`` and ``flash_attn_func`` (FlashAttention's convention):

    sparse_compile.serving_attention(model, SparseConfig(method="pbs"))   # returns KERNEL_NAME
    model.generate_batch(prompts, generation_config=...)                   # long prompts sparse, decode dense

    export LOCAL_KERNELS=$(python -c "import sparse_compile; print(sparse_compile.serving.local_kernels_entry())")
    export SPARSE_COMPILE_CONFIG='{"method": "pbs"}'                      # SparseConfig(...).to_json()
    transformers serve --continuous-batching --attn-implementation sparse-compile/flash-sparse-prefill MODEL

Every causal call without soft-capping, ALiBi, attention sinks, dropout or a window that binds runs as
``sparse_compile.varlen_attention`` runs it: each packed sequence a call of its own, decided by the package's rules
and recorded in ``runtime_stats()``, at the calling layer's site (``"varlen_attention"`` where no layer is known).
Anything else runs an exact dense reference per sequence, recorded dense with the reason: never a different result.
The configuration: the one ``serving_attention(model, config)`` gave the model (its layers call ``attention_forward``,
which hands it and the site to the kernel, in any thread), else ``SPARSE_COMPILE_CONFIG``, else the front door's
default. On CUDA pass ``ContinuousBatchingConfig(use_cuda_graph=False)``: this kernel reads sequence lengths on the
host (a capture raises an error that says so). Which transformers and ``kernels`` releases load it, the decode path
and the rest: docs/design.md ("Serving", "The kernels route in detail").
"""

from __future__ import annotations

import contextvars
import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import report
from .api import VARLEN_SITE
from .config import SparseConfig
from .context import resolve
from .pipeline import DENSE, attend_segments
from .rules import SUPPORTED_DTYPES, autocast_inputs, validate_qkv
from .state import STATE, WITH_MODEL

__all__ = ["KERNEL_NAME", "KERNEL_PATH", "CONFIG_VARIABLE", "serving_attention", "local_kernels_entry",
           "attention_forward", "flash_attn_varlen_func", "flash_attn_func"]

#: the attention implementation's name: a Hub kernel pattern (``org/name``) with "flash" in it (what continuous
#: batching accepts) and no version digit (transformers would take a "flash...2" or "flash...3" name for FA2/FA3)
KERNEL_NAME = "sparse-compile/flash-sparse-prefill"
#: the kernel repository shipped in the package (``build/<variant>/``: metadata.json and the module)
KERNEL_PATH = Path(__file__).resolve().parent / "hub_kernel"
#: a ``SparseConfig.to_json()`` text, for kernel calls made without a model's configuration (``transformers serve``)
CONFIG_VARIABLE = "SPARSE_COMPILE_CONFIG"

#: (configuration or None, site) of the kernel call in progress, set by ``attention_forward`` around transformers'
#: wrapper: the configuration of a model ``serving_attention`` switched, None for another model's layer
_CALL: contextvars.ContextVar[Optional[tuple[Optional[SparseConfig], str]]] = contextvars.ContextVar(
    "sparse_compile_serving", default=None)
#: the modules of the models ``serving_attention`` switched (their configuration is the one they hold)
_SERVED: "weakref.WeakSet[torch.nn.Module]" = STATE.add("serving.served", weakref.WeakSet(), kept=WITH_MODEL)
_WARNED: set = STATE.add("serving.warned", set())  # the reasons a warning gave


# -- the configuration of a kernel call ------------------------------------------------------------------------
@STATE.cached("serving.config_from_text", 8)
def _config_from_text(text: str) -> SparseConfig:
    try:
        return SparseConfig.from_json(text)
    except Exception as exc:
        raise ValueError(f"sparse_compile: {CONFIG_VARIABLE} is not a SparseConfig's JSON ({exc}): {text[:200]!r}") \
            from exc


def _call_config() -> tuple[SparseConfig, str]:
    """The configuration and site of this kernel call: the calling layer's model's (``attention_forward``, a model
    ``serving_attention`` switched), else ``SPARSE_COMPILE_CONFIG``'s, else the front door's default; at the calling
    layer's site where ``attention_forward`` ran, else ``varlen_attention``'s."""
    held, site = _CALL.get() or (None, VARLEN_SITE)
    if held is not None:
        return held, site
    text = os.environ.get(CONFIG_VARIABLE)
    if text:
        return _config_from_text(text), site
    from .transformers_attention import config_of

    return config_of(None), site


# -- FlashAttention's entry points -------------------------------------------------------------------------------
def _dense_reason(causal, softcap, alibi_slopes, dropout_p, s_aux) -> Optional[str]:
    """Why a whole call needs the dense reference (None: causal, no feature the sparse path lacks)."""
    if not causal:
        return "not causal (causal=False): the dense reference"
    if softcap:
        return f"attention logit soft-capping ({softcap}): the dense reference"
    if alibi_slopes is not None:
        return "ALiBi slopes: the dense reference"
    if s_aux is not None:
        return "attention sinks (s_aux): the dense reference"
    if dropout_p:
        return f"dropout {dropout_p}: the dense reference"
    return None


def _window(window_size) -> tuple[int, int]:
    if window_size is None:
        return -1, -1
    left, right = (int(w) for w in window_size)
    return left, right


def _reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: tuple[int, int],
               softcap: float, alibi: Optional[Tensor], dropout_p: float, sinks: Optional[Tensor]) -> Tensor:
    """One sequence by FlashAttention's definition: q ``(Nq, Hq, D)`` at the last positions of k, v ``(Nk, Hkv, D)``
    (causal and the window bottom-right aligned), soft-capping after the scale, ALiBi ``-slope * |i - j|``, a sink
    logit per head in the denominator, dropout on the probabilities; queries that see no key give zeros. Computed in
    float32 (float64 kept), returned in q's dtype."""
    n_q, heads, _ = q.shape
    n_k, kv_heads = k.shape[0], k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(work) for t in (q, k, v))
    if kv_heads != heads:
        kf, vf = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kf, vf))
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rel = (torch.arange(n_q, device=q.device) + (n_k - n_q))[:, None] - torch.arange(n_k, device=q.device)[None]
    if alibi is not None:
        scores = scores - alibi.to(work).reshape(heads, 1, 1) * rel.abs()
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        allowed &= rel >= 0
    if left >= 0:
        allowed &= rel <= left
    if right >= 0:
        allowed &= -rel <= right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(work).reshape(heads, 1, 1).expand(heads, n_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a query that sees no key
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def _say(reason: str) -> None:
    """A ``UserWarning`` once per process and reason: such calls run the dense reference, not the method."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"sparse_compile ({KERNEL_NAME}): {reason} runs for such calls instead of the sparse path "
                      "(an exact result; recorded dense in runtime_stats(); said once per reason)", UserWarning,
                      stacklevel=3)


def _sequences(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> list[tuple]:
    """``(q_start, q_end, k_start, k_end)`` per sequence (one host read of each offset tensor), or a ValueError.
    Tokens past the last offset are allowed (a batch padded to a fixed size), and more queries than keys."""
    offsets = []
    for name, cu, tensor in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
            raise ValueError(f"{KERNEL_NAME}: {name} must be a 1-D integer tensor of offsets")
        values = [int(x) for x in cu.tolist()]
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > tensor.shape[0]:
            raise ValueError(f"{KERNEL_NAME}: {name} must start at 0, never decrease and end within the "
                             f"{tensor.shape[0]} tokens, got {values[:8]}{'...' if len(values) > 8 else ''}")
        offsets.append(values)
    starts_q, starts_k = offsets
    if len(starts_q) != len(starts_k):
        raise ValueError(f"{KERNEL_NAME}: cu_seqlens_q and cu_seqlens_k describe {len(starts_q) - 1} and "
                         f"{len(starts_k) - 1} sequences")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[0] != v.shape[0]:
        raise ValueError(f"{KERNEL_NAME}: q, k and v must be (total_tokens, heads, head_dim) with as many keys as "
                         f"values, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    # more queries than keys is allowed, as FlashAttention allows it: the queries are the last positions of the
    # keys (bottom-right), so under causal the first ones see no key and give zeros (transformers' unpadding sends
    # one query per row at q_len 1, a row that is all padding so far included: one query over no keys)
    return list(zip(starts_q, starts_q[1:], starts_k, starts_k[1:]))


def _seeing(q0: int, q1: int, k0: int, k1: int) -> tuple:
    """A causal sequence cut to the queries that see a key: with more queries than keys the first ones see none
    (bottom-right alignment) and stay zero; the rest are a prefill over the keys."""
    return max(q0, q1 - (k1 - k0)), q1, k0, k1


def _refuse_graph_capture(q: Tensor) -> None:
    """The sequences are read on the host and each decided on its own: a captured CUDA graph would replay one
    batch's decisions on every other batch. Continuous batching captures graphs by default on CUDA for flash
    implementations: say how to turn that off."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{KERNEL_NAME} cannot run inside a CUDA graph capture (it reads the sequence lengths on "
                           "the host and decides each sequence on its own): turn accelerator graphs off, "
                           "ContinuousBatchingConfig(use_cuda_graph=False) or transformers serve "
                           "--no-cb-use-cuda-graph")


@torch.compiler.disable
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           s_aux: Optional[Tensor] = None) -> Tensor:
    """FlashAttention's ``flash_attn_varlen_func``: q ``(T_q, Hq, D)``, k and v ``(T_k, Hkv, D)``, sequence ``s`` the
    queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` at the last positions of its keys. Returns ``(T_q, Hq, Dv)``;
    rows past ``cu_seqlens_q[-1]`` (a padded batch) are zeros. ``max_seqlen_*`` and ``deterministic`` are accepted
    and not needed; ``return_attn_probs=True`` is refused (no probabilities are formed)."""
    if return_attn_probs:
        raise NotImplementedError(f"{KERNEL_NAME}: return_attn_probs=True is not supported (use eager attention)")
    _refuse_graph_capture(q)
    sequences = _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k)
    config, site = _call_config()
    left, right = _window(window_size)
    reason = _dense_reason(causal, softcap, alibi_slopes, dropout_p, s_aux)
    q, k, v = autocast_inputs(q, k, v)  # as transformers' SDPA call would run under autocast
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, head_dim)
    validate_qkv(q4, k4, v4, who=KERNEL_NAME, dtypes=SUPPORTED_DTYPES + (torch.float64,), empty_ok=True,
                 longer_queries_ok=True)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # rows in no sequence (padding) stay zero
    # the package's rules: each causal sequence is a call of its own, as varlen_attention runs it, at this site
    # (skip_layers and per-site parameters apply); a window binds where a query lies farther than it from the first key
    # (the queries that see no key, past the keys' count, stay zero: _seeing)
    ruled = tuple(_seeing(q0, q1, k0, k1) for q0, q1, k0, k1 in sequences
                  if q1 > q0 and k1 > k0 and reason is None and not (left >= 0 and k1 - k0 - 1 > left))
    if ruled:
        out = attend_segments(q4, k4, v4, softmax_scale, resolve(config).for_site(site), site, ruled)[0]
        out = out.transpose(0, 1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ruled_set = set(ruled)
    for s, (q0, q1, k0, k1) in enumerate(sequences):
        if q1 == q0 or _seeing(q0, q1, k0, k1) in ruled_set or (k1 == k0 and reason is None):
            continue  # nothing to compute (no key under causal: zeros) or computed above
        why = reason or (f"sliding window {left} shorter than the {k1 - k0} keys (the window drops keys): the "
                         "dense reference")
        _say(reason or f"sliding window {left} (a window that drops keys): the dense reference")
        alibi = None
        if alibi_slopes is not None:
            alibi = alibi_slopes[s] if alibi_slopes.dim() == 2 else alibi_slopes
        out[q0:q1] = _reference(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal, (left, right), softcap or 0.0, alibi,
                                dropout_p, s_aux)
        report.record_call(site, DENSE, why, (1, q.shape[1], q1 - q0, q.shape[-1]))
    return out.contiguous()


@torch.compiler.disable
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, s_aux: Optional[Tensor] = None) -> Tensor:
    """FlashAttention's ``flash_attn_func``: q ``(B, Nq, Hq, D)``, k and v ``(B, Nk, Hkv, D)``; each row one
    sequence of ``flash_attn_varlen_func``. Returns ``(B, Nq, Hq, Dv)``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{KERNEL_NAME}: flash_attn_func takes (batch, seqlen, heads, head_dim) tensors, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    rows = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(q.reshape(batch * n_q, *q.shape[2:]), k.reshape(batch * n_k, *k.shape[2:]),
                                 v.reshape(batch * n_k, *v.shape[2:]), rows * n_q, rows * n_k, n_q, n_k,
                                 dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, s_aux=s_aux)
    return out.reshape(batch, n_q, *out.shape[1:])


# -- the model side -----------------------------------------------------------------------------------------------
def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], *args, **kwargs):
    """The attention function ``serving_attention`` registers under ``KERNEL_NAME``: transformers' own flash
    wrapper (``transformers.integrations.flash_attention.flash_attention_forward``, which prepares the packed
    arguments and calls this kernel), run with the configuration ``module``'s model holds (one ``serving_attention``
    switched; another model's layers take ``SPARSE_COMPILE_CONFIG`` or the default) at the layer's site."""
    from transformers.integrations.flash_attention import flash_attention_forward

    from .transformers_attention import config_of, site_of

    token = _CALL.set((config_of(module) if module in _SERVED else None, site_of(module)))
    try:
        return flash_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    finally:
        _CALL.reset(token)


def local_kernels_entry() -> str:
    """The ``LOCAL_KERNELS`` entry that makes the ``kernels`` package load ``KERNEL_NAME`` from ``KERNEL_PATH``."""
    if ":" in str(KERNEL_PATH) or "=" in str(KERNEL_PATH):
        raise RuntimeError(f"sparse_compile: the kernel path {KERNEL_PATH} holds ':' or '=', which LOCAL_KERNELS "
                           "cannot express (repo_id=path entries separated by ':'); install the package elsewhere")
    return f"{KERNEL_NAME}={KERNEL_PATH}"


def _point_kernels_here() -> None:
    """Add this package's entry to ``LOCAL_KERNELS`` (read by ``kernels`` at each load), keeping the others; an
    entry the user set for ``KERNEL_NAME`` is kept."""
    current = os.environ.get("LOCAL_KERNELS", "")
    entries = [e for e in current.split(":") if e]
    if any(e.split("=", 1)[0] == KERNEL_NAME for e in entries):
        return
    os.environ["LOCAL_KERNELS"] = ":".join(entries + [local_kernels_entry()])


def _require_kernels() -> None:
    """transformers loads Hub kernels only with the ``kernels`` versions it names: say which, before it fails."""
    from importlib import metadata

    try:
        installed = metadata.version("kernels")
    except metadata.PackageNotFoundError:
        installed = None
    import transformers
    from transformers.utils import import_utils

    if installed is not None and import_utils.is_kernels_available():
        return
    low = getattr(import_utils, "KERNELS_MIN_VERSION", None)
    high = getattr(import_utils, "KERNELS_MAX_VERSION", None)
    wanted = f"kernels >= {low}, < {high}" if low and high else "the 'kernels' package"
    have = f"kernels {installed} is installed" if installed else "kernels is not installed"
    raise ImportError(f"sparse_compile.serving_attention: {KERNEL_NAME!r} is loaded through transformers' Hub "
                      f"kernels route, which needs {wanted} with transformers {transformers.__version__}; {have} "
                      f"(pip install sparse_compile[serving], then pip install 'kernels>={low}' if needed)")


def serving_attention(model, config: Optional[SparseConfig] = None) -> str:
    """Switch a transformers ``model`` to ``KERNEL_NAME`` for continuous batching and serving, holding ``config``
    (the ``SparseConfig`` its attention runs with; None: the front door's default), and return the name.

    Through public interfaces only: ``LOCAL_KERNELS`` (the ``kernels`` package's local override) names the kernel
    repository shipped here, ``model.set_attn_implementation(KERNEL_NAME)`` loads it as transformers loads any Hub
    kernel, and ``AttentionInterface.register`` puts ``attention_forward`` (transformers' flash wrapper with the
    model's configuration) under the name. ``generate_batch``, ``init_continuous_batching`` and ``generate`` then run
    the kernel. Needs the ``kernels`` package (``pip install sparse_compile[serving]``) and a model that supports
    flash attention.
    """
    _require_kernels()
    from .transformers_attention import enable_transformers_attention

    if not getattr(model, "_supports_flash_attn", False):
        raise ValueError(f"sparse_compile.serving_attention: {type(model).__name__} does not support flash "
                         f"attention in transformers, which {KERNEL_NAME!r} is loaded as")
    enable_transformers_attention(model, config)  # holds config; checks the model dispatches attention
    _point_kernels_here()
    _SERVED.update(model.modules())
    model.set_attn_implementation(KERNEL_NAME)
    current = getattr(model.config, "_attn_implementation", None)
    if current != KERNEL_NAME:
        raise ValueError(f"sparse_compile.serving_attention: {type(model).__name__} kept attn_implementation "
                         f"{current!r} instead of {KERNEL_NAME!r} (a model that lists its compatible flash "
                         "implementations replaces others)")
    from transformers import AttentionInterface

    AttentionInterface.register(KERNEL_NAME, attention_forward)
    return KERNEL_NAME
