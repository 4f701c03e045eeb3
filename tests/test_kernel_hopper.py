"""The Hopper (sm_90) attention kernel: it compiles for sm_90 with wgmma and TMA (on any machine), the backend
argument and its dispatch, and on an H100/H200 (``-m gpu``) agreement with the reference and the Triton kernel.
"""

import importlib
import math

import pytest
import torch

from sparse_compile.kernels import KernelConfig, block_sparse_attention
from sparse_compile.plan import (
    block_visibility,
    causal_plan,
    check_plan,
    execute_plan,
    plan_from_block_mask,
    reference_attention,
)

from helpers import (
    DEV,
    _assert_close,
    _gpu_sparse_plan,
    _non_boundary_mismatches,
    _ref,
    _segment_permutation,
    _sink_qkv,
    dense_reference,
    gpu,
    random_qkv,
    rel_error,
)


# ------------------------------------------------------------------------------------ compiles for Hopper

_COMPILE_FOR_SM90 = r"""
import importlib, os, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
sys.path.insert(0, sys.argv[1])  # benchmarks/: compile_hopper's signature of the attention kernels
from compile_hopper import kernel_signature
m = importlib.import_module("sparse_compile.kernels.attention")
fn = m._block_sparse_attn_fwd
for tma, gather, stop in ((1, 0, 0), (0, 1, 0), (1, 0, 1)):
    const = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=128, BLOCK_N=128, Q_SPLIT=1, TILE_SPLIT=1,
                 HAS_KIDX=bool(gather), HAS_QIDX=False, KEY_GATHER=bool(gather), USE_TMA=bool(tma),
                 EARLY_STOP=bool(stop), PV_SKIP=bool(stop), WRITE_VISITED=True, DOT_PREC="tf32", INT64_ROWS=False,
                 STAGES=3, MASKED_STAGES=2, SKIP_MASKED=bool(stop), RESUME=bool(stop), WRITE_LSE=bool(tma and not stop))
    desc = "tensordesc<bf16[128, 128]>" if tma else None
    sig = kernel_signature(fn, const, {"desc_k": desc, "desc_v": desc})
    k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8, num_stages=3))
    ptx = k.asm["ptx"]
    print(f"variant tma={tma} gather={gather} stop={stop}: wgmma={'wgmma.mma_async' in ptx} "
          f"tma={'cp.async.bulk.tensor' in ptx} shared={k.metadata.shared}")
"""


def test_compiles_for_hopper_with_wgmma_and_tma():
    """The interpreter misses compile errors (it once accepted a non-constexpr global): compile for sm_90 here."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, bench], capture_output=True, text=True, env=env,
                       timeout=600)
    if "NO_BACKEND" in r.stdout:
        pytest.skip("this Triton has no CUDA compiler backend")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("variant")]
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert "wgmma=True" in line, line  # Hopper tensor-core instructions
        shared = int(line.rsplit("shared=", 1)[1])
        assert shared <= 232448, line  # fits an H100's 227 KiB of shared memory per block
    assert "tma=True" in lines[0] and "tma=True" in lines[2], lines  # K/V tiles through TMA


# ------------------------------------------------------------------------ backend dispatch (Hopper kernel)


def _attention_module():
    return importlib.import_module("sparse_compile.kernels.attention")


def test_backend_argument_on_the_interpreter_path():
    """Off an H100 (the CPU interpreter here) "auto" runs the Triton kernel, "hopper" refuses clearly."""
    A = _attention_module()
    B, H, N, D = 1, 2, 40, 16
    q, k, v = random_qkv(B, H, H, N, N, D, device=DEV)
    plan = causal_plan(B, H, N, N, 16, 16, device=DEV)
    args = (q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts)
    out = block_sparse_attention(*args, block_m=16, block_n=16, backend="triton")
    if DEV == "cpu":
        assert torch.equal(block_sparse_attention(*args, block_m=16, block_n=16), out)
        assert A.last_backend == "triton"
        with pytest.raises(ValueError, match="backend='hopper'"):
            block_sparse_attention(*args, block_m=16, block_n=16, backend="hopper")
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(*args, block_m=16, block_n=16, backend="cuda")


def test_hopper_ring_depth_is_bounded_by_shared_memory():
    """The K/V ring may go deeper than 3 only where Q plus the ring fits an H100's 227 KiB (D=64, or block_n=64;
    6 deep at D=128 / block_n=64, SpargeAttn's tiles), and the default depth fits everywhere."""
    H = importlib.import_module("sparse_compile.kernels.hopper")
    fits = {(d, bn, st): H.shared_memory_bytes(d, bn, st) <= H.SHARED_MEMORY_LIMIT
            for d in (64, 128) for bn in (64, 128) for st in range(2, H.MAX_STAGES + 1)}
    assert fits[(128, 128, 3)] and not fits[(128, 128, 4)]
    assert fits[(64, 128, 4)] and fits[(128, 64, 6)] and fits[(64, 64, 6)]
    for d in (64, 128):
        for bn in (64, 128):
            assert fits[(d, bn, H.DEFAULT_NUM_STAGES)], (d, bn)


