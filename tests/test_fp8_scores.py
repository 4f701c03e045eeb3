"""FP8 scoring of ``peak`` and ``sampled``: the rule that decides it, the PyTorch emulation (the specification) and, on a GPU with
FP8 tensor cores, the kernels against it (quantization exact, scores to accumulation order, non-finite inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_compile import SparseConfig
from sparse_compile.methods.peak import FP8_MAX, PeakParams, peak_tile_scores, scores_in_fp8
from sparse_compile.methods.sampled import SampledParams, sampled_rows, sampled_tile_logits
from sparse_compile.methods.scoring import fp8_rows_and_keys, group_scores


def _qk(batch, hq, hkv, n, d, *, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, hq, n, d, generator=g)
    k = torch.randn(batch, hkv, n, d, generator=g)
    k[:, :, ::37] *= 6  # keys that stand out, as a lookup's does
    return q.to(device, dtype), k.to(device, dtype)


def test_fp8_max_matches_the_kernels():
    pytest.importorskip("triton")
    from sparse_compile.kernels.fp8 import FP8_MAX as kernel_max

    assert FP8_MAX == kernel_max == float(torch.finfo(torch.float8_e4m3fn).max)


def test_the_rule_scores_exactly_off_fp8_hardware():
    q, _ = _qk(1, 2, 1, 64, 16)
    assert PeakParams().fp8_scores  # on where the hardware has it
    assert not scores_in_fp8(PeakParams(), q)  # CPU: exact scores
    assert not scores_in_fp8(PeakParams(fp8_scores=False), q)


def test_fp8_scores_must_be_a_bool():
    with pytest.raises(ValueError, match="fp8_scores"):
        PeakParams(fp8_scores=1)
    with pytest.raises(ValueError, match="fp8_scores"):
        SparseConfig(method="peak", peak={"fp8_scores": "yes"})


@pytest.mark.parametrize("shape", [(1, 4, 2, 300, 64), (2, 2, 2, 129, 32)])
def test_emulated_fp8_is_within_rounding_of_exact(shape):
    """e4m3 keeps 3 mantissa bits: each product moves by at most ~2^-3 of itself, so a peak by at most ~1/8 of the
    sum of |products| of its row; the NaN blocks are the same."""
    b, hq, hkv, n, d = shape
    q, k = _qk(b, hq, hkv, n, d)
    scale = 1 / math.sqrt(d)
    exact = peak_tile_scores(q, k, scale, 32, 4, True)
    fp8 = peak_tile_scores(q, k, scale, 32, 4, True, fp8=True)
    assert fp8.dtype == torch.float32 and fp8.shape == exact.shape
    assert torch.equal(torch.isnan(exact), torch.isnan(fp8))
    finite = torch.isfinite(exact)
    bound = 2 * 2 * scale * (q.abs().amax() * k.abs().amax() * d) / 8  # two scores per peak
    assert (exact[finite] - fp8[finite]).abs().max() < bound
    # and far tighter in practice than the worst case
    assert (exact[finite] - fp8[finite]).abs().max() < 0.05 * exact[finite].abs().max()


def test_emulated_fp8_sampled_masses_are_within_rounding_of_exact():
    """The sampled rows' masses from e4m3 products: each logit moves by at most ~1/8 of its row's sum of |products|,
    in practice far less; the tiles that stand out (the keys scaled x6) keep most of their share of their block."""
    q, k = _qk(1, 4, 2, 300, 64)
    scale = 1 / 8
    exact = sampled_tile_logits(q, k, scale, 32, 4)
    fp8 = sampled_tile_logits(q, k, scale, 32, 4, fp8=True)
    assert fp8.dtype == torch.float32 and fp8.shape == exact.shape
    seen = exact > -60  # tiles some sampled row sees (the rest hold log(TINY))
    assert torch.equal(seen, fp8 > -60)

    def shares(logits):  # each tile's share of its block's mass: what the mass rule compares
        mass = torch.where(seen, logits.exp(), 0.0)
        return mass / mass.sum(-1, keepdim=True)

    # a log-mass moves by its logits' error and its forced region's: two logits' worth
    bound = 2 * scale * (q.abs().amax() * k.abs().amax() * q.shape[-1]) / 8
    assert (exact[seen] - fp8[seen]).abs().max() < bound
    standing_out = seen & (shares(exact) >= 0.05)
    assert standing_out.sum() > 20 and (shares(fp8)[standing_out] >= 0.5 * shares(exact)[standing_out]).all()
    assert SampledParams().fp8_scores and not scores_in_fp8(SampledParams(), q)  # CPU: exact scores


def test_emulated_fp8_keeps_non_finite_blocks_whole():
    """A NaN or infinite key element becomes NaN in e4m3: every block that sees it keeps every visible tile; blocks
    before it are scored as usual."""
    q, k = _qk(1, 2, 1, 256, 16)
    for bad in (float("nan"), float("inf"), float("-inf")):
        kk = k.clone()
        kk[0, 0, 150, 3] = bad
        for s in (peak_tile_scores(q, kk, 0.25, 32, 4, True, fp8=True),
                  sampled_tile_logits(q, kk, 0.25, 32, 4, fp8=True)):
            nan_blocks = torch.isnan(s).any(-1)[0, 0]
            assert nan_blocks[150 // 32:].all() and not nan_blocks[: 150 // 32].any(), bad


def test_emulated_fp8_quantizes_like_the_format():
    """Rows and keys land on e4m3 values times their scale (the largest finite magnitude maps to 448)."""
    from sparse_compile.methods.scoring import finite_amax as _finite_amax, fp8_round as _fp8_round

    x = torch.tensor([[1.0, -3.0, 0.1, 2 ** -12], [0.0, 0.0, 0.0, 0.0]])
    y, scale = _fp8_round(x, _finite_amax(x, -1))
    assert torch.equal(y[0, 1], torch.tensor(-FP8_MAX)) and scale[1, 0] == 1.0
    assert torch.equal(y, y.to(torch.float8_e4m3fn).float())
    assert torch.allclose(y * scale, x, rtol=2 ** -4, atol=3 / FP8_MAX * 2 ** -9)


# ---------------------------------------------------------------------------------------------------------------
# GPU with FP8 tensor cores


def _fp8_gpu():
    if not torch.cuda.is_available():
        return False
    from sparse_compile.kernels.fp8 import fp8_tensor_cores

    return fp8_tensor_cores(torch.device("cuda"))


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")


def _seen_tiles_of_both(shape, emulated, kernel):
    """The emulation's and the kernel's scores (``fn(q, k, scale)``) of the tiles some query of each block sees, on
    bf16 inputs of ``shape`` (B, Hq, Hkv, N, D) with one NaN query element."""
    b, hq, hkv, n, d = shape
    q, k = _qk(b, hq, hkv, n, d, device="cuda", dtype=torch.bfloat16, seed=3)
    q[0, 0, 2000 % n, 1] = float("nan")
    scale = 1 / math.sqrt(d)
    want, got = emulated(q, k, scale), kernel(q, k, scale)
    nqb, nkt = want.shape[-2:]
    seen = torch.arange(nkt, device="cuda")[None, :] <= torch.arange(nqb, device="cuda")[:, None] + (nkt - nqb)
    return want[..., seen], got[..., seen]


@pytest.mark.gpu
@needs_fp8
def test_gpu_quantize_heads_matches_the_emulation():
    from sparse_compile.kernels.fp8 import quantize_heads
    from sparse_compile.methods.scoring import finite_amax as _finite_amax, fp8_round as _fp8_round

    _, k = _qk(2, 2, 3, 1000, 96, device="cuda", dtype=torch.bfloat16)
    k[1, 2, 7, 5] = float("nan")
    k[0, 1, 9, 0] = float("inf")
    k8, scale = quantize_heads(k.transpose(1, 2).contiguous().transpose(1, 2))  # strided input
    want, want_scale = _fp8_round(k.float(), _finite_amax(k.float(), (-2, -1)))
    assert k8.dtype == torch.float8_e4m3fn and k8.is_contiguous()
    assert torch.equal(scale, want_scale[..., 0, 0])
    got = k8.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("shape", [(1, 8, 2, 8192, 128), (2, 4, 4, 4099, 64), (1, 2, 1, 1000, 80)])
def test_gpu_fp8_kernel_matches_the_emulation(shape):
    from sparse_compile.kernels.peak import peak_tile_scores as kernel_scores

    w, g = _seen_tiles_of_both(shape, lambda q, k, scale: peak_tile_scores(q, k, scale, 128, 8, True, fp8=True),
                               lambda q, k, scale: kernel_scores(q, k, scale, 128, 8, True, fp8=True))
    assert torch.equal(torch.isnan(w), torch.isnan(g))
    finite = torch.isfinite(w)
    assert torch.equal(finite, torch.isfinite(g))
    assert (w[finite] - g[finite]).abs().max() <= 2e-3 * (w[finite].abs().max() + 1)


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("shape", [(1, 8, 2, 8192, 128), (2, 4, 4, 4099, 64), (1, 2, 1, 1000, 80)])
def test_gpu_fp8_sampled_kernel_matches_the_emulation(shape):
    from sparse_compile.kernels.sampled import sampled_mass_logits

    largest = []

    def emulated(q, k, scale):
        rows, keys, factor = fp8_rows_and_keys(q[:, :, sampled_rows(q.shape[2], 128, 8, q.device)], k, scale)
        logits = group_scores(rows, keys) * factor[..., None]
        largest.append(logits[torch.isfinite(logits)].abs().max().item())
        return sampled_tile_logits(q, k, scale, 128, 8, fp8=True, local=8)

    w, g = _seen_tiles_of_both(shape, emulated,
                               lambda q, k, scale: sampled_mass_logits(q, k, scale, 128, 128, 8, fp8=True, local=8))
    assert torch.equal(torch.isnan(w), torch.isnan(g))
    finite = torch.isfinite(w)
    # The FP8 tensor cores sum the products with fewer bits than float32 (cuBLAS's FP8 GEMM on the same rounded rows
    # and keys misses exact sums by 0.012 at logits up to 29, H100), so logits agree to 2e-3 x (largest + 1), as the
    # peaks do; a tile's log-mass moves by at most twice that (its logits and the row's normaliser).
    assert ((w[finite] - g[finite]).abs() <= 4e-3 * (largest[0] + 1)).all()


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("method", ["peak", "sampled"])
def test_gpu_runs_fp8_and_keeps_the_plan_valid(method):
    """Through the method: the fast stage scores in FP8, the plan matches the emulated reference's but for
    near-equal tiles, and attention through it is finite."""
    import sparse_compile
    from sparse_compile.plan import check_plan

    q, k = _qk(1, 8, 2, 8192, 128, device="cuda", dtype=torch.bfloat16, seed=5)
    v = torch.randn_like(k)
    cfg = SparseConfig(method=method, **{method: {"budget": 0.1, "fp8_scores": True}})
    assert scores_in_fp8(cfg.params_of(method), q)
    plan = sparse_compile.extend.build_plan(q, k, 1 / math.sqrt(128), cfg, implementation="fast")
    check_plan(plan, q, k)
    out = sparse_compile.sparse_attention(q, k, v, config=cfg)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mass_target_lists_the_reference_tiles_on_the_same_scores():
    """The mass rule of ``kernels.budget`` on a 16K prompt's tile scores against the reference
    (``tiles.finish_budget_plan``): the same tiles but where a block's mass sits on the goal within float32
    summation order (a tile or two in all)."""
    from sparse_compile.kernels.sampled import sampled_mass_logits
    from sparse_compile.methods.fast_path import budget_plan
    from sparse_compile.methods.sampled import SampledParams
    from sparse_compile.methods.scoring import Reordering
    from sparse_compile.methods.tiles import finish_budget_plan

    b, hq, hkv, n, d = 1, 8, 2, 16384 + 77, 128
    q, k = _qk(b, hq, hkv, n, d, device="cuda", dtype=torch.bfloat16, seed=4)
    scores = sampled_mass_logits(q, k, 1 / math.sqrt(d), 128, 128, 8, False)
    none, params = Reordering("none"), SampledParams(budget=0.3, mass_target=0.95, min_budget=0.05)
    rule = (params.mass_target, params.min_budget)
    got = budget_plan(scores, q, k, none, params, *rule).tile_counts
    want = finish_budget_plan(scores, q, k, none, params, *rule).tile_counts
    assert int((want - got).abs().sum()) <= 2, (want - got).abs().sum()
