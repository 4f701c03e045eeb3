"""The rewrite pass on real traced graphs: which sites are rewritten, and the named reason for every other one.

These tests trace with Dynamo and run the pass without Inductor (fast); test_backend.py compiles end to end.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparse_compile import SparseConfig
from sparse_compile.rewrite import layer_index, rewrite_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model import ModelArgs, Transformer  # noqa: E402

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def traced_records(fn, *args, config=SparseConfig(), **kwargs):
    """Trace ``fn`` with Dynamo, run the rewrite on each graph, execute the rewritten graphs, return records."""
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, config))
        return gm.forward

    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=False)(*args, **kwargs)
    return records, out


def tiny_llama(layers=3, **extra):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, **extra,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_qwen2(layers=2):
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen2ForCausalLM(cfg).eval()


def test_gpt_fast_style_model_every_layer_rewritten():
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=3, n_heads=4, n_kv_heads=1, intermediate_size=128)).eval()
    records, _ = traced_records(model, torch.randint(0, 64, (2, 33)))
    assert [r.site for r in records] == [f"layers.{i}.attention" for i in range(3)]
    assert all(r.rewritten for r in records), records
    assert records[0].q_shape == (2, 4, 33, 16) and records[0].k_shape == (2, 1, 33, 16)


def test_llama_sites_rewritten_with_module_paths():
    records, _ = traced_records(tiny_llama(3), torch.randint(0, 128, (2, 40)))
    assert [r.site for r in records] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert all(r.rewritten for r in records)


def test_qwen2_sites_rewritten():
    records, _ = traced_records(tiny_qwen2(2), torch.randint(0, 128, (1, 29)))
    assert len(records) == 2 and all(r.rewritten for r in records)
    assert records[0].q_shape[1] == 8 and records[0].k_shape[1] == 2  # GQA stays native: K/V not repeated


def test_skip_layers_by_index_and_by_path():
    model = tiny_llama(3)
    x = torch.randint(0, 128, (1, 20))
    records, _ = traced_records(model, x, config=SparseConfig(skip_layers=(0, 2)))
    assert [r.rewritten for r in records] == [False, True, False]
    assert "layer 0 is in skip_layers" in records[0].reason
    torch._dynamo.reset()
    records, _ = traced_records(model, x, config=SparseConfig(skip_layers=("layers.1.",)))
    assert [r.rewritten for r in records] == [True, False, True]
    assert "matches skip_layers" in records[1].reason


def test_padding_mask_left_dense():
    model = tiny_llama(2)
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers passes an explicit attn_mask
    records, _ = traced_records(model, ids, attention_mask=mask)
    assert records and not any(r.rewritten for r in records)
    assert all("attn_mask" in r.reason for r in records)


class Encoder(nn.Module):
    """Bidirectional self-attention (is_causal=False)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Odd(nn.Module):
    """Several patterns that must stay dense."""

    def forward(self, q, k, v, q1, k_long, q_odd, k_odd):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)  # dropout
        b = F.scaled_dot_product_attention(q1, k_long, k_long, is_causal=True)  # q_len != kv_len
        c = F.scaled_dot_product_attention(q_odd, k_odd, k_odd, is_causal=True)  # head dim 100
        d = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)  # float64
        return a, b, c, d


def test_non_causal_encoder_left_dense():
    q = torch.randn(1, 2, 16, 32)
    records, _ = traced_records(Encoder(), q, q, q)
    assert len(records) == 1 and not records[0].rewritten and "not causal" in records[0].reason


def test_other_ineligible_patterns_have_reasons():
    q, k = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    q1, k_long = torch.randn(1, 2, 1, 32), torch.randn(1, 2, 40, 32)
    q_odd = torch.randn(1, 2, 16, 100)
    records, _ = traced_records(Odd().train(), q, k, k, q1, k_long, q_odd, q_odd)
    reasons = {r.node: r.reason for r in records}
    assert not any(r.rewritten for r in records)
    text = " | ".join(reasons.values())
    assert "dropout_p=0.1" in text
    assert "q_len 1 != kv_len 40" in text
    assert "head dim 100" in text
    assert "float64" in text


def test_requires_grad_left_dense():
    q = torch.randn(1, 2, 16, 32, requires_grad=True)
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, SparseConfig()))
        return gm.forward

    torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), backend=backend)(q)
    assert not records[0].rewritten and "require grad" in records[0].reason


def test_rewritten_graph_runs_and_matches_eager():
    model = tiny_llama(2)
    x = torch.randint(0, 128, (2, 31))
    with torch.no_grad():
        ref = model(x).logits
    records, out = traced_records(model, x)
    assert all(r.rewritten for r in records)
    torch.testing.assert_close(out.logits, ref)  # short prompt: the op runs the exact dense path


def test_layer_index_parsing():
    assert layer_index("model.layers.12.self_attn") == 12
    assert layer_index("layers.0.attention") == 0
    assert layer_index("encoder.attn") is None
