"""Silent surprises found by probing the public API with bad and unusual inputs: each is now loud or right.

One test per finding (issue "One obvious place for each thing, and no silent surprises"); each failed before the
fix. The non-finite-input findings of the kernels and selectors are tested in test_kernel.py and
test_selection_fast.py.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.context import resolve
from sparse_compile.rewrite import rewrite_graph

from helpers import random_qkv
from models import ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})


def small_model(layers=2):
    return Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128)).eval()


# 1. a missing gradient
def test_input_requiring_grad_takes_the_differentiable_dense_path():
    q, k, v = random_qkv(1, 4, 2, 40, 40, 16)
    v.requires_grad_(True)  # only v: the old rule checked q and k
    out = sparse_compile.sparse_attention(q, k, v, config=SparseConfig(**SMALL))
    out.square().sum().backward()
    v_ref = v.detach().clone().requires_grad_(True)
    F.scaled_dot_product_attention(q, k, v_ref, is_causal=True, enable_gqa=True).square().sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad)
    assert "require grad" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


# 2. a nested region re-enabled sparsity
def test_nested_region_inherits_disabled():
    base = SparseConfig(method="pbs", **SMALL)
    with sparsity(enabled=False):
        with sparsity(threshold=0.5):
            assert resolve(base).enabled is False and resolve(base).params_of("pbs").threshold == 0.5
    model = small_model()
    compiled = torch.compile(model, backend="sparse_prefill", options=dict(SMALL, method="pbs", enabled=False))
    with torch.no_grad(), sparsity(threshold=0.5):
        compiled(torch.randint(0, 64, (1, 40)))
    stats = sparse_compile.runtime_stats()
    assert stats and all(s.last_reason == "sparsity disabled in this region" for s in stats.values()), stats


# 4. sparsity(skip_layers=...) was accepted and ignored
def test_skip_layers_in_a_region_acts_per_site_at_run_time():
    compiled = torch.compile(small_model(), backend="sparse_prefill", options=SMALL)
    with torch.no_grad(), sparsity(skip_layers=(0,)):
        compiled(torch.randint(0, 64, (1, 40)))
    stats = sparse_compile.runtime_stats()
    assert stats["layers.0.attention"].last_path == "dense"
    assert stats["layers.0.attention"].last_reason == "layer 0 is in skip_layers"
    assert stats["layers.1.attention"].last_path == "sparse"


# 5. dynamic=True refused a head dim that comes from the inputs
class InputShapedAttention(nn.Module):
    def forward(self, x):
        batch, heads, length, dim = x.shape
        return F.scaled_dot_product_attention(x, x * 0.5, x, is_causal=True)


def test_symbolic_head_dim_with_a_supported_example_is_rewritten():
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, SparseConfig(**SMALL)))
        return gm.forward

    compiled = torch.compile(InputShapedAttention(), backend=backend, dynamic=True)
    x = torch.randn(1, 2, 40, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), InputShapedAttention()(x), rtol=1e-4, atol=1e-5)
        compiled(torch.randn(1, 2, 40, 100))  # unsupported at run time: dense, with the reason
    assert records and records[0].rewritten, records[0].reason
    assert "head dim 100" in sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason


# 7. messages and validation
def test_configuration_values_of_the_wrong_kind_are_rejected():
    with pytest.raises(ValueError, match="record_density"):
        SparseConfig(record_density="yes")
    with pytest.raises(ValueError, match="keep_first_block"):
        SparseConfig(pbs={"keep_first_block": "no"})
    with pytest.raises(ValueError, match="skip_layers.*>= 0"):
        SparseConfig(skip_layers=(-1,))


def test_skip_layer_that_matches_no_site_warns():
    def backend(gm, example_inputs):
        rewrite_graph(gm, SparseConfig(skip_layers=(40,), **SMALL))
        return gm.forward

    with pytest.warns(UserWarning, match=r"skip_layers \[40\] matched no attention site"), torch.no_grad():
        torch.compile(small_model(), backend=backend)(torch.randint(0, 64, (1, 20)))


def test_options_may_be_a_sparse_config():
    config = SparseConfig(method="bfla", **SMALL)
    compiled = torch.compile(small_model(), backend="sparse_prefill", options=config)
    with torch.no_grad():
        compiled(torch.randint(0, 64, (1, 40)))
    assert all("method bfla" in s.last_reason for s in sparse_compile.runtime_stats().values())
    with pytest.raises(ValueError, match="expected a dict of SparseConfig fields or a SparseConfig"):
        SparseConfig.from_options(["method", "pbs"])


@pytest.mark.parametrize("shape", [(1, 0, 8, 16), (1, 2, 8, 0)])
def test_empty_heads_or_head_dim_give_an_empty_result_as_sdpa_does(shape):
    q = torch.randn(shape)
    assert sparse_compile.sparse_attention(q, q, q).shape == shape
    assert "empty input" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_meta_inputs_give_meta_outputs():
    q, k, v = (torch.empty(2, 4, 64, 16, device="meta") for _ in range(3))
    out = sparse_compile.sparse_attention(q, k[:, :2], v[:, :2], config=SparseConfig(**SMALL))
    assert out.device.type == "meta" and out.shape == (2, 4, 64, 16)


def test_head_dim_above_the_kernels_runs_dense():
    q, k, v = random_qkv(1, 2, 2, 40, 40, 264)
    out = sparse_compile.sparse_attention(q, k, v, config=SparseConfig(kernel="triton", **SMALL))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "head dim 264" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_out_of_order_region_exit_is_an_error():
    outer, inner = sparsity(enabled=False), sparsity(method="bfla")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert resolve(SparseConfig()) == SparseConfig()


# 8. short prompts with scale <= 0 returned NaN on CPU (PyTorch's CPU flash kernel)
@pytest.mark.parametrize("scale", [0.0, -0.25])
def test_dense_path_with_non_positive_scale_equals_the_sparse_path(scale):
    q, k, v = random_qkv(1, 2, 2, 48, 48, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = sparse_compile.sparse_attention(q, k, v, scale=scale)  # shorter than min_seq_len: dense
        sparse = sparse_compile.sparse_attention(q, k, v, scale=scale,
                                                 config=SparseConfig(**SMALL).keep_all())
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(dense, sparse, rtol=1e-4, atol=1e-5)