def _has_h100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


hopper_gpu = pytest.mark.skipif(not _has_h100(), reason="needs an sm_90 GPU (H100/H200)")


def _model_layout_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.bfloat16):
    """(B, N, H, D) storage viewed as (B, H, N, D), as the model passes it."""
    q = torch.randn(B, Nq, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Nk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(B, Nk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
    return q, k, v


def _padded_key_index(B, Hkv, N, front=100, back=250):
    """A PBS-like key list longer than the keys: -1 padding before and after a segment-permuted middle."""
    ki = torch.full((B, Hkv, front + N + back), -1, dtype=torch.int32, device="cuda")
    ki[..., front:front + N] = _segment_permutation(B, Hkv, N)
    return ki


# name: (B, Hq, Hkv, Nq, Nk, D, block_n, plan kind, plan heads, options)
_HOPPER_CASES = {
    "causal-odd-b2-gqa4-d128": (2, 8, 2, 3000 + 77, 3000 + 77, 128, 128, "causal", "q", {}),
    "sparse-d64-bn64-kvtable-chunked": (1, 8, 2, 1500, 2500, 64, 64, "sparse", "kv", {}),
    "sparse-d128-bn64": (1, 4, 4, 2048, 2048, 128, 64, "sparse", "q", {}),
    "sparse-d64-bn128-kvtable": (1, 8, 1, 2048 + 5, 2048 + 5, 64, 128, "sparse", "kv", {}),
    "pv-skip-d128": (1, 8, 2, 4096, 4096, 128, 128, "sparse", "q", {"pv_skip": -1.0}),
    "key-index-d128": (1, 8, 2, 4096 + 50, 4096 + 50, 128, 128, "sparse", "q", {"key_index": "segments"}),
    "key-index-padded-pv-skip-kvtable": (1, 8, 2, 2000, 2000, 128, 128, "all", "kv",
                                         {"key_index": "padded", "pv_skip": -1.0}),
    # a key list twice the keys, as S2O's ranked prefixes
    "key-index-long-list": (2, 8, 2, 3000 + 3, 3000 + 3, 128, 128, "sparse", "q", {"key_index": "twice"}),
    # keys read in place through the index (no permuted copy): S2O's path
    "key-index-gathered-long-list": (2, 8, 2, 3000 + 3, 3000 + 3, 128, 128, "sparse", "q",
                                     {"key_index": "twice", "key_mode": "gather"}),
    "key-index-gathered-padded-d64-bn64-kvtable": (1, 8, 2, 2000, 2000, 64, 64, "all", "kv",
                                                   {"key_index": "padded", "key_mode": "gather"}),
}


@gpu
@hopper_gpu
@pytest.mark.parametrize("case", list(_HOPPER_CASES))
def test_gpu_hopper_auto_dispatch_matches_reference_and_triton(case):
    """execute_plan as users call it picks the Gluon Hopper kernel on an H100 and agrees with the float32
    reference and with the Triton kernel (bf16 tolerance); visited counts are the tile counts."""
    A = _attention_module()
    B, Hq, Hkv, Nq, Nk, D, bn, kind, plan_heads, options = _HOPPER_CASES[case]
    options = dict(options)
    q, k, v = _model_layout_qkv(B, Hq, Hkv, Nq, Nk, D)
    ki = None
    if options.get("key_index") == "segments":
        ki = _segment_permutation(B, Hkv, Nk)
    elif options.get("key_index") == "padded":
        ki = _padded_key_index(B, Hkv, Nk)
    elif options.get("key_index") == "twice":
        ki = torch.cat([_segment_permutation(B, Hkv, Nk), _segment_permutation(B, Hkv, Nk)], -1).contiguous()
    options.pop("key_index", None)
    key_mode = options.pop("key_mode", "auto")
    heads = Hq if plan_heads == "q" else Hkv
    if kind == "causal":
        plan = causal_plan(B, heads, Nq, Nk, 128, bn, device="cuda")
    elif kind == "all":
        vis = block_visibility(Nq, Nk, 128, bn, key_index=ki, batch=B, heads=heads, device="cuda")
        plan = plan_from_block_mask(torch.ones_like(vis, dtype=torch.bool), vis, 128, bn, key_index=ki)
    else:
        plan = _gpu_sparse_plan(B, heads, Nq, Nk, 128, bn, 0.3, key_index=ki)
    plan = plan.with_options(**options)
    check_plan(plan, q, k)

    before = A.BACKEND_CALLS["hopper"]
    out, visited = execute_plan(q, k, v, plan, return_visited=True, key_mode=key_mode)
    assert A.last_backend == "hopper" and A.BACKEND_CALLS["hopper"] == before + 1, A._HOPPER_FAILED
    ref, ref_visited = reference_attention(q.float(), k.float(), v.float(), plan, return_visited=True)
    _assert_close(out, ref, torch.bfloat16, "hopper vs reference")
    assert torch.equal(visited, ref_visited)
    tri, tri_visited = block_sparse_attention(
        q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts, block_m=plan.block_m,
        block_n=plan.block_n, key_index=plan.key_index, pv_skip=plan.pv_skip, return_visited=True,
        backend="triton")
    assert A.last_backend == "triton"
    _assert_close(out, tri, torch.bfloat16, "hopper vs triton")
    assert torch.equal(visited, tri_visited)
    if "pv_skip" in options:  # the skip triggered (lambda = -1 on random inputs drops many row shares)
        plain = reference_attention(q.float(), k.float(), v.float(), plan.with_options(pv_skip=None))
        assert rel_error(plain, ref) > 1e-2


# name: (B, Hq, Hkv, N, D, block_n, keys through a permuted list ("gather": read in place), pv_skip)
_HOPPER_EARLY_STOP_CASES = {
    "d128-b2-odd-queries-and-keys": (2, 8, 2, 4096 + 77, 128, 128, True, None),
    "d64-bn64-pv-skip": (1, 8, 2, 3000, 64, 64, False, -6.0),
    "d64-4-stages-queries-and-keys": (1, 8, 2, 3000, 64, 128, True, None),
    "d128-queries-and-keys": (1, 8, 2, 4096, 128, 128, True, None),
    "d128-b2-odd-gathered-keys": (2, 8, 2, 4096 + 77, 128, 128, "gather", None),
    "d64-bn64-gathered-keys-pv-skip": (1, 8, 2, 3000, 64, 64, "gather", -6.0),
}


@gpu
@hopper_gpu
@pytest.mark.parametrize("case", list(_HOPPER_EARLY_STOP_CASES))
def test_gpu_hopper_early_stop_and_permuted_queries(case):
    """S2O's plan features on the Hopper kernel: queries permuted inside segments, keys through a permuted list,
    early stop voted between the two compute warpgroups. Agrees with the float64 reference (stop decisions up to
    bf16 flips at tau) and with the Triton kernel; the walks do stop early; auto dispatch picks it."""
    A = _attention_module()
    H = importlib.import_module("sparse_compile.kernels.hopper")
    B, Hq, Hkv, N, D, bn, with_keys, pv_skip = _HOPPER_EARLY_STOP_CASES[case]
    stages = 4 if "4-stages" in case else None
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, strength=1.0, device="cuda")
    qi = _segment_permutation(B, Hq, N)
    ki = _segment_permutation(B, Hkv, N) if with_keys else None
    plan = _gpu_sparse_plan(B, Hq, N, N, 128, bn, 0.5, query_index=qi, key_index=ki, early_stop=0.02,
                            pv_skip=pv_skip)
    check_plan(plan, q, k)
    out, visited = H.hopper_block_sparse_attention(
        q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts, block_n=bn, key_index=ki,
        query_index=qi, early_stop=plan.early_stop, pv_skip=pv_skip, return_visited=True, num_stages=stages,
        key_gather=with_keys == "gather")
    ref, ref_visited = _ref(q, k, v, plan)
    _assert_close(out, ref, torch.bfloat16, "hopper vs reference")
    bad = _non_boundary_mismatches(q, k, plan, visited, ref_visited)
    assert not bad, f"visited differ beyond rounding at tau ((b, h, block), kernel, ref, ratio): {bad[:5]}"
    assert (visited == ref_visited).float().mean().item() > 0.99
    assert int(visited.sum()) < int(plan.tile_counts.sum())  # the walks stopped early
    tri, tri_visited = block_sparse_attention(
        q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts, block_m=128, block_n=bn, key_index=ki,
        query_index=qi, early_stop=plan.early_stop, pv_skip=pv_skip, return_visited=True, backend="triton")
    _assert_close(out, tri, torch.bfloat16, "hopper vs triton")
    assert (visited == tri_visited).float().mean().item() > 0.99
    if stages is None:  # the default ring depth: what execute_plan runs
        before = A.BACKEND_CALLS["hopper"]
        auto, auto_visited = execute_plan(q, k, v, plan, return_visited=True,
                                          key_mode="gather" if with_keys == "gather" else "auto")
        assert A.last_backend == "hopper" and A.BACKEND_CALLS["hopper"] == before + 1, A._HOPPER_FAILED
        assert torch.equal(auto, out) and torch.equal(auto_visited, visited)


@gpu
@hopper_gpu
def test_gpu_hopper_backend_choices_and_fallbacks(monkeypatch):
    """Gathered keys without a key index and config= are not the Hopper kernel's: backend="hopper" names why,
    "auto" runs the Triton kernel; the environment variable turns it off. Gathered keys (key_mode="gather") are
    served."""
    A = _attention_module()
    H = importlib.import_module("sparse_compile.kernels.hopper")
    B, Hq, Hkv, N, D = 1, 4, 2, 1024, 128
    q, k, v = random_qkv(B, Hq, Hkv, N, N, D, dtype=torch.bfloat16, device="cuda")
    plan = causal_plan(B, Hq, N, N, 128, 128, device="cuda")
    ref = reference_attention(q.float(), k.float(), v.float(), plan)
    args = (q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts)
    out = block_sparse_attention(*args, block_m=128, block_n=128, backend="hopper")
    assert A.last_backend == "hopper"
    _assert_close(out, ref, torch.bfloat16)
    ki = torch.arange(N, dtype=torch.int32, device="cuda").expand(B, Hkv, N).contiguous()
    out = block_sparse_attention(*args, block_m=128, block_n=128, backend="hopper", key_index=ki, key_mode="gather")
    assert A.last_backend == "hopper"
    _assert_close(out, ref, torch.bfloat16)
    long_list = ki.repeat(1, 1, 13)  # over 12 x Nk: "auto" gathers in place rather than copying
    assert A.reads_keys_in_place(q, k, v, plan.tile_offsets, block_m=128, block_n=128, key_index=long_list)
    assert not A.reads_keys_in_place(q, k, v, plan.tile_offsets, block_m=128, block_n=128, key_index=ki)
    with pytest.raises(NotImplementedError, match="gathered keys need a key_index"):
        H.hopper_block_sparse_attention(*args, block_n=128, key_gather=True)
    execute_plan(q, k, v, plan, config=KernelConfig(128, 128, num_warps=8, num_stages=2))
    assert A.last_backend == "triton"
    monkeypatch.setenv(A.BACKEND_ENV, "triton")
    out = execute_plan(q, k, v, plan)
    assert A.last_backend == "triton"
    assert not A.reads_keys_in_place(q, k, v, plan.tile_offsets, block_m=128, block_n=128, key_index=long_list)
    _assert_close(out, ref, torch.bfloat16)


@gpu
@hopper_gpu
def test_gpu_the_configured_kernel_picks_the_backend():
    """``SparseConfig(kernel="triton")`` runs the Triton kernel only, as do ``kernel_options``; "auto" the Hopper
    kernel where it serves."""
    import sparse_compile
    from sparse_compile import SparseConfig

    A = _attention_module()
    q, k, v = random_qkv(1, 4, 2, 1024, 1024, 128, dtype=torch.bfloat16, device="cuda")
    for kernel, options, backend in (("triton", None, "triton"), ("auto", None, "hopper"),
                                     ("auto", {"num_stages": 2}, "triton")):  # options tune the Triton kernel
        config = SparseConfig(min_seq_len=2, dense_when_faster=False, kernel=kernel,
                              kernel_options=options).keep_all()
        out = sparse_compile.sparse_attention(q, k, v, config=config)
        assert A.last_backend == backend, kernel
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                                enable_gqa=True)
        _assert_close(out, ref, torch.bfloat16)


