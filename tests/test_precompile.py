"""Ahead-of-time kernel compilation: refused clearly where there is nothing to compile for."""

import pytest
import torch

import sparse_compile


def test_precompile_refuses_a_cpu_device_and_bad_lengths():
    with pytest.raises(ValueError, match="CUDA device"):
        sparse_compile.precompile(8192, device="cpu")
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        sparse_compile.precompile(0, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precompile_runs_every_length_bucket_once():
    from sparse_compile.state import STATE

    before = len(STATE["api.precompiled"])
    seconds = sparse_compile.precompile(16384, methods=("pbs", "sampled"))
    assert seconds > 0 and len(STATE["api.precompiled"]) - before == 2 * 3  # 4096, 8192, 16384
    assert sparse_compile.precompile(16384, methods=("pbs", "sampled")) < seconds
