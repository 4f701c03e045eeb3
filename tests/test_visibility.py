"""Nothing stays dense silently: sites kept as plain SDPA are listed, counted and warned about once per graph, a
frame that Dynamo stops compiling is warned about, explain uses a compiled model's own options, and options,
SparseConfig and sparsity() take the same names."""

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.context import resolve

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# short prompts run sparse on the CPU (reference kernel and planner)
OPTIONS = {"min_seq_len": 8, "kernel": "reference", "planner": "reference"}
NOT_CAUSAL = "not causal (is_causal=False) and no mask"


class Attention(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.proj(x).view(b, n, 2, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=self.causal)
        return y.transpose(1, 2).reshape(b, n, 32)


class EncoderDecoder(nn.Module):
    """One site the rewrite keeps as plain SDPA (not causal) and one it rewrites."""

    def __init__(self):
        super().__init__()
        self.enc = Attention(causal=False)
        self.dec = Attention(causal=True)

    def forward(self, x):
        return self.dec(self.enc(x))


def ours(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("sparse_compile:")]


def warned(fn, *args, calls: int = 1) -> tuple:
    """``fn(*args)`` called ``calls`` times without gradients, every warning recorded: (the first call's output,
    the package's warnings)."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = fn(*args)
        for _ in range(calls - 1):
            fn(*args)
    return out, ours(caught)


def test_plain_sdpa_sites_are_listed_counted_and_warned_once_per_graph():
    model, x = EncoderDecoder().eval(), torch.randn(1, 24, 32)
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS)
    out, said = warned(compiled, x)
    assert len(said) == 1, said
    assert "1 of 2 attention sites" in said[0] and f"enc: {NOT_CAUSAL}" in said[0] and "is_causal=True" in said[0]
    assert "dec" not in said[0].replace("decode", "")
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)

    assert warned(compiled, x)[1] == []  # a second call of the same graph says nothing

    stats = sparse_compile.runtime_stats()
    assert set(stats) == {"enc", "dec"}
    enc, dec = stats["enc"], stats["dec"]
    assert len(enc.plain_sdpa) == 1 and enc.plain_sdpa[0].startswith(NOT_CAUSAL)
    assert enc.last_path == "dense" and "kept as plain SDPA" in enc.last_reason
    assert sum(enc.calls.values()) == 2 and enc.last_shape == (1, 2, 24, 16)
    assert dec.plain_sdpa == () and dec.last_path == "sparse" and sum(dec.calls.values()) == 2

    report = sparse_compile.explain(compiled, x)
    rows = {row["site"]: row for row in report.rows()}
    assert rows["enc"]["rewrite"] == "left dense" and rows["enc"]["reason"].startswith(NOT_CAUSAL)
    assert rows["dec"]["rewrite"] == "sparse op" and rows["dec"]["run"] == "sparse"


def test_decode_steps_and_skipped_layers_are_listed_not_warned():
    class Prefill(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)  # left dense by skip_layers

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.prefill = Prefill()

        def forward(self, q, k, v, q2):
            return F.scaled_dot_product_attention(q, k, v), self.prefill(q2)  # one query against the cache: decode

    q, kv, q2 = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    compiled = torch.compile(Step(), backend="sparse_prefill", options={**OPTIONS, "skip_layers": ["prefill"]})
    assert warned(compiled, q, kv, kv, q2)[1] == []
    stats = sparse_compile.runtime_stats()
    assert len(stats) == 2 and all(s.plain_sdpa and s.last_path == "dense" for s in stats.values())
    reasons = sorted(s.plain_sdpa[0] for s in stats.values())
    assert "skip_layers" in reasons[1] and reasons[0].startswith("decode step (q_len == 1)")


@pytest.fixture
def low_recompile_limit():
    # every new n recompiles (no automatic dynamic shapes), and the second compile is the last one allowed
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        yield


def test_recompile_limit_that_drops_attention_to_dense_is_warned(low_recompile_limit):
    def attend(q, n):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) * n

    compiled = torch.compile(attend, backend="sparse_prefill", options=OPTIONS)
    q = torch.randn(1, 2, 16, 16)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled(q, 1)
        assert ours(caught) == []
        compiled(q, 2)  # the last compile Dynamo allows
        said = ours(caught)
        assert len(said) == 1, said
        assert "torch._dynamo.config.recompile_limit (2)" in said[0] and "'attend'" in said[0]
        assert "dense" in said[0] and "n == 1" in said[0]  # the guard that failed
        out = compiled(q, 3)  # past the limit: eager, dense, and not one more op call
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True) * 3)
    assert sum(sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].calls.values()) == 2
    assert len(ours(caught)) == 1


@pytest.mark.parametrize("how", ["torch.compile", "model.compile", "bound backend"])
def test_explain_uses_the_compiled_models_options(how):
    model, x = EncoderDecoder().eval(), torch.randn(1, 24, 32)
    options = {**OPTIONS, "method": "pbs", "threshold": 0.5}
    if how == "torch.compile":
        compiled = torch.compile(model, backend="sparse_prefill", options=options)
    elif how == "bound backend":  # the README's way to pass mode= too
        backend = functools.partial(sparse_compile.sparse_prefill, options=options)
        compiled = torch.compile(model.forward, backend=backend, mode="max-autotune-no-cudagraphs")
    else:
        compiled = model
        compiled.compile(backend="sparse_prefill", options=options)
    report = sparse_compile.explain(compiled, x)
    assert report.config.min_seq_len == 8 and report.config.params_of("pbs").threshold == 0.5
    assert report.config_from == "the compiled model's options"
    rows = {row["site"]: row for row in report.rows()}
    assert set(rows) == {"enc", "dec"} and rows["dec"]["run"] == "sparse", rows
    torch.testing.assert_close(report.output, model._call_impl(x), rtol=1e-4, atol=1e-5)


def test_one_vocabulary_for_options_sparseconfig_and_sparsity():
    expected = SparseConfig(method="pbs", pbs={"threshold": 0.5})
    assert SparseConfig(method="pbs", threshold=0.5) == expected
    assert SparseConfig.from_options({"method": "pbs", "threshold": 0.5}) == expected
    with sparsity(threshold=0.5):
        assert resolve(SparseConfig(method="pbs")) == expected
    bfla = SparseConfig.from_options({"method": "bfla", "mass_threshold": 0.9})
    assert bfla.params_of("bfla").mass_threshold == 0.9 and SparseConfig(method="bfla", mass_threshold=0.9) == bfla
    assert SparseConfig(method="pbs", threshold=0.5).replace(threshold=0.7).params_of("pbs").threshold == 0.7

    # a name that belongs to no method, or to another method than the configured one: refused, naming the valid
    # (with no method given, those of the default method, sampled)
    with pytest.raises(ValueError, match=r"unknown key.*'bogus'.*valid keys.*'min_seq_len'.*'budget'"):
        SparseConfig.from_options({"bogus": 1})
    with pytest.raises(ValueError, match=r"unknown field.*'bogus'.*valid.*'min_seq_len'.*method 'sampled'.*'budget'"):
        SparseConfig(bogus=1)
    with pytest.raises(ValueError, match=r"unknown parameter.*'bogus'.*valid.*'min_seq_len'.*'threshold'"):
        sparsity(bogus=1)
    with pytest.raises(ValueError, match=r"unknown key.*'threshold'.*'mass_threshold'"):
        SparseConfig.from_options({"method": "bfla", "threshold": 0.5})
    with pytest.raises(ValueError, match=r"unknown field.*'threshold'.*method 'bfla'.*'mass_threshold'"):
        SparseConfig(method="bfla", threshold=0.5)
    with pytest.raises(ValueError, match=r"PBSParams.threshold: must be a number in \[0.0, 1.0\], got 2.0"):
        SparseConfig.from_options({"method": "pbs", "threshold": 2.0})


def test_unknown_option_is_a_plain_value_error_at_the_first_call():
    from torch._dynamo.exc import BackendCompilerFailed

    compiled = torch.compile(lambda a: a + 1, backend="sparse_prefill", options={"bogus": 1})
    with pytest.raises(ValueError, match=r"^sparse_prefill options: unknown key\(s\) \['bogus'\]; valid keys: "
                                         r"\[.*'min_seq_len'.*'budget'") as info:
        compiled(torch.ones(3))
    assert not isinstance(info.value, BackendCompilerFailed)
    assert "TORCHDYNAMO_VERBOSE" not in str(info.value)  # no advice for reporting a PyTorch bug
    with pytest.raises(ValueError, match=r"SparseConfig.min_seq_len: must be an integer in \[2, \d+\], got 0"):
        torch.compile(lambda a: a + 1, backend="sparse_prefill", options={"min_seq_len": 0})(torch.ones(3))


# -- attention computed without SDPA (matmul, softmax, matmul): listed and warned about, never rewritten ------------
class EagerAttention(nn.Module):
    """Attention as transformers' eager implementation computes it, with optional tanh soft-capping."""

    def __init__(self, softcap=None):
        super().__init__()
        self.softcap = softcap
        self.proj = nn.Linear(32, 96)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.proj(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(2, 3)) * 16 ** -0.5
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=0.0, training=self.training)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, n, 32)


