"""The transformers front door without torch.compile: ``attn_implementation="sparse_prefill"``.

Tiny random models built from configs, called as users call them (forward, a left-padded batch, ``generate()``,
chunked prefill with a cache, a static cache). With every method's keep-everything setting the logits equal
transformers' SDPA implementation and the generated tokens are identical; ``runtime_stats()`` counts one sparse
call per layer for a prefill and dense calls (with the reason) for decode steps and for what must stay dense.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile import transformers_attention as front
from sparse_compile.state import STATE

transformers = pytest.importorskip("transformers")

SUPPORTED = front.supports_version(transformers.__version__)
needs_interface = pytest.mark.skipif(
    not SUPPORTED, reason=f"transformers {transformers.__version__} has no AttentionMaskInterface (needs >= 4.53)")
if SUPPORTED:  # as users do before from_pretrained(..., attn_implementation="sparse_prefill"): registered here
    sparse_compile.enable_transformers_attention()

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16})
SIZES = dict(vocab_size=128, max_position_embeddings=1024, intermediate_size=128, num_hidden_layers=2)
HEADS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def tiny(name: str, implementation: str = "sdpa", **extra):
    T = transformers
    build = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**HEADS, **SIZES, **extra)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**HEADS, **SIZES, **extra)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**HEADS, head_dim=16, **SIZES, **extra)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**HEADS, **SIZES, **extra)),
        # query_pre_attn_scalar: a softmax scale other than 1/sqrt(head_dim) reaches the function as `scaling`
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**{**HEADS, "num_key_value_heads": 1}, head_dim=16,
                                                                   query_pre_attn_scalar=20, **SIZES, **extra)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**HEADS, pad_token_id=0, **SIZES, **extra)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**{**HEADS, "num_key_value_heads": 1}, head_dim=16,
                                                             **SIZES, **extra)),
    }[name]
    model = build().eval()
    model.set_attn_implementation(implementation)
    return model


def attention_sites(model) -> list[str]:
    return [name for name, module in model.named_modules() if name.endswith("self_attn")]


def calls(path: str) -> dict:
    """site -> number of calls that took ``path``."""
    return {site: sum(n for (p, _), n in s.calls.items() if p == path)
            for site, s in sparse_compile.runtime_stats().items()}


def reasons(path: str) -> dict:
    return {site: {r for (p, r), n in s.calls.items() if p == path}
            for site, s in sparse_compile.runtime_stats().items()}


def left_padded(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    return mask


def before_and_after_keep_all(model, run, config=None):
    """``run()`` with the model's own attention, then with the front door's at a keep-everything ``config``
    (default: ``SMALL``'s), no gradients: (ref, out), which must agree."""
    with torch.no_grad():
        ref = run()
        sparse_compile.enable_transformers_attention(model, config or SparseConfig(**SMALL).keep_all())
        out = run()
    return ref, out


def assert_padded_logits_unchanged(model, ids, mask, config=None, tol=1e-5):
    """The logits of the unpadded positions are the model's own attention's at keep-all."""
    ref, out = before_and_after_keep_all(model, lambda: model(ids, attention_mask=mask).logits, config)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=tol, atol=tol)


@pytest.fixture(autouse=True)
def _fresh_stats():
    sparse_compile.reset_runtime_stats()
    yield


MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")


@needs_interface
@pytest.mark.parametrize("name", MODELS)
def test_prefill_sparse_decode_dense_same_logits_and_tokens(name):
    model = tiny(name)
    ids = torch.randint(1, 128, (2, 70))
    mask = left_padded(ids)
    with torch.no_grad():
        ref = model(ids).logits
        ref_padded = model(ids, attention_mask=mask).logits
        # min_new_tokens: a random model may emit EOS early in both rows (then fewer decode steps than counted)
        steps = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        ref_tokens = model.generate(ids, attention_mask=mask, **steps)
        method = "s2o" if name in ("qwen2", "phi3") else "pbs"  # s2o: the permuting method with the strictest plans
        sparse_compile.enable_transformers_attention(model, SparseConfig(method=method, **SMALL).keep_all())
        assert model.config._attn_implementation == "sparse_prefill"
        sites = attention_sites(model)

        out = model(ids).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert calls("sparse") == {site: 1 for site in sites}, sparse_compile.runtime_stats()

        out = model(ids, attention_mask=mask).logits
        valid = mask.bool()
        torch.testing.assert_close(out[valid], ref_padded[valid], rtol=1e-5, atol=1e-5)
        assert calls("sparse") == {site: 2 for site in sites}
        assert all("padded batch" in sparse_compile.runtime_stats()[site].last_reason for site in sites)

        sparse_compile.reset_runtime_stats()
        tokens = model.generate(ids, attention_mask=mask, **steps)
    assert torch.equal(tokens, ref_tokens)
    assert calls("sparse") == {site: 1 for site in sites}  # the prefill
    assert calls("dense") == {site: 4 for site in sites}  # the decode steps
    assert reasons("dense") == {site: {"decode step (q_len == 1)"} for site in sites}


