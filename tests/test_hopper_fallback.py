"""The Hopper kernel's errors: out of memory propagates, a compile failure falls back to the Triton kernel."""

import pytest
import torch

from sparse_compile.state import STATE

from helpers import causal_sdpa, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def _hopper_call(monkeypatch, error):
    from sparse_compile.kernels import attention, hopper

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(attention, "_hopper_unsupported", lambda *a, **k: None)  # as on an H100
    monkeypatch.setattr(hopper, "hopper_block_sparse_attention", failing)
    STATE.reset("kernels.hopper_failed")
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    # the causal plan of 2 query blocks of 16: block 0 its diagonal tile, block 1 its diagonal tile then tile 0
    offsets = torch.tensor([[0, 0], [16, 0]], dtype=torch.int32).view(1, 1, 2, 2).expand(1, 2, 2, 2).contiguous()
    counts = torch.tensor([1, 2], dtype=torch.int32).view(1, 1, 2).expand(1, 2, 2).contiguous()
    masked = torch.ones(1, 2, 2, dtype=torch.int32)
    out = attention.block_sparse_attention(q, k, v, offsets, counts, masked, block_m=16, block_n=16)
    return out, (q, k, v), attention


def test_hopper_out_of_memory_propagates_and_does_not_switch_kernels(monkeypatch):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _hopper_call(monkeypatch, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert STATE["kernels.hopper_failed"] == {}
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _hopper_call(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_hopper_compile_failure_falls_back_to_the_triton_kernel(monkeypatch):
    from triton.compiler.errors import CompilationError

    out, (q, k, v), attention = _hopper_call(monkeypatch, NotImplementedError("no wgmma here"))
    assert attention.last_backend == "triton" and len(STATE["kernels.hopper_failed"]) == 1
    torch.testing.assert_close(out, causal_sdpa(q, k, v), rtol=1e-4, atol=1e-5)
    assert attention.is_compile_failure(CompilationError.__new__(CompilationError))
    assert not attention.is_compile_failure(torch.cuda.OutOfMemoryError("out of memory"))