class ClassifierHeads(nn.Module):
    """SDPA attention, then softmax layers that are not attention: x @ W (a weight) -> softmax -> @ E, and a batched
    product -> softmax whose output no matmul reads."""

    def __init__(self):
        super().__init__()
        self.attn = Attention(causal=True)
        self.w = nn.Parameter(torch.randn(32, 8))
        self.e = nn.Parameter(torch.randn(8, 32))

    def forward(self, x):
        h = self.attn(x)
        mixed = torch.matmul(F.softmax(torch.matmul(h, self.w), dim=-1), self.e)
        gram = torch.softmax(torch.bmm(h, h.transpose(1, 2)), dim=-1).sum(-1, keepdim=True)
        return mixed + gram


def test_attention_computed_without_sdpa_is_listed_and_warned_once():
    model, x = EagerAttention().eval(), torch.randn(1, 24, 32)
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS)
    out, said = warned(compiled, x, calls=2)
    assert len(said) == 1, said
    assert "1 of 1 attention sites" in said[0] and "without scaled_dot_product_attention" in said[0]
    assert "attn_implementation='sdpa'" in said[0]
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)  # not rewritten

    stats = sparse_compile.runtime_stats()
    assert list(stats) == ["<softmax>"]
    entry = stats["<softmax>"]
    assert len(entry.plain_sdpa) == 1 and "eager attention" in entry.plain_sdpa[0]
    assert entry.last_path == "dense" and sum(entry.calls.values()) == 2 and entry.last_shape == (1, 2, 24, 16)

    rows = sparse_compile.explain(compiled, x).rows()
    assert len(rows) == 1 and rows[0]["rewrite"] == "left dense" and "eager attention" in rows[0]["reason"]