@gpu
@hopper_gpu
def test_gpu_s2o_keys_gathered_in_place_agree_with_copies():
    """An S2O key list over 12 x N: the executor runs one call in which the Hopper kernel gathers the ranked keys
    in place (no permuted copies) and agrees with the segment chunks over copies (outputs, visited counts)."""
    from sparse_compile import SparseConfig
    from sparse_compile.methods import build_plan
    from sparse_compile.methods import s2o
    from sparse_compile.methods.s2o import execute_s2o

    A = _attention_module()
    B, Hq, Hkv, N, D = 1, 8, 2, 8192 + 64, 128
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, strength=1.0, device="cuda")
    config = SparseConfig(method="s2o", s2o={"segment_size": 256})
    scale = D ** -0.5
    plan = build_plan(q, k, scale, config)
    assert plan.key_index.shape[-1] > 12 * N
    assert A.reads_keys_in_place(q, k, v, plan.tile_offsets, block_m=128, block_n=128, key_index=plan.key_index,
                                 query_index=plan.query_index, early_stop=plan.early_stop)
    before = A.BACKEND_CALLS["hopper"]
    gathered, gathered_visited = execute_s2o(q, k, v, plan, scale, config.params_of("s2o"), return_visited=True)
    assert A.BACKEND_CALLS["hopper"] == before + 2, A._HOPPER_FAILED  # the window pass, then one walk: no chunks
    # (copy_bytes_floor=0: a list this short would otherwise be copied in one piece)
    copied, copied_visited = execute_s2o(q, k, v, plan, scale, config.params_of("s2o"), return_visited=True, key_mode="copy",
                                         copy_bytes_floor=0)
    assert A.BACKEND_CALLS["hopper"] > before + 2  # the copies run in segment chunks
    _assert_close(gathered, copied, torch.bfloat16, "gathered vs copied keys")
    assert (gathered_visited == copied_visited).float().mean().item() > 0.99
    assert int(gathered_visited.sum()) < int(plan.tile_counts.sum())  # the walks stopped early
    # the window pass against one pass over the plan (the masked squares in the walk): same output, same stops
    one, one_visited = execute_s2o(q, k, v, plan, scale, config.params_of("s2o"), return_visited=True, window_pass=False)
    _assert_close(gathered, one, torch.bfloat16, "window pass vs one pass")
    window_counts = s2o.window_tables(N, 256, 128, 128, q.device)[1]
    masked = torch.minimum(plan.masked_counts, plan.tile_counts)
    assert (gathered_visited == one_visited - masked + window_counts).float().mean().item() > 0.99
    ref = reference_attention(q, k, v, plan, scale)
    _assert_close(one, ref, torch.bfloat16, "one pass vs reference")