@needs_interface
def test_from_pretrained_attn_implementation_and_regions(tmp_path):
    tiny("llama").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_prefill").eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == "sparse_prefill"
    ids = torch.randint(1, 128, (1, 64))
    sites = attention_sites(model)
    with torch.no_grad():
        ref = reference(ids).logits
        out = model(ids).logits  # the default configuration: 64 tokens are below its min_seq_len
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert calls("sparse") == {site: 0 for site in sites}
        assert all(r == {"q_len 64 < min_seq_len 16384"} for r in reasons("dense").values()), reasons("dense")
        with sparse_compile.sparsity(method="pbs", min_seq_len=2, threshold=1.0, block_size=16,
                                     segment_size=32):
            out = model(ids).logits  # a region applies as it does to compiled models
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert calls("sparse") == {site: 1 for site in sites}
        with sparse_compile.sparsity(enabled=False):
            model(ids)
    assert all("sparsity disabled in this region" in r for r in reasons("dense").values())


@needs_interface
def test_set_attn_implementation_skip_layers_by_module_path():
    model = tiny("llama")
    model.set_attn_implementation("sparse_prefill")
    sparse_compile.enable_transformers_attention(model, SparseConfig(skip_layers=[1], **SMALL).keep_all())
    ids = torch.randint(1, 128, (1, 40))
    with torch.no_grad():
        model(ids)
    assert calls("sparse") == {"model.layers.0.self_attn": 1, "model.layers.1.self_attn": 0}
    assert reasons("dense")["model.layers.1.self_attn"] == {"layer 1 is in skip_layers"}


@needs_interface
def test_front_door_and_torch_compile_run_the_compile_options():
    """``enable_transformers_attention`` then ``torch.compile(backend="sparse_prefill", options=...)`` on one model:
    the compiled graph holds SDPA, rewritten with the compile's options (the front door's ``min_seq_len`` would keep
    these calls dense), sites named as the model names them; the transformers config the caller built the model
    from keeps its attention implementation."""
    T = transformers
    user_config = T.LlamaConfig(**HEADS, **SIZES)
    user_config._attn_implementation = "sdpa"
    model = T.LlamaForCausalLM(user_config).eval()
    ids = torch.randint(1, 128, (1, 40))
    with torch.no_grad():
        ref = model(ids).logits
    sparse_compile.enable_transformers_attention(model, SparseConfig(min_seq_len=1 << 20))
    assert model.config._attn_implementation == "sparse_prefill"
    assert user_config._attn_implementation == "sdpa"  # a second model built from it is not switched
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="sparse_prefill", options=SparseConfig(**SMALL).keep_all())
    with torch.no_grad():
        out = compiled(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls("sparse") == {site: 1 for site in attention_sites(model)}, sparse_compile.runtime_stats()
    torch._dynamo.reset()


@needs_interface
def test_site_names_found_without_enable():
    """``set_attn_implementation`` alone: sites are named by module path, found from the model being called."""
    model = tiny("qwen2")
    model.set_attn_implementation("sparse_prefill")
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 24)))
    assert set(sparse_compile.runtime_stats()) == set(attention_sites(model))


