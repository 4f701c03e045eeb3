"""Non-finite inputs stay confined in the planned attention, as in dense attention: the reference planner and
executor, and the fast planner with the Triton kernel (under the interpreter on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparse_compile.kernels.reference import segmented_argsort_desc
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.methods import build_plan
from sparse_compile.methods.pbs import pbs_key_importance
from sparse_compile.plan import VISIBLE_NONE, block_visibility, check_plan, execute_plan

from selection_helpers import PRESETS, _config, _pbs_segments, assert_order_agrees, structured_qk


NAN_N, NAN_D = 96, 16  # three 32-row segments, six 16-row blocks: room outside the NaN row's region


def _nan_inputs():
    seed = int(torch.randint(2**31 - 1, ()))  # fresh per test (conftest seeds torch per test)
    q, k = structured_qk(2, 4, 2, NAN_N, NAN_N, NAN_D, 16, seed=seed)
    return q, k, torch.randn(2, 2, NAN_N, NAN_D)


def _plan_and_output(q, k, v, cfg, planner):
    plan = build_plan(q, k, None, cfg, implementation=planner)
    check_plan(plan, q, k)
    kernel = "triton" if planner == "fast" else "reference"
    return plan, execute_plan(q, k, v, plan, kernel=kernel)


def _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row):
    """(q with the NaN, plan, output) of a NaN in query row (batch, head, row): that row NaN, every other finite."""
    bad = q.clone()
    bad[batch, head, row] = float("nan")
    plan, out = _plan_and_output(bad, k, v, cfg, planner)
    assert bool(out[batch, head, row].isnan().all())
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[batch, head, row] = False
    assert bool(torch.isfinite(out[others]).all())
    return bad, plan, out


def _confinement(method, cfg, batch, head, row, heads_q, heads_kv):
    """bool (B, Hq, N): the output rows a NaN in query row (batch, head, row) may change (module docstrings)."""
    region = torch.zeros(2, heads_q, NAN_N, dtype=torch.bool)
    group = heads_q // heads_kv
    group_heads = slice(head // group * group, head // group * group + group)
    if method in ("pbs", "sampled", "peak"):  # its query block, in its head
        size = cfg.params_of("pbs").block_size if method == "pbs" else cfg.params_of(method).block_size
        region[batch, head, row // size * size: row // size * size + size] = True
    elif method == "sparge":
        size = cfg.params_of("sparge").block_size_q
        region[batch, head, row // size * size: row // size * size + size] = True
    elif method == "bfla":  # its coarse query block, in every head of its KV group (the tile mask is shared)
        size = cfg.params_of("bfla").coarse_block_size
        region[batch, group_heads, row // size * size: row // size * size + size] = True
    else:  # s2o: its segment, in every head of its KV group (query order and the group's key ranking)
        size = cfg.params_of("s2o").segment_size
        region[batch, group_heads, row // size * size: row // size * size + size] = True
    return region


@pytest.mark.parametrize("planner", ["reference", "fast"])
@pytest.mark.parametrize("method", list(PRESETS))
def test_nan_query_row_stays_confined(method, planner):
    """A NaN in one query row: that row is NaN, every other row finite, and rows outside the row's query block
    (as each method defines it) equal the NaN-free run. Before: the pooled mean of the block went NaN and its
    selection arbitrary (and a NaN in PBS's last block reordered the whole head)."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS[method])
    _, clean = _plan_and_output(q, k, v, cfg, planner)
    batch, head = int(torch.randint(2, ())), int(torch.randint(4, ()))
    last_block = NAN_N - cfg.params_of("pbs").block_size  # PBS's importance rows (tested below)
    row = int(torch.randint(last_block if method == "pbs" else NAN_N, ()))
    _, plan, out = _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row)
    outside = ~_confinement(method, cfg, batch, head, row, 4, 2)
    torch.testing.assert_close(out[outside], clean[outside], rtol=1e-5, atol=1e-6)
    # the selectors: a query block with non-finite pooled statistics keeps every visible tile (the sampled
    # selector: when the row is one it scores; an unsampled NaN row leaves the plan as it was)
    sampled = cfg.params_of(method if method in ("sampled", "peak") else "sampled")
    sampled_row = (row % sampled.block_size) % sampled.sample_every == sampled.sample_every - 1
    if method != "s2o" and (method not in ("sampled", "peak") or sampled_row):
        vis = block_visibility(NAN_N, NAN_N, plan.block_m, plan.block_n, key_index=plan.key_index, batch=2,
                               heads=plan.tile_counts.shape[1])
        visible = expand_heads((vis != VISIBLE_NONE).sum(-1, dtype=torch.int32), plan.tile_counts.shape[1])
        size = cfg.params_of("bfla").coarse_block_size if method == "bfla" else plan.block_m
        blocks = slice(row // size * size // plan.block_m, (row // size * size + size) // plan.block_m)
        plan_head = head if plan.tile_counts.shape[1] == 4 else head // 2
        assert torch.equal(plan.tile_counts[batch, plan_head, blocks], visible[batch, plan_head, blocks])


@pytest.mark.parametrize("planner", ["reference", "fast"])
def test_nan_query_row_in_pbs_last_block_keeps_other_rows_finite(planner):
    """PBS's key order comes from its last query block: a NaN row there is left out of the importance (one row
    fewer, documented), so the order may change, but it is not scrambled and no other row goes non-finite."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS["pbs"])
    batch, head = int(torch.randint(2, ())), int(torch.randint(4, ()))
    row = NAN_N - 1 - int(torch.randint(cfg.params_of("pbs").block_size, ()))
    bad, plan, out = _run_with_nan_query_row(q, k, v, cfg, planner, batch, head, row)
    # the importance ignores the row: the same order as from the other rows' scores alone
    importance = pbs_key_importance(bad.double(), k.double(), 1 / math.sqrt(NAN_D), cfg.params_of("pbs").block_size)
    assert bool(torch.isfinite(importance).all())
    assert_order_agrees(plan.key_index, segmented_argsort_desc(importance, 32, NAN_N // 32).int(), importance,
                        _pbs_segments(NAN_N, 32), "pbs key order with a NaN row")


@pytest.mark.parametrize("planner", ["reference", "fast"])
@pytest.mark.parametrize("method", list(PRESETS))
def test_nan_key_reaches_every_row_that_sees_it(method, planner):
    """A NaN key: every row that sees it in dense attention is NaN (its tile is kept by every block that sees it,
    and S2O ranks it first, before any early stop); every other row stays finite."""
    q, k, v = _nan_inputs()
    cfg = _config(*PRESETS[method])
    batch, kv_head, j = int(torch.randint(2, ())), int(torch.randint(2, ())), int(torch.randint(NAN_N, ()))
    bad = k.clone()
    bad[batch, kv_head, j] = float("nan")
    _, out = _plan_and_output(q, bad, v, cfg, planner)
    sees = torch.zeros(out.shape[:3], dtype=torch.bool)
    sees[batch, 2 * kv_head: 2 * kv_head + 2, j:] = True
    assert bool(out[sees].isnan().all())
    assert bool(torch.isfinite(out[~sees]).all())
