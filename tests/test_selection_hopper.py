"""The fast reorder/select stages on Hopper: their kernels compile for sm_90 (on any machine), and on a GPU
(``@pytest.mark.gpu``) they agree with the PyTorch references in bf16 at 8K and 16K, by the agreement rule of
``test_selection_fast.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparse_compile import SparseConfig
from sparse_compile.methods import build_plan, stage_functions
from sparse_compile.plan import plan_density
from sparse_compile.methods.scoring import block_mean
from sparse_compile.methods.bfla import block_softmax_scale
from sparse_compile.methods.pbs import pbs_key_importance
from sparse_compile.plan import check_plan

from selection_helpers import (
    PRESETS,
    _pbs_segments,
    assert_keep_agrees,
    assert_order_agrees,
    assert_plan_layout,
    fast_bfla_coarse,
    keep_table,
    plans_identical,
    reference_bfla_coarse,
    reference_bounds,
    structured_qk,
    stage_params,
)


# ---------------------------------------------------------------------------------------------------------------
# compiles for Hopper (the interpreter accepts code the compiler rejects)

_COMPILE_SELECTION_FOR_SM90 = r"""
import sys, triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print("NO_BACKEND"); sys.exit(0)
from sparse_compile.kernels import pooling, mass, sorting, pbs, bfla, s2o, sampled, permute, peak, budget, fp8

def compile_kernel(fn, pointers, floats, const, warps=4):
    sig = {}
    for name in fn.arg_names:
        if name in const: sig[name] = "constexpr"
        elif name in pointers: sig[name] = "*" + pointers[name]
        elif name in floats: sig[name] = "fp32"
        else: sig[name] = "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    assert k.metadata.shared <= 232448, (fn.__name__, const, k.metadata.shared)  # an H100's 227 KiB

for nbp, chunk, hasidx, mean, sim, pos, guide, sort, finite in [(1, 64, False, True, True, False, False, False, False),
        (4, 64, True, True, True, True, False, False, False), (1, 128, False, True, False, False, True, True, True)]:
    compile_kernel(pooling._pool_kernel,
        dict(x_ptr="bf16", idx_ptr="i32", guide_ptr="fp32", mean_ptr="fp32", sim_ptr="fp32", kmin_ptr="i32",
             kmax_ptr="i32", kpad_ptr="i32", gdot_ptr="fp32", order_ptr="i32"), set(),
        dict(BLOCK=2048 if sort else 64, BLOCKS_PER_PROGRAM=nbp, CHUNK=chunk, D=128, D_PAD=128, HAS_INDEX=hasidx,
             WANT_MEAN=mean, WANT_SIM=sim, WANT_POS=pos, WANT_GUIDE=guide, SORT_GUIDE=sort, FINITE_ROWS_MEAN=finite,
             ROW_SLOTS=chunk if sort else 1))
compile_kernel(pooling._pooled_logits_kernel, dict(qm_ptr="fp32", km_ptr="fp32", out_ptr="fp32"), set(),
               dict(BLOCK_M=128, BLOCK_N=128, D=128, D_PAD=128, R=64, C=64, PREC="tf32x3"))
