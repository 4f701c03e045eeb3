"""Exact dense attention: the path every call takes when it does not go sparse."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["dense_attention", "dense_causal_attention"]


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
