"""The op returns the memory layout of the call it replaced: a program that views the attention output keeps
working under ``sparse_prefill`` exactly as under eager and Inductor, with sparsity on or off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sparse_compile


class ViewsOutput(torch.nn.Module):
    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, heads, length, dim = o.shape
        return o.view(batch, heads * length, dim) * 2  # needs contiguous (B, H, N, D) memory


class TransposesOutput(torch.nn.Module):
    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, heads, length, dim = o.shape
        return o.transpose(1, 2).view(batch, length, heads * dim)  # needs (B, N, H, D) memory


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_view_of_contiguous_output_compiles_and_matches_eager(enabled, dynamic):
    torch._dynamo.reset()
    q = torch.randn(2, 4, 40, 16)
    compiled = torch.compile(ViewsOutput(), backend="sparse_prefill", dynamic=dynamic,
                             options={"min_seq_len": 2, "enabled": enabled})
    sparse_compile.reset_runtime_stats()
    out = compiled(q, q, q)
    assert torch.allclose(out, ViewsOutput()(q, q, q), atol=1e-5)
    path = "sparse" if enabled else "dense"
    assert [p for entry in sparse_compile.runtime_stats().values() for (p, _) in entry.calls] == [path]


@pytest.mark.parametrize("dynamic", [False, True])
def test_view_of_heads_inner_output_compiles_and_matches_eager(dynamic):
    torch._dynamo.reset()
    q = torch.randn(2, 40, 4, 16).transpose(1, 2)  # projections come transposed: SDPA then returns heads-inner
    compiled = torch.compile(TransposesOutput(), backend="sparse_prefill", dynamic=dynamic,
                             options={"min_seq_len": 2})
    assert torch.allclose(compiled(q, q, q), TransposesOutput()(q, q, q), atol=1e-5)


def test_fake_and_real_layouts_agree():
    from helpers import op_spec

    q = torch.randn(1, 4, 24, 16)
    config = sparse_compile.SparseConfig(min_seq_len=2)
    for heads_inner in (True, False):
        args = (q, q, q, None, op_spec("layout", config, heads_inner=heads_inner))
        torch.library.opcheck(torch.ops.sparse_compile.causal_attention.default, args)
        out = torch.ops.sparse_compile.causal_attention(*args)
        assert (out.stride(1) < out.stride(2)) == heads_inner
