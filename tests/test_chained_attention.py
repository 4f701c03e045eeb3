"""One attention's output fed straight into the next: each site is rewritten against the graph as it is then."""

import torch
import torch.nn.functional as F

import sparse_compile


class Chained(torch.nn.Module):
    def forward(self, q, k, v):
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(h, k, v, is_causal=True)


def test_attention_output_feeding_the_next_attention_compiles_and_matches_eager():
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    config = sparse_compile.SparseConfig(min_seq_len=2).keep_all()
    compiled = torch.compile(Chained(), backend="sparse_prefill", options=config.to_dict())
    sparse_compile.reset_runtime_stats()
    assert torch.allclose(compiled(q, k, v), Chained()(q, k, v), atol=1e-5)
    calls = [path for entry in sparse_compile.runtime_stats().values() for (path, _), n in entry.calls.items()
             for _ in range(n)]
    assert calls == ["sparse", "sparse"]