for judge, perm, keep_all, plan in [(False, True, False, True), (True, False, False, True), (False, False, False, False),
                                   (False, False, True, True)]:
    compile_kernel(mass._mass_select_kernel,
        dict(logit_ptr="fp32", kmin_ptr="i32", kmax_ptr="i32", kpad_ptr="i32", ksim_ptr="fp32", qsim_ptr="fp32",
             offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32", keep_ptr="i8"), {"scale", "tau", "theta"},
        dict(BLOCK_M=128, BLOCK_N=128, SEGMENT=256 if perm else 0, W=256, ROWS=4, HAS_POSITIONS=perm,
             DIAGONAL_IN_SOFTMAX=not perm, KEEP_DIAGONAL=True, KEEP_FIRST_KEY=True, JUDGE=judge, KEEP_ALL=keep_all,
             WRITE_PLAN=plan), warps=1)
compile_kernel(sorting._segmented_argsort_kernel, dict(x_ptr="fp32", out_ptr="i32"), set(),
               dict(SEGMENT=256, SEGMENT_PAD=256, SEGMENTS_PER_PROGRAM=8), warps=8)
compile_kernel(pbs._pbs_lse_kernel, dict(q_ptr="bf16", k_ptr="bf16", m_ptr="fp32", s_ptr="fp32"), {"qk_scale"},
               dict(CHUNK=4096, BLOCK_N=64, ROWS_PAD=128, D=128, D_PAD=128, PREC="none"), warps=8)
for sort in (True, False):
    compile_kernel(pbs._pbs_importance_kernel, dict(q_ptr="bf16", k_ptr="bf16", m_ptr="fp32", s_ptr="fp32",
                   imp_ptr="fp32", perm_ptr="i32"), {"qk_scale", "count"},
                   dict(BLOCK_N=256, ROWS_PAD=128, ROW_BLOCK=64, NUM_CHUNKS_PAD=16, D=128, D_PAD=128, PREC="none",
                        WRITE_IMPORTANCE=not sort, SORT=sort), warps=8)
for idx in (False, True):
    compile_kernel(bfla._bfla_scores_kernel, dict(q_ptr="bf16", k_ptr="bf16", idx_ptr="i32", out_ptr="fp32"), set(),
                   dict(COARSE=256, G=64, NG=4, QB=32, KB=32, R=128, C=128, D=128, D_PAD=128, HAS_INDEX=idx,
                        PREC="none"), warps=8)
for pos, keep_all in ((False, False), (True, False), (False, True)):
    compile_kernel(bfla._bfla_tiles_kernel, dict(mass_ptr="i8", kmin_ptr="i32", kmax_ptr="i32", kpad_ptr="i32",
                   offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32"), set(),
                   dict(TILE_Q=128, TILE_K=64, COARSE=256, W=512, ROWS=2, HAS_POSITIONS=pos, STRIDE_ON=True,
                        RANDOM_ON=True, KEEP_ALL=keep_all), warps=1)
for every, blocks, heads in ((8, 4, 4), (4, 4, 2), (16, 32, 1)):
    compile_kernel(sampled._sampled_mass_kernel, dict(q_ptr="bf16", k_ptr="bf16", k_scale_ptr="fp32", out_ptr="fp32"),
                   {"scale", "tiny"}, dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks,
                   HEADS=heads, D=128, D_PAD=128, PREC="none", FP8=False), warps=8)
for every, blocks, heads, d in ((8, 2, 4, 128), (16, 16, 1, 64)):
    compile_kernel(sampled._sampled_mass_kernel, dict(q_ptr="bf16", k_ptr="fp8e4nv", k_scale_ptr="fp32",
                   out_ptr="fp32"), {"scale", "tiny"}, dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every,
                   BLOCKS=blocks, HEADS=heads, D=d, D_PAD=d, PREC="none", FP8=True), warps=4)
for every, blocks, heads, first in ((8, 4, 4, True), (16, 32, 1, False), (4, 2, 4, True)):
    compile_kernel(peak._peak_kernel, dict(q_ptr="bf16", k_ptr="bf16", k_scale_ptr="fp32", out_ptr="fp32"), {"scale"},
                   dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks, HEADS=heads,
                        KEEP_FIRST=first, D=128, D_PAD=128, PREC="none", FP8=False), warps=8)
for every, blocks, heads, d in ((8, 2, 4, 128), (16, 16, 1, 64)):
    compile_kernel(peak._peak_kernel, dict(q_ptr="bf16", k_ptr="fp8e4nv", k_scale_ptr="fp32", out_ptr="fp32"),
                   {"scale"}, dict(BLOCK_M=128, BLOCK_N=128, EVERY=every, ROWS=128 // every, BLOCKS=blocks, HEADS=heads,
                   KEEP_FIRST=True, D=d, D_PAD=d, PREC="none", FP8=True), warps=4)
compile_kernel(fp8._amax_kernel, dict(x_ptr="bf16", amax_ptr="fp32"), set(), dict(D=128, D_PAD=128, BLOCK=64))
compile_kernel(fp8._quantize_kernel, dict(x_ptr="bf16", amax_ptr="fp32", out_ptr="fp8e4nv", scale_ptr="fp32"), set(),
               dict(D=96, D_PAD=128, BLOCK=64, MAX=448.0))
for keep_all, by_mass in ((False, False), (True, False), (False, True)):
    compile_kernel(budget._budget_select_kernel, dict(score_ptr="fp32", offs_ptr="i32", cnt_ptr="i32",
                   msk_ptr="i32"), {"budget", "mass_target", "min_budget"}, dict(BLOCK_M=128, BLOCK_N=128, W=1024,
                   ROWS=1, KEEP_FIRST_KEY=True, KEEP_ALL=keep_all, BY_MASS=by_mass), warps=1)
compile_kernel(s2o._s2o_rank_keys_kernel, dict(k_ptr="bf16", qm_ptr="fp32", out_ptr="i32"), set(),
               dict(BLOCK_T=64, G_PAD=64, D=128, D_PAD=128, PREC="tf32x3"))
compile_kernel(s2o._s2o_segment_of_kernel, dict(slot_ptr="i64", out_ptr="i16"), set(), dict(BLOCK=1024))
compile_kernel(s2o._s2o_assemble_kernel, dict(by_score_ptr="i64", by_segment_ptr="i64", out_ptr="i32"), set(),
               dict(BLOCK=256))
for qidx in (True, False):
    compile_kernel(s2o._s2o_select_kernel, dict(qidx_ptr="i32", offs_ptr="i32", cnt_ptr="i32", msk_ptr="i32"),
                   set(), dict(BLOCK_M=128, BLOCK_N=128, W=1024, ROWS=4, HAS_QUERY_INDEX=qidx))