@needs_interface
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_chunked_prefill_with_cache_and_padding():
    """A second chunk of the prompt (q_len < kv_len, queries at the last positions) runs sparse."""
    model = tiny("llama")
    ids = torch.randint(1, 128, (2, 70))
    mask = left_padded(ids)

    def chunks():
        cache = transformers.DynamicCache()
        first = model(ids[:, :40], attention_mask=mask[:, :40], past_key_values=cache, use_cache=True)
        second = model(ids[:, 40:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
        return torch.cat([first.logits, second.logits], 1)

    ref, out = before_and_after_keep_all(model, chunks)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    stats = sparse_compile.runtime_stats()["model.layers.0.self_attn"]
    assert calls("sparse") == {site: 2 for site in attention_sites(model)}
    assert stats.last_shape == (2, 4, 30, 16)


@needs_interface
def test_static_cache_generate():
    model = tiny("llama")
    ids = torch.randint(1, 128, (2, 48))
    mask = left_padded(ids)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    ref, out = before_and_after_keep_all(model, lambda: model.generate(ids, **kwargs))
    assert torch.equal(out, ref)
    assert calls("sparse") == {site: 1 for site in attention_sites(model)}


@needs_interface
def test_beam_search_and_sampling_same_tokens():
    model = tiny("qwen3")
    ids = torch.randint(1, 128, (2, 40))
    mask = left_padded(ids)
    styles = (dict(num_beams=2), dict(do_sample=True, top_k=20))

    def run():
        out = []
        for style in styles:
            torch.manual_seed(0)
            out.append(model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, **style))
        return out

    ref, out = before_and_after_keep_all(model, run)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert calls("sparse") == {site: 2 for site in attention_sites(model)}


# -- what stays dense, and says why -------------------------------------------------------------------------------
@needs_interface
def test_sliding_window_shorter_than_the_prompt_runs_with_its_window():
    """Sparse with the window, eager's logits."""
    model = tiny("mistral", sliding_window=24)
    ids = torch.randint(1, 128, (1, 70))
    ref, out = before_and_after_keep_all(model, lambda: model(ids).logits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls("sparse") == {site: 1 for site in attention_sites(model)}
    assert all(any("sliding window 24" in r for r in rs) for rs in reasons("sparse").values()), reasons("sparse")


@needs_interface
def test_gemma3_global_and_sliding_layers():
    model = tiny("gemma3", sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(1, 128, (2, 64))
    mask = left_padded(ids)
    assert_padded_logits_unchanged(model, ids, mask)
    assert calls("sparse") == {"model.layers.0.self_attn": 1, "model.layers.1.self_attn": 1}
    assert all("sliding window 16" in r for r in reasons("sparse")["model.layers.0.self_attn"])


@needs_interface
def test_soft_capping_runs_the_models_eager_attention():
    model = tiny("gemma2", "eager", attn_logit_softcapping=20.0)
    ids = torch.randint(1, 128, (2, 40))
    mask = left_padded(ids)
    assert_padded_logits_unchanged(model, ids, mask)
    assert calls("sparse") == {site: 0 for site in attention_sites(model)}
    assert all(rs == {"attention logit soft-capping (20.0)"} for rs in reasons("dense").values()), reasons("dense")


@needs_interface
def test_dropout_and_a_callers_4d_mask_stay_dense():
    model = tiny("llama", attention_dropout=0.5)
    sparse_compile.enable_transformers_attention(model, SparseConfig(**SMALL).keep_all())
    ids = torch.randint(1, 128, (1, 32))
    model.train()
    model(ids)
    assert all(rs == {"dropout 0.5 (training)"} for rs in reasons("dense").values())
    model.eval()
    sparse_compile.reset_runtime_stats()
    causal = torch.ones(32, 32, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out = model(ids, attention_mask=causal).logits
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=causal).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert all(any("not built by the 'sparse_prefill' mask function" in r for r in rs)
               for rs in reasons("dense").values())


@needs_interface
def test_mask_function_builds_no_quadratic_mask():
    """Plain causal: None without padding, else the (batch, keys) padding mask; both signatures of the interface."""
    import transformers.masking_utils as masking

    padding = torch.ones(2, 50, dtype=torch.bool)
    padding[0, :3] = False
    if "q_length" in masking.sdpa_mask.__code__.co_varnames:
        plain = front.mask_forward(batch_size=2, q_length=50, kv_length=50, q_offset=0)
        chunk = front.mask_forward(batch_size=2, q_length=20, kv_length=50, q_offset=30, attention_mask=padding)
    else:
        plain = front.mask_forward(batch_size=2, cache_position=torch.arange(50), kv_length=50)
        chunk = front.mask_forward(batch_size=2, cache_position=torch.arange(30, 50), kv_length=50,
                                   attention_mask=padding)
    assert plain is None
    assert chunk.shape == (2, 50) and isinstance(front.note_of(chunk), front.CausalNote)


def _registered() -> tuple[bool, bool]:
    attention, masking = (sys.modules.get(f"transformers.{name}") for name in ("modeling_utils", "masking_utils"))
    return (front.NAME in getattr(getattr(attention, "AttentionInterface", None), "_global_mapping", {}),
            front.NAME in getattr(getattr(masking, "AttentionMaskInterface", None), "_global_mapping", {}))


def test_attention_function_called_directly_gqa_layout_and_layer_site():
    """As a model's attention layer calls it: (B, Nq, Hq, D) out, as transformers' SDPA function returns; k/v keep
    their Hkv heads; a layer outside any model is named by its ``layer_idx``."""
    layer = torch.nn.Module()
    layer.layer_idx, layer.is_causal = 3, True
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    config = SparseConfig(**SMALL).keep_all()
    STATE["transformers_attention.configs"][layer] = config
    out, weights = front.attention_forward(layer, q, k, v, None, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert weights is None and out.shape == (2, 40, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert calls("sparse") == {"layers.3": 1}


_REGISTERED = ("u, m = sys.modules.get('transformers.modeling_utils'), sys.modules.get('transformers.masking_utils'); "
               "got = (f.NAME in getattr(getattr(u, 'AttentionInterface', None), '_global_mapping', {}), "
               "f.NAME in getattr(getattr(m, 'AttentionMaskInterface', None), '_global_mapping', {})); ")


def _run(code: str) -> None:
    root = str(Path(sparse_compile.__file__).resolve().parent.parent)  # this checkout's package, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_neither_imports_transformers_nor_watches_imports():
    """``import sparse_compile`` before transformers registers nothing and installs no import hook;
    ``enable_transformers_attention()`` registers through transformers' public ``register`` functions."""
    _run("import sys; finders = list(sys.meta_path); import sparse_compile; "
         "assert 'transformers' not in sys.modules and sys.meta_path == finders; "
         "import transformers.modeling_utils; from transformers import AutoModelForCausalLM; "
         "from sparse_compile import transformers_attention as f; ok = f.supports_version(transformers.__version__); "
         + _REGISTERED + "assert got == (False, False), got; "
         "ok and sparse_compile.enable_transformers_attention(); " + _REGISTERED + "assert got == (ok, ok), got")


def test_import_registers_when_transformers_is_already_imported():
    _run("import sys, transformers; import sparse_compile; from sparse_compile import transformers_attention as f; "
         "ok = f.supports_version(transformers.__version__); " + _REGISTERED + "assert got == (ok, ok), got")


@needs_interface
def test_register_uses_transformers_public_registration(monkeypatch):
    import transformers.masking_utils as masking
    import transformers.modeling_utils as modeling

    monkeypatch.delitem(modeling.AttentionInterface._global_mapping, front.NAME)
    monkeypatch.delitem(masking.AttentionMaskInterface._global_mapping, front.NAME)
    assert _registered() == (False, False)
    seen = []
    for interface in (modeling.AttentionInterface, masking.AttentionMaskInterface):
        real = interface.register.__func__
        monkeypatch.setattr(interface, "register",
                            classmethod(lambda cls, key, value, real=real: seen.append(key) or real(cls, key, value)))
    assert front.register()
    assert _registered() == (True, True) and seen == [front.NAME, front.NAME]


def test_older_transformers_get_a_clear_error(monkeypatch):
    if SUPPORTED:  # the module object `import transformers` gives now (loading models may replace it)
        monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.3")
    with pytest.raises(RuntimeError, match=r"needs transformers >= 4\.53"):
        sparse_compile.enable_transformers_attention()
