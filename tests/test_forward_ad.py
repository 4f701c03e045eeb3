"""Forward-mode AD and torch.func: the compiled model and sparse_attention keep the tangent (dense), the op refuses."""

import pytest
import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_compile
from sparse_compile import SparseConfig

from helpers import SMALL, causal_sdpa, compile_small, op_spec, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def test_forward_ad_through_the_compiled_model_gives_the_eager_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    tangent = torch.randn_like(q)
    compiled = compile_small(causal_sdpa, kernel="triton")
    with torch.no_grad():
        compiled(q, k, v)  # the sparse path serves ordinary calls
    assert sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_path == "sparse"
    with sdpa_kernel(SDPBackend.MATH), forward_ad.dual_level():  # PyTorch's math kernel has a forward derivative
        out = compiled(forward_ad.make_dual(q, tangent), k, v)
        ref = causal_sdpa(forward_ad.make_dual(q, tangent), k, v)
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
            want = forward_ad.unpack_dual(causal_sdpa(forward_ad.make_dual(q, tangent), k, v)).tangent
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        reason = sparse_compile.runtime_stats()["sparse_attention"].last_reason
        assert "forward-mode AD" in reason, reason
        _, jvp_out = torch.func.jvp(lambda x: sparse_compile.sparse_attention(x, k, v, config=config), (q,),
                                    (tangent,))
        _, jvp_ref = torch.func.jvp(lambda x: causal_sdpa(x, k, v), (q,), (tangent,))
        torch.testing.assert_close(jvp_out, jvp_ref, rtol=1e-4, atol=1e-5)
    batched = torch.func.vmap(lambda x: sparse_compile.sparse_attention(x, k, v, config=config))(torch.stack([q, q]))
    torch.testing.assert_close(batched[1], causal_sdpa(q, k, v), rtol=1e-4, atol=1e-5)
    assert "torch.func transform" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_op_called_directly_under_forward_ad_refuses_rather_than_dropping_the_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.ops.sparse_compile.causal_attention(forward_ad.make_dual(q, torch.randn_like(q)), k, v, None,
                                                  op_spec("s", SparseConfig(**SMALL)))