def test_soft_capped_attention_of_gemma2_is_warned_with_its_reason():
    import transformers as T

    config = T.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    model, ids = T.Gemma2ForCausalLM(config).eval(), torch.randint(0, 64, (1, 24))
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS)
    out, said = warned(compiled, ids, calls=2)
    with torch.no_grad():
        logits, expected = out.logits, model(ids).logits
    assert len(said) == 1, said
    assert "2 of 2 attention sites" in said[0] and "soft-capping" in said[0]
    assert "model.layers.0.self_attn" in said[0] and "model.layers.1.self_attn" in said[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    stats = sparse_compile.runtime_stats()
    assert set(stats) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all("soft-capping" in s.plain_sdpa[0] and sum(s.calls.values()) == 2 for s in stats.values())


def test_softmax_layers_that_are_not_attention_are_not_reported():
    model, x = ClassifierHeads().eval(), torch.randn(1, 24, 32)
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS)
    assert warned(compiled, x)[1] == []
    stats = sparse_compile.runtime_stats()
    assert list(stats) == ["attn"] and stats["attn"].last_path == "sparse"


def test_attention_computed_without_sdpa_is_found_in_aten_graphs():
    from torch.fx.experimental.proxy_tensor import make_fx

    from sparse_compile.eager_attention import SOFTCAP_RULE, find_eager_attention

    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        eager = make_fx(EagerAttention(softcap=30.0).eval())(x)
        heads = make_fx(ClassifierHeads().eval())(x)
    assert any(n.target is torch.ops.aten.bmm.default for n in eager.graph.nodes)  # aten-level: bmm, _softmax
    [record] = find_eager_attention(eager)
    # aten-level: batch and heads flattened for bmm
    assert record.rule == SOFTCAP_RULE and not record.rewritten and record.q_shape == (4, 12, 16)
    assert find_eager_attention(heads) == []


def test_runtime_stats_prints_a_table_with_density_or_how_to_get_it():
    q = torch.randn(1, 2, 64, 16)
    measured = SparseConfig(min_seq_len=16, record_density=True, sampled={"block_size": 16})
    sparse_compile.sparse_attention(q, q, q, config=measured)
    sparse_compile.sparse_attention(q[:, :, :8], q[:, :, :8], q[:, :, :8], config=measured)
    lines = str(sparse_compile.runtime_stats()).splitlines()
    assert lines[0].split() == ["site", "path", "calls", "density", "reason"]
    dense, sparse = lines[1].split(maxsplit=4), lines[2].split(maxsplit=3)
    assert dense[:4] == ["sparse_attention", "dense", "1", "-"] and "min_seq_len 16" in dense[4]
    assert sparse[:2] == ["sparse", "1"] and 0 < float(sparse[2]) <= 1 and "method sampled" in sparse[3]
    sparse_compile.reset_runtime_stats()
    sparse_compile.sparse_attention(q, q, q, config=measured.replace(record_density=False))
    assert "record_density=True" in repr(sparse_compile.runtime_stats()).splitlines()[-1]
    sparse_compile.reset_runtime_stats()
    assert str(sparse_compile.runtime_stats()) == "runtime_stats: no attention call recorded"
