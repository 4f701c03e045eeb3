"""A prompt of a new length compiles no kernel that its power-of-two bucket has compiled already: every kernel
argument that follows the length (counts, and the strides of tables shaped by them) is compiled without Triton's
divisibility specialisation (``kernels.common.LENGTH_ARGS``), and the strides of q, k, v and o keep it (their
loads are vectorised by it). Checked on the kernels as Triton compiles them (outside the interpreter, which keeps
no specialisation), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_LIST_KERNELS = r"""
import importlib, json, pkgutil
import sparse_compile.kernels as package
from triton.runtime.jit import JITFunction
found = {}
for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"sparse_compile.kernels.{info.name}")
    for name, fn in vars(module).items():
        if isinstance(fn, JITFunction) and (name.endswith("_kernel") or name.endswith("_fwd")):
            found[f"{info.name}.{name}"] = [(p.name, p.is_constexpr, p.do_not_specialize,
                                             p.do_not_specialize_on_alignment) for p in fn.params]
print(json.dumps(found))
"""

#: argument names that follow the length (and head counts), by the kernels' naming conventions
FOLLOWS_LENGTH = (r"^(N|L|LQ|LK|LENGTH|COUNT|TOTAL|KEY_LEN|ROW[01]|ROWS|WIDTH|SEGMENTS_END|count|NUM_\w+"
                  r"|H|HQ|HKV|H_Q|GROUP|GQA|N_(Q|K|QBLK|PBLK|ITEMS)|stride_(s|l|p)[bhi]|stride_t[bhq]|stride_(c|m)[bh]|stride_(ki|qi|i)[bh])$")
#: the strides of the attention operands, whose alignment vectorises their loads
OPERAND_STRIDE = r"^stride_[qkvox][bhnmd]$"


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _LIST_KERNELS], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_arguments_that_follow_the_length_compile_for_any_length(kernels):
    import re

    assert len(kernels) >= 18  # every planning kernel and both attention kernels
    specialised = [f"{kernel}({name})" for kernel, params in kernels.items()
                   for name, constexpr, _, any_alignment in params
                   if not constexpr and re.match(FOLLOWS_LENGTH, name) and not any_alignment]
    assert specialised == []


def test_operand_strides_stay_specialised(kernels):
    import re

    unaligned = [f"{kernel}({name})" for kernel, params in kernels.items()
                 for name, constexpr, never, any_alignment in params
                 if re.match(OPERAND_STRIDE, name) and (never or any_alignment)]
    assert unaligned == []


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["sampled", "peak", "pbs", "sparge", "bfla", "s2o"])
def test_gpu_a_new_length_in_a_compiled_bucket_compiles_nothing(method):
    """A server's case: after prompts of 16K and 32K tokens, prompts of odd and other lengths up to 32K run each
    method's planning and attention kernels without compiling one."""
    import torch
    import sparse_compile
    from sparse_compile import SparseConfig
    from triton import knobs

    config = SparseConfig(method=method, min_seq_len=1024, dense_when_faster=False)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def call(n: int) -> None:
        q, k, v = (torch.randn(1, h, n, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
                   for h in (8, 2, 2))
        sparse_compile.sparse_attention(q, k, v, config=config)

    sparse_compile.reset_runtime_stats()
    for n in (16384, 32768):
        call(n)
    compiled, before = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(
        getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("key", args))[:80])
    try:
        for n in (24577, 20001, 16400, 30000, 32767):
            call(n)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert compiled == []
    calls = sparse_compile.runtime_stats()["sparse_attention"].calls
    assert sum(n for (path, _), n in calls.items() if path == "sparse") == 7, calls  # none fell back to dense
