"""Exact dense attention: the path every call takes when it does not go sparse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["DenseForm", "QUERIES_LAST", "run_dense", "dense_attention", "dense_causal_attention"]


@dataclass(frozen=True)
class DenseForm:
    """The exact attention a call runs where it does not go sparse: what the replaced call computes.

    ``mask`` given: SDPA with that mask (the call's own, no causal flag). Else ``top_left``: SDPA's
    ``is_causal=True``, queries aligned with the first keys. Else causal with the queries at the last positions
    (``dense_causal_attention``), GQA native."""

    top_left: bool = False
    enable_gqa: bool = False
    mask: Optional[torch.Tensor] = None


QUERIES_LAST = DenseForm()  # causal, the queries at the last positions: proven masks, padded groups, the eager API


def run_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
              form: DenseForm = QUERIES_LAST) -> torch.Tensor:
    """Exact attention of ``form``."""
    if form.mask is not None:
        return dense_attention(q, k, v, is_causal=False, attn_mask=form.mask, scale=scale, enable_gqa=form.enable_gqa)
    if form.top_left:
        return dense_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=form.enable_gqa)
    return dense_causal_attention(q, k, v, scale=scale)


def _sdpa(q, k, v, **kwargs) -> torch.Tensor:
    scale = kwargs.get("scale")
    if scale is not None and scale <= 0 and q.device.type == "cpu":
        # PyTorch's CPU flash kernel returns NaN for a scale <= 0; the math kernel (and the sparse path) do not
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = True,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exactly the ``scaled_dot_product_attention`` call the rewrite replaced (top-left causal alignment, or the
    call's own mask)."""
    return _sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, attn_mask=attn_mask)


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal attention with queries at the last ``Nq`` positions (bottom-right alignment), GQA native.

    Equal to ``is_causal=True`` SDPA when ``Nq == Nk``; for ``Nq < Nk`` (chunked prefill) every query also sees
    the whole cached prefix. Uses PyTorch's lower-right causal bias, so no N×N mask is built.
    """
    Nq, Nk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if Nq == Nk:
        return _sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    return _sdpa(q, k, v, attn_mask=causal_lower_right(Nq, Nk), scale=scale, enable_gqa=gqa)
