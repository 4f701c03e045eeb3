"""The method registry: a method defined outside the package, in one file, registered in one line, runs through
the compiled backend, ``sparsity`` and ``sparse_attention`` without touching any package file."""

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, registry, sparsity
from sparse_compile.state import STATE

from helpers import random_qkv
from models import ModelArgs, Transformer
from window_method import WINDOW, WindowParams

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.fixture
def window_method():
    sparse_compile.extend.register_method(WINDOW)  # the one line
    yield WINDOW
    STATE["registry.methods"].pop("window", None)


def test_sixth_method_through_the_compiled_backend(window_method):
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  intermediate_size=128)).eval()
    ids = torch.randint(0, 64, (2, 93))
    options = {"method": "window", "min_seq_len": 2, "window": {"block_size": 16, "window_blocks": 2}}
    compiled = torch.compile(model, backend="sparse_prefill", options=options)
    with torch.no_grad():
        ref = model(ids)
        windowed = compiled(ids)
        with sparsity(window_blocks=0):  # its keep-everything setting, at run time
            exact = compiled(ids)
        with sparsity(**WINDOW.keep_all):
            also_exact = compiled(ids)
    torch.testing.assert_close(exact, ref, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(also_exact, ref, rtol=2e-4, atol=2e-5)
    assert torch.isfinite(windowed).all() and not torch.allclose(windowed, ref, atol=1e-3)
    stats = sparse_compile.runtime_stats()
    assert all(s.calls[("sparse", "method window (reference)")] == 3 for s in stats.values()), stats
    assert SparseConfig(method="window").keep_all().params_of(WindowParams).window_blocks == 0


def test_sixth_method_through_sparse_attention(window_method):
    q, k, v = random_qkv(2, 4, 2, 70, 70, 16)
    config = SparseConfig(method="window", min_seq_len=2, window=WindowParams(block_size=16, window_blocks=1))
    out = sparse_compile.sparse_attention(q, k, v, config=config)
    # window 1: each query block sees block 0 and its own diagonal block
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    qb, kb = torch.arange(70)[:, None] // 16, torch.arange(70)[None, :] // 16
    mask = causal & ((kb == 0) | (kb == qb))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert sparse_compile.runtime_stats()["sparse_attention"].last_reason == "method window (reference)"


def test_registry_derives_the_rest():
    methods = registry.registered_methods()
    assert set(methods) >= {"pbs", "sparge", "bfla", "s2o"}
    for name, spec in methods.items():
        assert spec.density.name in spec.params.field_names()
        config = SparseConfig(method=name).keep_all()
        for key, value in spec.keep_all.items():
            assert getattr(config.params_of(name), key) == value
    with pytest.raises(ValueError, match="unknown method 'window'"):
        SparseConfig(method="window")
    with pytest.raises(ValueError, match="SparseConfig field name"):
        sparse_compile.extend.register_method(sparse_compile.extend.Method(
            name="enabled", params=WindowParams, select=WINDOW.select, density=WINDOW.density, keep_all={}))


def test_method_parameters_are_typed_and_read_through_params_of():
    """Any method's parameters: ``params_of`` by name or by class (typed as that class); any other
    attribute is an AttributeError."""
    from sparse_compile.extend import PBSParams, SampledParams

    config = SparseConfig(method="sampled", sampled={"budget": 0.2}, pbs=PBSParams(threshold=0.5))
    assert isinstance(config.params_of("pbs"), PBSParams) and config.params_of("pbs").threshold == 0.5
    assert config.params_of(SampledParams).budget == 0.2 and config.params_of("sampled") is config.params_of(
        SampledParams)
    with pytest.raises(AttributeError):
        config.nope  # noqa: B018
    with pytest.raises(ValueError, match="unknown method"):
        config.params_of("nope")
    assert SparseConfig(**config.to_dict()) == config


def test_reserved_names_are_the_configurations_fields():
    """No method may take a name ``SparseConfig`` has as a field (its keyword would be taken twice)."""
    import dataclasses

    for field in dataclasses.fields(SparseConfig):
        with pytest.raises(ValueError, match="SparseConfig field name"):
            sparse_compile.extend.register_method(sparse_compile.extend.Method(
                name=field.name, params=WindowParams, select=WINDOW.select, density=WINDOW.density, keep_all={}))
