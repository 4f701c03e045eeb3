"""Test helpers: float64 references and error metrics."""

from __future__ import annotations

import torch

from sparse_compile.dense import dense_causal_attention


def dense_reference(q, k, v, scale=None):
    """Dense causal attention in float64 (queries at the last positions), GQA native."""
    return dense_causal_attention(q.double(), k.double(), v.double(), scale=scale)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere gives inf, so it never passes."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def random_qkv(batch, heads_q, heads_kv, n_q, n_k, dim, dtype=torch.float32, device="cpu"):
    q = torch.randn(batch, heads_q, n_q, dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads_kv, n_k, dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads_kv, n_k, dim, dtype=dtype, device=device)
    return q, k, v


def op_spec(site: str, config, **flags) -> str:
    """The op's ``spec`` argument: a ``SiteSpec`` as the rewrite writes it (JSON)."""
    from sparse_compile.site import SiteSpec

    return SiteSpec(site, config, **flags).to_json()