@gpu
@hopper_gpu
@pytest.mark.parametrize("keys", ["copy", "gather"])
def test_gpu_hopper_two_passes_equal_one_pass(keys):
    """The Hopper kernel's first pass writes each row's log2-sum-exp2 (against float64), and a walk resumed from
    it (``skip_masked``, ``resume``: S2O's window pass) matches one pass over the list: outputs, early stops."""
    H = importlib.import_module("sparse_compile.kernels.hopper")
    B, Hq, Hkv, N, D = 1, 8, 2, 3000, 128
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, strength=1.0, device="cuda")
    causal = causal_plan(B, Hq, N, N, 128, 128, device="cuda")
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device="cuda")
    H.hopper_block_sparse_attention(q, k, v, causal.tile_offsets, causal.tile_counts, causal.masked_counts,
                                    block_n=128, lse=lse)
    kk = k.double().repeat_interleave(Hq // Hkv, 1)
    s = (q.double() @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(
        torch.ones(N, N, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1) / math.log(2), rtol=1e-4, atol=1e-3)
    del s, kk
    qi = _segment_permutation(B, Hq, N)
    ki = _segment_permutation(B, Hkv, N)
    plan = _gpu_sparse_plan(B, Hq, N, N, 128, 128, 0.5, query_index=qi, key_index=ki, early_stop=0.02)
    masked = torch.minimum(plan.masked_counts, plan.tile_counts)
    options = dict(block_n=128, key_index=ki, query_index=qi, early_stop=plan.early_stop, return_visited=True,
                   key_gather=keys == "gather")
    one, one_visited = H.hopper_block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts,
                                                       plan.masked_counts, **options)
    out = H.hopper_block_sparse_attention(q, k, v, plan.tile_offsets, masked, plan.masked_counts, lse=lse,
                                          **dict(options, early_stop=0.0, return_visited=False))
    two, two_visited = H.hopper_block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts,
                                                       plan.masked_counts, out=out, lse=lse, resume=True,
                                                       skip_masked=True, **options)
    assert two.data_ptr() == out.data_ptr()
    _assert_close(two, one, torch.bfloat16, "two passes vs one")
    assert (two_visited + masked == one_visited).float().mean().item() > 0.99
    assert int(two_visited.sum()) < int((plan.tile_counts - masked).sum())  # the walks stopped early



