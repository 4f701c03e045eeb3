"""fp8_attention_error.py and share_rules.py: their emulation and selection against the package and exact
attention, on small random inputs (``python -m pytest benchmarks/research``)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_attention_error as fp8  # noqa: E402
import share_rules  # noqa: E402

import sparse_compile  # noqa: E402
from sparse_compile.kernels.validate import expand_heads  # noqa: E402


def planned_tiles(q: torch.Tensor, k: torch.Tensor, config) -> torch.Tensor:
    """(1, H, nqb, nkt) bool: the tiles the package's plan for ``config`` lists (128-token tiles, N a multiple)."""
    heads, n = q.shape[1], q.shape[2]
    plan = sparse_compile.extend.build_plan(q, k, 0.125, config)
    offsets, counts = expand_heads(plan.tile_offsets, heads).long(), expand_heads(plan.tile_counts, heads).long()
    live = torch.arange(offsets.shape[-1]) < counts[..., None]
    listed = torch.zeros(1, heads, n // 128, n // 128 + 1, dtype=torch.bool)
    listed.scatter_(3, torch.where(live, offsets // 128, n // 128), True)
    return listed[..., :-1]


def test_fp8_emulation_without_rounding_is_exact_attention():
    """K smoothing, Q smoothing and the rotation change no score: with nothing rounded the output is attention's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(256, 64, generator=g, dtype=torch.float64).float() * 3 for _ in range(3))
    exact = fp8.float_attention(q, k, v, 0.125)
    same = fp8.fp8_attention(q, k, v, 0.125, smooth_q=True, hadamard=True, qk_float=True, p_float=True)
    assert fp8.relative_l2(same, exact) < 1e-5


def test_fp8_emulation_rounds_within_e4m3():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(256, 64, generator=g) for _ in range(3))
    error = fp8.relative_l2(fp8.fp8_attention(q, k, v, 0.125), fp8.float_attention(q, k, v, 0.125))
    assert 1e-3 < error < 0.2  # e4m3 keeps 3 mantissa bits: some error, never a wrong softmax


def test_share_rule_selects_the_sampled_plan():
    """share:0.1 keeps exactly the tiles of the package's `sampled` plan with the fixed share 0.1 (CPU: exact
    scores)."""
    g = torch.Generator().manual_seed(2)
    n, heads = 128 * 24, 2
    q, k = (torch.randn(1, heads, n, 64, generator=g) for _ in range(2))
    keep = share_rules.select(q, k, 0.125, ("share", 0.1), floor=0.05)
    config = sparse_compile.SparseConfig(method="sampled", min_seq_len=128, dense_when_faster=False,
                                         sampled={"mass_target": 0.0, "budget": 0.1})
    assert torch.equal(keep, planned_tiles(q, k, config))


def test_topp_with_a_cap_selects_the_default_sampled_plan():
    """topp:0.96 with floor 0.05 and cap 0.2 keeps the tiles of `sampled`'s plan at its defaults (the mass target)."""
    g = torch.Generator().manual_seed(5)
    n, heads = 128 * 24, 2
    q, k = (torch.randn(1, heads, n, 64, generator=g) for _ in range(2))
    q[:, 1] *= 4  # one head concentrated, one spread
    keep = share_rules.select(q, k, 0.125, ("topp", 0.96), floor=0.05, cap=0.2)
    config = sparse_compile.SparseConfig(method="sampled", min_seq_len=128, dense_when_faster=False)
    assert torch.equal(keep, planned_tiles(q, k, config))


def test_topp_keeps_at_least_the_floor_and_more_for_diffuse_rows():
    g = torch.Generator().manual_seed(3)
    n = 128 * 32
    q, k = (torch.randn(1, 1, n, 64, generator=g) * 0.1 for _ in range(2))  # nearly uniform attention
    share = share_rules.select(q, k, 0.125, ("share", 0.1), floor=0.05)
    topp = share_rules.select(q, k, 0.125, ("topp", 0.97), floor=0.05)
    assert topp.sum() > share.sum()  # a diffuse row needs most tiles to reach 97% of its mass


def test_pool_keeps_no_more_than_the_share_and_all_of_it_where_attention_is_spread():
    g = torch.Generator().manual_seed(4)
    n = 128 * 32
    q, k = (torch.randn(1, 2, n, 64, generator=g) for _ in range(2))
    q[:, 0] *= 0.02  # head 0 nearly uniform: every block wants more than its share, none gives
    share = share_rules.select(q, k, 0.125, ("share", 0.1), floor=0.05)
    pool = share_rules.select(q, k, 0.125, ("pool", 0.95), floor=0.05, pool_share=0.1)
    assert torch.equal(pool[:, 0], share[:, 0])
    assert int(pool[:, 1].sum()) <= int(share[:, 1].sum())
