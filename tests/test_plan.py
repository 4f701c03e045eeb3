"""The block plan and its PyTorch reference executor: against dense attention, and its validation."""

import pytest
import torch

from sparse_compile.plan import (
    block_visibility,
    causal_plan,
    causal_tile_count,
    check_plan,
    plan_from_block_mask,
    reference_attention,
)

from helpers import dense_reference, random_qkv, rel_error

SHAPES = [
    # batch, Hq, Hkv, Nq, Nk, D, block_m, block_n
    (2, 4, 2, 77, 77, 16, 16, 16),
    (1, 8, 1, 50, 130, 32, 32, 16),  # chunked prefill, MQA
    (1, 2, 2, 5, 5, 8, 16, 32),
    (3, 4, 4, 100, 100, 64, 32, 64),
]


def _assert_valid_and_dense(plan, q, k, v):
    """A plan that keeps every visible tile: valid for q/k, and the reference executor on it is dense attention."""
    check_plan(plan, q, k)
    assert rel_error(reference_attention(q, k, v, plan), dense_reference(q, k, v)) < 1e-12


def _perm(batch, heads, n):
    return torch.stack([torch.randperm(n) for _ in range(batch * heads)]).view(batch, heads, n).to(torch.int32)


@pytest.mark.parametrize("shape", SHAPES)
def test_full_plan_equals_dense(shape):
    B, Hq, Hkv, Nq, Nk, D, bm, bn = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64)
    plan = causal_plan(B, Hq, Nq, Nk, bm, bn)
    _assert_valid_and_dense(plan, q, k, v)


@pytest.mark.parametrize("shape", SHAPES)
def test_permuted_keys_and_queries_equal_dense(shape):
    B, Hq, Hkv, Nq, Nk, D, bm, bn = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64)
    key_index, query_index = _perm(B, Hkv, Nk), _perm(B, Hq, Nq)
    vis = block_visibility(Nq, Nk, bm, bn, key_index=key_index, query_index=query_index)
    plan = plan_from_block_mask(torch.ones_like(vis, dtype=torch.bool), vis, bm, bn,
                                key_index=key_index, query_index=query_index)
    _assert_valid_and_dense(plan, q, k, v)


@pytest.mark.parametrize("shape", SHAPES)
def test_early_stop_and_pv_skip_at_limits_equal_dense(shape):
    B, Hq, Hkv, Nq, Nk, D, bm, bn = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64)
    plan = causal_plan(B, Hq, Nq, Nk, bm, bn).with_options(early_stop=1e-300, pv_skip=-1e300)
    out, visited = reference_attention(q, k, v, plan, return_visited=True)
    assert rel_error(out, dense_reference(q, k, v)) < 1e-12
    assert int(visited.sum()) == causal_tile_count(Nq, Nk, bm, bn) * B * Hq


def test_early_stop_stops_and_changes_little():
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 256, 16
    q, k, v = random_qkv(B, H, H, N, N, D, dtype=torch.float64)
    k[:, :, :16] *= 0  # not special; attention nearly uniform
    plan = causal_plan(B, H, N, N, 16, 16).with_options(early_stop=0.2)
    out, visited = reference_attention(q, k, v, plan, return_visited=True)
    assert int(visited.sum()) < causal_tile_count(N, N, 16, 16) * B * H
    assert torch.isfinite(out).all()


def test_dropping_tiles_changes_output():
    B, H, N, D = 1, 1, 64, 8
    q, k, v = random_qkv(B, H, H, N, N, D, dtype=torch.float64)
    vis = block_visibility(N, N, 16, 16)
    keep = torch.ones_like(vis, dtype=torch.bool)
    keep[..., 3, 0] = False  # drop one visible tile
    plan = plan_from_block_mask(keep, vis, 16, 16)
    assert rel_error(reference_attention(q, k, v, plan), dense_reference(q, k, v)) > 1e-6


def test_check_plan_rejects_broken_promises():
    B, H, N, D = 1, 2, 40, 8
    q, k, v = random_qkv(B, H, H, N, N, D)
    plan = causal_plan(B, H, N, N, 16, 16)
    with pytest.raises(ValueError, match="not fully visible"):
        check_plan(plan.with_options(masked_counts=torch.zeros_like(plan.masked_counts)), q, k)
    with pytest.raises(ValueError, match="int32"):
        check_plan(plan.with_options(tile_counts=plan.tile_counts.long()), q, k)
    with pytest.raises(ValueError, match="permutation"):
        check_plan(plan.with_options(query_index=torch.zeros(B, H, N, dtype=torch.int32)), q, k)
