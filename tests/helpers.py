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


#: small blocks and segments for every built-in method: their kernels and plans at test lengths (tens of tokens)
SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16},
             sampled={"block_size": 16, "sample_every": 4},
             antidiag={"block_size": 16, "score_stride": 4, "row_stride": 2},
             peak={"block_size": 16, "sample_every": 4})
SMALL_PBS = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})
BUILT_IN = ("pbs", "sparge", "bfla", "s2o", "sampled", "antidiag", "peak")


def causal_sdpa(q, k, v):
    """The attention every compiled test function runs: causal SDPA (is_causal=True)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def compile_small(fn, **options):
    """``fn`` compiled by the backend with ``SMALL`` and ``options``."""
    return torch.compile(fn, backend="sparse_prefill", options={**SMALL, **options})


def small_model(layers=2):
    """The tests' decoder (``models.py``), small: 64 tokens, 4 heads over 2 key/value heads."""
    from models import ModelArgs, Transformer

    return Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128)).eval()

