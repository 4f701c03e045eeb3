"""Inputs at the edges: empty, meta, requiring grad, more queries than keys, head dims the kernels do not serve,
scales they cannot take, a head dim known only from the inputs. Each runs as SDPA would, or dense with its reason."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.rewrite import rewrite_graph

from helpers import BUILT_IN, SMALL, SMALL_PBS, causal_sdpa, compile_small, op_spec, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.mark.parametrize("method", BUILT_IN)
@pytest.mark.parametrize("shape", [(0, 2, 32, 16), (1, 0, 32, 16), (1, 2, 0, 16), (1, 2, 32, 0)])
def test_empty_input_gives_an_empty_result_for_every_method(method, shape):
    q = torch.randn(*shape)
    config = SparseConfig(method=method, **SMALL)
    out = sparse_compile.sparse_attention(q, q, q, config=config)
    assert out.shape == shape
    out = torch.ops.sparse_compile.causal_attention(q, q, q, None, op_spec("empty", config))
    assert out.shape == shape
    assert sparse_compile.runtime_stats()["empty"].last_path == "dense"


def test_empty_batch_through_the_compiled_model_with_s2o():
    q = torch.randn(0, 2, 32, 16)
    compiled = compile_small(causal_sdpa, method="s2o")
    with torch.no_grad():
        assert compiled(q, q, q).shape == q.shape


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_scale_the_kernels_cannot_take_runs_dense_as_sdpa_does(scale):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    with torch.no_grad():
        out = compile_small(fn, kernel="triton")(q, k, v)
        ref = fn(q, k, v)
        # the eager entry point decides per call
        eager = sparse_compile.sparse_attention(q, k, v, scale=scale, config=SparseConfig(kernel="triton", **SMALL))
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(eager, sparse_compile.dense.dense_causal_attention(q, k, v, scale=scale),
                               equal_nan=True)
    assert "scale" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_is_causal_with_more_queries_than_keys_under_dynamic_shapes_runs_dense_as_sdpa():
    compiled = torch.compile(causal_sdpa, backend="sparse_prefill", options=SMALL, dynamic=True)
    with torch.no_grad():
        q, k, v = random_qkv(1, 2, 2, 24, 32, 16)
        torch.testing.assert_close(compiled(q, k, v), causal_sdpa(q, k, v))
        q, k, v = random_qkv(1, 2, 2, 40, 24, 16)
        torch.testing.assert_close(compiled(q, k, v), causal_sdpa(q, k, v))
    reason = sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason
    assert "top-left" in reason, reason


def test_op_with_no_queries_returns_sdpa_result():
    q = torch.randn(1, 2, 0, 16)
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    out = torch.ops.sparse_compile.causal_attention(q, k, v, None, op_spec("none", SparseConfig(**SMALL)))
    assert out.shape == (1, 2, 0, 16)
    assert "empty input" in sparse_compile.runtime_stats()["none"].last_reason


def test_input_requiring_grad_takes_the_differentiable_dense_path():
    q, k, v = random_qkv(1, 4, 2, 40, 40, 16)
    v.requires_grad_(True)  # only v: the old rule checked q and k
    out = sparse_compile.sparse_attention(q, k, v, config=SparseConfig(**SMALL_PBS))
    out.square().sum().backward()
    v_ref = v.detach().clone().requires_grad_(True)
    F.scaled_dot_product_attention(q, k, v_ref, is_causal=True, enable_gqa=True).square().sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad)
    assert "require grad" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


class InputShapedAttention(nn.Module):
    def forward(self, x):
        batch, heads, length, dim = x.shape
        return F.scaled_dot_product_attention(x, x * 0.5, x, is_causal=True)


def test_symbolic_head_dim_with_a_supported_example_is_rewritten():
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, SparseConfig(**SMALL_PBS)))
        return gm.forward

    compiled = torch.compile(InputShapedAttention(), backend=backend, dynamic=True)
    x = torch.randn(1, 2, 40, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), InputShapedAttention()(x), rtol=1e-4, atol=1e-5)
        compiled(torch.randn(1, 2, 40, 100))  # unsupported at run time: dense, with the reason
    assert records and records[0].rewritten, records[0].reason
    assert "head dim 100" in sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason


@pytest.mark.parametrize("shape", [(1, 0, 8, 16), (1, 2, 8, 0)])
def test_empty_heads_or_head_dim_give_an_empty_result_as_sdpa_does(shape):
    q = torch.randn(shape)
    assert sparse_compile.sparse_attention(q, q, q).shape == shape
    assert "empty input" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_meta_inputs_give_meta_outputs():
    q, k, v = (torch.empty(2, 4, 64, 16, device="meta") for _ in range(3))
    out = sparse_compile.sparse_attention(q, k[:, :2], v[:, :2], config=SparseConfig(**SMALL_PBS))
    assert out.device.type == "meta" and out.shape == (2, 4, 64, 16)


def test_head_dim_above_the_kernels_runs_dense():
    q, k, v = random_qkv(1, 2, 2, 40, 40, 264)
    out = sparse_compile.sparse_attention(q, k, v, config=SparseConfig(kernel="triton", **SMALL_PBS))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert "head dim 264" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


@pytest.mark.parametrize("scale", [0.0, -0.25])
def test_dense_path_with_non_positive_scale_equals_the_sparse_path(scale):
    q, k, v = random_qkv(1, 2, 2, 48, 48, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = sparse_compile.sparse_attention(q, k, v, scale=scale)  # shorter than min_seq_len: dense
        sparse = sparse_compile.sparse_attention(q, k, v, scale=scale,
                                                 config=SparseConfig(**SMALL_PBS).keep_all())
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(dense, sparse, rtol=1e-4, atol=1e-5)
