"""The rewrite pass on real traced graphs: which sites are rewritten, and the named reason for every other one.

These tests trace with Dynamo and run the pass without Inductor (fast); test_backend.py compiles end to end.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparse_compile import SparseConfig
from sparse_compile.rewrite import rewrite_graph
from sparse_compile.rules import layer_index

from models import ModelArgs, Transformer

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


def test_padding_mask_rewritten_with_padding_input():
    model = tiny_llama(2)
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers builds causal & padding inside the graph
    records, out = traced_records(model, ids, attention_mask=mask)
    assert records and all(r.rewritten for r in records), [r.reason for r in records]
    assert all("key padding proven" in r.reason for r in records)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out.logits[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-5)


class MaskedAttention(nn.Module):
    """Attention whose mask is built in the traced code from sizes (and, for some kinds, an input)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, ids=None, custom=None):
        n = q.shape[-2]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        if self.kind == "causal_bool":
            mask = j <= i
        elif self.kind == "causal_float":
            mask = torch.zeros(n, n).masked_fill(j > i, float("-inf"))
        elif self.kind == "prefix_lm":  # bidirectional over the first 8 tokens
            mask = (j <= i) | (j < 8)
        elif self.kind == "window":  # sliding window of 12
            mask = (j <= i) & (j > i - 12)
        elif self.kind == "documents":  # packed: two documents, boundary at 13 (at 33 tokens not chunks of 13)
            mask = (j <= i) & ((i < 13) == (j < 13))
        elif self.kind == "pad_id_0":  # padding read from the token ids themselves (pad id 0)
            mask = (j <= i)[None, None] & (ids != 0)[:, None, None, :]
        elif self.kind == "pad_id_5":
            mask = (j <= i)[None, None] & (ids != 5)[:, None, None, :]
        elif self.kind == "bias":  # ALiBi-like: a float bias, not a mask
            mask = torch.where(j <= i, -0.1 * (i - j).float(), torch.tensor(float("-inf")))
        elif self.kind == "input":  # a mask the caller passes in
            mask = custom
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["causal_bool", "causal_float", "pad_id_0"])
def test_masks_proven_causal_are_rewritten(kind):
    q = torch.randn(2, 2, 33, 16)
    ids = torch.randint(1, 50, (2, 33))
    ids[0, :4] = 0
    records, out = traced_records(MaskedAttention(kind), q, q, q, ids)
    assert len(records) == 1 and records[0].rewritten, records[0].reason
    ref = MaskedAttention(kind)(q, q, q, ids)
    valid = (ids != 0) if kind == "pad_id_0" else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid])


@pytest.mark.parametrize("kind, why", [
    ("prefix_lm", "keeps key"), ("documents", "masks key"), ("pad_id_5", "keeps key"),
    ("bias", "a bias, not a mask"),
])
def test_masks_that_are_not_causal_stay_dense_with_a_reason(kind, why):
    q = torch.randn(2, 2, 33, 16)
    ids = torch.randint(1, 50, (2, 33))
    custom = torch.rand(2, 1, 33, 33) > 0.3
    records, out = traced_records(MaskedAttention(kind), q, q, q, ids, custom)
    assert len(records) == 1 and not records[0].rewritten
    assert "not proven causal" in records[0].reason and why in records[0].reason, records[0].reason
    torch.testing.assert_close(out, MaskedAttention(kind)(q, q, q, ids, custom), equal_nan=True)


def test_window_mask_is_proven_with_its_width():
    """A sliding window is causal AND local: proven with its width, run by the op with it."""
    q = torch.randn(2, 2, 33, 16)
    records, out = traced_records(MaskedAttention("window"), q, q, q)
    assert len(records) == 1 and records[0].rewritten, records[0].reason
    assert "causal mask AND sliding window 12 proven from the graph" in records[0].reason, records[0].reason
    torch.testing.assert_close(out, MaskedAttention("window")(q, q, q), rtol=1e-4, atol=1e-5)


def test_mask_passed_in_is_checked_at_run_time():
    """A mask the caller passes in cannot be proven from the graph: the op checks its values. A random one runs
    dense SDPA with it (exactly the original call), a causal one sparse."""
    import sparse_compile

    q = torch.randn(2, 2, 33, 16)
    sparse_compile.reset_runtime_stats()
    for custom, path in ((torch.rand(2, 1, 33, 33) > 0.3, "dense"), (torch.ones(33, 33).tril().bool()[None, None],
                                                                      "sparse")):
        records, out = traced_records(MaskedAttention("input"), q, q, q, None, custom,
                                      config=SparseConfig(min_seq_len=2))
        assert len(records) == 1 and records[0].rewritten and "checked at run time" in records[0].reason
        torch.testing.assert_close(out, MaskedAttention("input")(q, q, q, None, custom), equal_nan=True)
        (stats,) = sparse_compile.runtime_stats().values()
        assert stats.last_path == path and "attn_mask checked at run time" in stats.last_reason, stats.last_reason


def test_rewritten_site_allocates_no_n_by_n_mask():
    """Peak single allocation of a whole-model forward with padding: the rewrite drops the mask subgraph."""
    from torch.profiler import ProfilerActivity, profile

    import sparse_compile

    model = tiny_llama(1)
    n = 4096  # a bool mask is 16 MiB; activations of this tiny model are about 1 KiB per token
    ids = torch.randint(1, 128, (1, n))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def largest_allocation(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return max(e.cpu_memory_usage for e in prof.events())

    with torch.no_grad(), sparse_compile.sparsity(enabled=False):
        eager = largest_allocation(lambda: model(ids, attention_mask=mask))
        records, _ = traced_records(model, ids, attention_mask=mask)  # compile once
        compiled = torch.compile(model, backend=lambda gm, ex: (rewrite_graph(gm, SparseConfig()), gm.forward)[1])
        compiled(ids, attention_mask=mask)
        rewritten = largest_allocation(lambda: compiled(ids, attention_mask=mask))
    assert all(r.rewritten for r in records)
    assert eager >= n * n  # the control: eager builds the (1, 1, n, n) mask
    assert rewritten < n * n // 4, rewritten


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


@pytest.mark.parametrize("root", ["L['self']", "L['args'][0]", "L['mod']"])
def test_module_path_strips_the_traced_root_however_it_was_passed(root):
    """Dynamo names the traced module L['self'], or L['args'][0] when forward was reached through a wrapper taking
    the module as its first argument (transformers 5.24): either way the site is the ``named_modules()`` path."""
    from torch import fx

    from sparse_compile.rewrite import module_path

    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {
        "1": (f"{root}.model", object),
        "2": (f"{root}.model.layers[3]._modules['self_attn']", object),
    }
    assert module_path(node) == "model.layers.3.self_attn"