compile_kernel(permute._permute_rows_kernel, dict(K="bf16", V="bf16", KP="bf16", VP="bf16", KeyIndex="i32"),
               set(), dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK=64))
print("ALL OK")
"""


def test_selection_kernels_compile_for_hopper():
    """Every selection kernel, in its main variants, compiles for sm_90 on the CPU and fits shared memory."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE_SELECTION_FOR_SM90], capture_output=True, text=True,
                         env=env, timeout=600)
    if "NO_BACKEND" in run.stdout:
        pytest.skip("this Triton has no CUDA compiler backend")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 at 8K and 16K, the methods' paper defaults


GPU_SHAPES = [(1, 8, 2, 8192, 128), (2, 4, 2, 16384, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-N{s[3]}-D{s[4]}")
@pytest.mark.parametrize("method", list(PRESETS))
def test_gpu_bf16_agreement(method, shape):
    B, Hq, Hkv, N, D = shape
    dev = "cuda"
    reorder, select = PRESETS[method]
    block = {"pbs": 128, "sparge": 64, "bfla": 64, "s2o": 128, "sampled": 128, "peak": 128}[method]
    q, k = structured_qk(B, Hq, Hkv, N, N, D, block, seed=9, dtype=torch.bfloat16, device=dev)
    cfg = SparseConfig(method=method)
    scale = 1 / math.sqrt(D)
    r_ref = stage_functions(reorder, "pbs", False)[0](q, k, scale, stage_params(cfg, reorder))
    r_fast = stage_functions(reorder, "pbs", True)[0](q, k, scale, stage_params(cfg, reorder))
    if reorder == "pbs":
        imp = pbs_key_importance(q.double(), k.double(), scale, cfg.params_of("pbs").block_size)
        segments = _pbs_segments(N, cfg.params_of("pbs").segment_size)
        assert_order_agrees(r_fast.key_index, r_ref.key_index, imp, segments, "pbs")
    if reorder == "s2o":
        lay = r_ref.extras["layout"]
        S, g = cfg.params_of("s2o").segment_size, len(lay.seg_len)
        kg = k[:, :, :S].double().mean(2)
        sq = (q.double().view(B, Hkv, Hq // Hkv, N, D) * kg[:, :, None, None]).sum(-1).view(B, Hq, N)
        assert_order_agrees(r_fast.query_index, r_ref.query_index, sq, [(s * S, (s + 1) * S) for s in range(g)], "q")
        qm = block_mean(q.double(), S).view(B, Hkv, Hq // Hkv, g, D).mean(2)
        for n in range(1, g):
            z = lay.base[n] + lay.intra_pad[n]
            s_n = (qm[:, :, n, None, :] @ k.double().transpose(-1, -2)[..., : n * S])[..., 0, :]
            assert_order_agrees(r_fast.key_index[..., z: z + n * S], r_ref.key_index[..., z: z + n * S], s_n,
                                [(0, n * S)], f"s2o prefix {n}")
    p_ref = stage_functions(reorder, select, False)[1](q, k, scale, r_ref, cfg.params_of(select))
    p_fast = stage_functions(reorder, select, True)[1](q, k, scale, r_ref, cfg.params_of(select))
    assert_plan_layout(p_fast, p_ref)
    check_plan(p_fast, q, k)
    if method in ("pbs", "sparge", "sampled", "peak") and not plans_identical(p_fast, p_ref):
        # a mass target's tile counts come from the plans (reference_bounds)
        sure, maybe = reference_bounds(select, q, k, scale, r_ref, cfg, plans=(p_fast, p_ref))
        assert_keep_agrees(keep_table(p_fast, sure.shape[-1]), sure, maybe, what=method, max_ambiguous_rows=0.25)
    if method == "bfla":
        alpha = block_softmax_scale(cfg.params_of("bfla"), scale)  # the block softmax's scale (Eq. 9)
        coarse_fast = fast_bfla_coarse(q, k, alpha, r_ref, cfg)
        coarse_ref = reference_bfla_coarse(q, k, alpha, r_ref, cfg)
        if torch.equal(coarse_fast, coarse_ref):
            assert plans_identical(p_fast, p_ref)
        else:
            sure, maybe = reference_bounds("bfla_coarse", q, k, alpha, r_ref, cfg)
            assert_keep_agrees(coarse_fast, sure, maybe, what="bfla coarse", max_ambiguous_rows=0.25)
    if method == "s2o":
        assert plans_identical(p_fast, p_ref)
    # and through build_plan (auto picks the fast path on CUDA): a plan the kernel runs, close to the reference
    p_auto = build_plan(q, k, None, cfg)
    d_auto = plan_density(p_auto, N, N, Hq)
    d_ref = plan_density(build_plan(q, k, None, cfg, implementation="reference"), N, N, Hq)
    assert float((d_auto - d_ref).abs().max()) < 0.01
