"""Forward-mode AD and torch.func: the compiled model and sparse_attention keep the tangent (dense), the op refuses."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_compile
from sparse_compile import SparseConfig

from helpers import op_spec, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16},
             sampled={"block_size": 16, "sample_every": 4},
             antidiag={"block_size": 16, "score_stride": 4, "row_stride": 2},
             peak={"block_size": 16, "sample_every": 4})

def _compile(fn, **options):
    return torch.compile(fn, backend="sparse_prefill", options={**SMALL, **options})


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_forward_ad_through_the_compiled_model_gives_the_eager_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    tangent = torch.randn_like(q)
    compiled = _compile(_causal, kernel="triton")
    with torch.no_grad():
        compiled(q, k, v)  # the sparse path serves ordinary calls
    assert sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_path == "sparse"
    with sdpa_kernel(SDPBackend.MATH), forward_ad.dual_level():  # PyTorch's math kernel has a forward derivative
        out = compiled(forward_ad.make_dual(q, tangent), k, v)
        ref = _causal(forward_ad.make_dual(q, tangent), k, v)
        got, want = forward_ad.unpack_dual(out).tangent, forward_ad.unpack_dual(ref).tangent
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sparse_attention_under_forward_ad_jvp_and_vmap_runs_dense():
    q, k, v = random_qkv(2, 2, 2, 32, 32, 16)
    config = SparseConfig(kernel="triton", **SMALL)
    tangent = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.MATH):
        with forward_ad.dual_level():
            out = sparse_compile.sparse_attention(forward_ad.make_dual(q, tangent), k, v, config=config)
            got = forward_ad.unpack_dual(out).tangent
            want = forward_ad.unpack_dual(_causal(forward_ad.make_dual(q, tangent), k, v)).tangent
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        reason = sparse_compile.runtime_stats()["sparse_attention"].last_reason
        assert "forward-mode AD" in reason, reason
        _, jvp_out = torch.func.jvp(lambda x: sparse_compile.sparse_attention(x, k, v, config=config), (q,),
                                    (tangent,))
        _, jvp_ref = torch.func.jvp(lambda x: _causal(x, k, v), (q,), (tangent,))
        torch.testing.assert_close(jvp_out, jvp_ref, rtol=1e-4, atol=1e-5)
    batched = torch.func.vmap(lambda x: sparse_compile.sparse_attention(x, k, v, config=config))(torch.stack([q, q]))
    torch.testing.assert_close(batched[1], _causal(q, k, v), rtol=1e-4, atol=1e-5)
    assert "torch.func transform" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_op_called_directly_under_forward_ad_refuses_rather_than_dropping_the_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.ops.sparse_compile.causal_attention(forward_ad.make_dual(q, torch.randn_like(q)), k, v, None,
                                                  op_spec("s", SparseConfig(**SMALL)))