@gpu
@hopper_gpu
@pytest.mark.parametrize("D,bn,N", [(128, 128, 5000), (64, 128, 3001), (128, 128, 300)])
def test_gpu_hopper_persistent_ctas_are_bit_identical(D, bn, N):
    """``persistent=True``: one CTA per SM walking work items in turn (the ring and Q's barriers run on across blocks,
    O leaves from registers) computes what one CTA per block does, bit for bit: a causal plan with lse (S2O's
    window pass), and a sparse plan over a permuted key copy with the P.V skip, some blocks with no tile at all
    (they write zeros and lse -inf), GQA, batch 2, an odd length; with fewer blocks than SMs too (N=300)."""
    H = importlib.import_module("sparse_compile.kernels.hopper")
    B, Hq, Hkv = 2, 8, 2
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, strength=1.0, device="cuda")
    causal = causal_plan(B, Hq, N, N, 128, bn, device="cuda")
    ki = _segment_permutation(B, Hkv, N)
    plan = _gpu_sparse_plan(B, Hq, N, N, 128, bn, 0.5, key_index=ki)
    counts = plan.tile_counts.clone()
    counts[:, :, 1::3] = 0  # blocks with nothing to compute
    masked = torch.minimum(plan.masked_counts, counts)

    def run_all(persistent):
        lse = torch.empty(B, Hq, N, dtype=torch.float32, device="cuda")
        first = H.hopper_block_sparse_attention(q, k, v, causal.tile_offsets, causal.tile_counts,
                                                causal.masked_counts, block_n=bn, lse=lse, persistent=persistent)
        lse_sparse = torch.empty(B, Hq, N, dtype=torch.float32, device="cuda")
        sparse = H.hopper_block_sparse_attention(q, k, v, plan.tile_offsets, counts, masked, block_n=bn,
                                                 key_index=ki, pv_skip=-8.0, lse=lse_sparse, persistent=persistent)
        return first, lse, sparse, lse_sparse

    results = [run_all(persistent) for persistent in (False, True)]
    assert torch.isfinite(results[0][0]).all() and torch.isfinite(results[0][2]).all()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    empty = (counts == 0).repeat_interleave(128, dim=-1)[..., :N]
    assert (results[1][2].float().abs().sum(-1)[empty] == 0).all()
    assert torch.isneginf(results[1][3][empty]).all()
    _assert_close(results[1][0], dense_reference(q, k, v), torch.bfloat16)
