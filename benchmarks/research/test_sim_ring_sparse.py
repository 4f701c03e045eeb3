"""sim_ring_sparse.py: the ring-parallel shard metrics against a brute-force count, on small plans
(``python -m pytest benchmarks/research``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_ring_sparse as sim  # noqa: E402

from sparse_compile.plan import block_visibility, causal_plan, plan_from_block_mask  # noqa: E402

BLOCK = 16


def random_plan(n: int, heads: int, seed: int, permute: bool):
    """A plan listing random causal tiles (diagonal always), optionally with keys permuted inside 2-tile segments."""
    gen = torch.Generator().manual_seed(seed)
    vis = block_visibility(n, n, BLOCK, BLOCK, batch=1, heads=heads)
    keep = (torch.rand(vis.shape, generator=gen) < 0.3) & (vis > 0)
    keep |= torch.eye(n // BLOCK, dtype=torch.bool)[None, None]
    plan = plan_from_block_mask(keep, vis, BLOCK, BLOCK)
    if permute:
        seg = 2 * BLOCK
        perm = torch.cat([s * seg + torch.randperm(seg, generator=gen) for s in range(n // seg)])
        plan = plan.with_options(key_index=perm.to(torch.int32)[None, None])
    return plan


def brute_force(plan, n: int, ranks: int, assignment: str) -> dict:
    owner_of_chunk = sim.chunk_owner(ranks, assignment).tolist()
    size = n // len(owner_of_chunk)
    owner = [owner_of_chunk[p // size] for p in range(n)]
    need = [set() for _ in range(ranks)]
    tiles = [0] * ranks
    heads, nqb = plan.tile_counts.shape[1:]
    for h in range(heads):
        for i in range(nqb):
            r = owner[i * plan.block_m]
            for t in range(int(plan.tile_counts[0, h, i])):
                tiles[r] += 1
                off = int(plan.tile_offsets[0, h, i, t])
                for p in range(off, off + plan.block_n):
                    key = p if plan.key_index is None else int(plan.key_index[0, 0, p])
                    need[r].add(key)
    pairs = needed = 0
    for r in range(ranks):
        last_q = max(p for p in range(n) if owner[p] == r)
        for s in range(ranks):
            if s != r and min(p for p in range(n) if owner[p] == s) <= last_q:
                pairs += 1
                needed += any(owner[k] == s for k in need[r])
    dense = (ranks - 1) * (n // ranks)
    shard = [len({k // size for k in need[r] if owner[k] != r}) * size for r in range(ranks)]
    keys = [sum(owner[k] != r for k in need[r]) for r in range(ranks)]
    return {"remote_pairs_needed": needed / pairs, "recv_shard_frac_max": max(shard) / dense,
            "recv_keys_frac_max": max(keys) / dense, "compute_imbalance": max(tiles) / (sum(tiles) / ranks)}


def test_zigzag_pairs_first_and_last_chunks():
    assert sim.chunk_owner(4, "zigzag").tolist() == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sim.chunk_owner(3, "contiguous").tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="assignment must be one of"):
        sim.chunk_owner(2, "striped")


@pytest.mark.parametrize("assignment", sim.ASSIGNMENTS)
def test_dense_plan_needs_every_shard_and_zigzag_balances_it(assignment):
    n, ranks = 256, 4
    m = sim.shard_metrics(causal_plan(1, 2, n, n, BLOCK, BLOCK), n, ranks, assignment)
    assert m["remote_pairs_needed"] == 1.0
    # the straggler of causal ring attention needs every other shard, whatever the assignment
    assert m["recv_shard_frac_max"] == 1.0 and m["recv_keys_frac_max"] == 1.0
    if assignment == "zigzag":
        assert m["compute_imbalance"] == 1.0
    else:  # rank r of P holds query blocks whose causal tiles grow linearly: last rank's share over the mean
        blocks = n // BLOCK // ranks
        per_rank = [sum(r * blocks + j + 1 for j in range(blocks)) for r in range(ranks)]
        assert m["compute_imbalance"] == pytest.approx(max(per_rank) / (sum(per_rank) / ranks))


@pytest.mark.parametrize("assignment", sim.ASSIGNMENTS)
@pytest.mark.parametrize("permute", [False, True])
def test_metrics_match_brute_force(assignment, permute):
    n = 256
    plan = random_plan(n, heads=2, seed=3, permute=permute)
    for ranks in (2, 4):
        got = sim.shard_metrics(plan, n, ranks, assignment)
        want = brute_force(plan, n, ranks, assignment)
        assert got == pytest.approx(want), (ranks, got, want)


def test_shards_must_be_whole_query_blocks():
    with pytest.raises(ValueError, match="multiples of block_m=16"):
        sim.shard_metrics(causal_plan(1, 1, 96, 96, BLOCK, BLOCK), 96, 4, "zigzag")


def test_cost_model_for_the_8b_shape():
    c = sim.cost_model(32, 0.1)
    assert c["ring"] == 4
    assert c["kv_bytes_per_layer_all_heads"] == (1 << 20) * 8 * 128 * 2 * 2  # 4 GiB
    assert c["ring_step_bytes"] == (1 << 18) * 128 * 2 * 2  # one KV head of a quarter of the sequence
    # 14.0 s over 32 layers on 4 GPUs -> 32 GPUs: 54.7 ms a layer, 4 ring steps
    assert c["attention_ms_per_step"] == pytest.approx(14.0 * 4 / 32 / 32 / 4 * 1e3)
    half = sim.cost_model(32, 0.1, skip_frac=0.5)
    assert half["nvlink_ms_per_step"] == pytest.approx(c["nvlink_ms_per_step"] / 2)
