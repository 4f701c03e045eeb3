"""Whole models through ``backend="sparse_prefill"`` and Inductor, on the sparse path.

With each method's keep-everything setting the compiled model must equal eager; at the defaults it must
produce sane logits. One compile per model: methods are switched with ``sparsity`` at run time.
"""

import pytest
import torch

import sparse_compile
from sparse_compile import sparsity

from models import ModelArgs, Transformer

# small blocks so that a ~100-token prompt spans many blocks and segments (ragged at the end)
SMALL_BLOCKS = {
    "min_seq_len": 2,
    "pbs": {"block_size": 16, "segment_size": 32},
    "sparge": {"block_size_q": 16, "block_size_kv": 16},
    "bfla": {"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16, "local_tiles": 1,
             "stride": 4},
    "s2o": {"segment_size": 32, "block_size_q": 16, "block_size_kv": 16},
    "sampled": {"block_size": 16, "sample_every": 4},
    "antidiag": {"block_size": 16, "score_stride": 4, "row_stride": 2},
    "peak": {"block_size": 16, "sample_every": 4},
}
# every registered method, with the setting its registration says keeps every causal block
KEEP_ALL = {name: dict(spec.keep_all) for name, spec in sparse_compile.registry.registered_methods().items()}


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def test_every_method_keep_all_equals_eager_and_defaults_are_sane():
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                                  intermediate_size=128)).eval()
    x = torch.randint(0, 64, (2, 101))
    compiled = torch.compile(model, backend="sparse_prefill", options=dict(SMALL_BLOCKS, record_density=True))
    with torch.no_grad():
        ref = model(x)
        for method, keep in KEEP_ALL.items():
            sparse_compile.reset_runtime_stats()
            with sparsity(method=method, **keep):
                out = compiled(x)
            stats = sparse_compile.runtime_stats()["layers.1.attention"]
            assert stats.last_path == "sparse" and method in stats.last_reason, (method, stats)
            torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5, msg=f"{method} keep-all differs from eager")
            assert stats.mean_density == pytest.approx(1.0), (method, stats.mean_density)  # every causal tile
            with sparsity(method=method):  # the method's defaults
                out = compiled(x)
            assert out.shape == ref.shape and torch.isfinite(out).all(), method
            density = sparse_compile.runtime_stats()["layers.1.attention"].mean_density
            assert density is not None and 0 < density <= 1, (method, density)


def test_pbs_permutation_with_sparge_selection_keep_all_equals_eager():
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                                  intermediate_size=128)).eval()
    x = torch.randint(0, 64, (1, 77))
    options = dict(SMALL_BLOCKS, method="pbs", select="sparge", sparge={"block_size_q": 16, "block_size_kv": 16,
                                                                         "cdf_threshold": 1.0, "pv_threshold": None})
    with torch.no_grad():
        out = torch.compile(model, backend="sparse_prefill", options=options)(x)
        torch.testing.assert_close(out, model(x), rtol=2e-4, atol=2e-5)
    assert sparse_compile.runtime_stats()["layers.0.attention"].last_path == "sparse"


@pytest.mark.parametrize("temperature", [0, 16])
def test_model_with_a_convolution_before_attention_still_rewrites(temperature):
    """``ModelArgs.conv_width`` and ``attn_temperature_floor`` (the retrieval model's options): the attention call is
    unchanged, so every layer runs sparse, and with every tile kept the output equals eager."""
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, intermediate_size=128,
                                  conv_width=4, attn_temperature_floor=temperature)).eval()
    with torch.no_grad():
        for block in model.layers:
            block.mix.conv.weight.normal_(0, 0.3)  # zero at init: make the convolution act
    x = torch.randint(0, 64, (2, 83))
    compiled = torch.compile(model, backend="sparse_prefill", options=SMALL_BLOCKS)
    with torch.no_grad(), sparsity(method="pbs", **KEEP_ALL["pbs"]):
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=2e-4, atol=2e-5)
    stats = sparse_compile.runtime_stats()
    assert all(stats[f"layers.{i}.attention"].last_path == "sparse" for i in range(2)), stats


transformers = pytest.importorskip("transformers")


def _hf(kind):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
        cls = transformers.Qwen2ForCausalLM
    cfg._attn_implementation = "sdpa"
    return cls(cfg).eval()


# llama here; every architecture's keep-all forward through the rewrite is in test_architectures.py
@pytest.mark.parametrize("kind", ["llama"])
def test_transformers_sparsity_off_and_keep_all_equal_eager(kind):
    model = _hf(kind)
    ids = torch.randint(0, 128, (2, 70))
    compiled = torch.compile(model, backend="sparse_prefill", options=SMALL_BLOCKS)
    with torch.no_grad():
        ref = model(ids).logits
        with sparsity(enabled=False):
            torch.testing.assert_close(compiled(ids).logits, ref, rtol=1e-4, atol=1e-5)
        with sparsity(method="bfla", mass_threshold=1.0):
            torch.testing.assert_close(compiled(ids).logits, ref, rtol=2e-4, atol=2e-5)
    stats = sparse_compile.runtime_stats()
    assert len(stats) == 2 and all(s.last_path == "sparse" for s in stats.values())


def test_generate_prefill_sparse_decode_dense_tokens_equal_eager():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 100))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        model.forward = torch.compile(model.forward, backend="sparse_prefill",
                                      options=dict(SMALL_BLOCKS, method="pbs",
                                                   pbs={"block_size": 16, "segment_size": 32, "threshold": 1.0}))
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    stats = sparse_compile.runtime_stats()
    # the prefill ran sparse at every layer; decode steps (q_len 1) are not causal SDPA calls: left dense
    assert {s.calls[("sparse", "method pbs (reference)")] for s in stats.values()} == {1}
