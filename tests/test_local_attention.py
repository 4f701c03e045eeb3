"""Sliding-window and chunked local attention (``local.Local``) on the package's kernels, exactly.

The kernel's masked tiles apply the band (under the Triton interpreter here: tiny shapes), the PyTorch reference
the same predicate; both against dense SDPA with ``Local.visible``'s explicit mask. The band plan lists exactly
the tiles that meet the band (checked element by element), a method's plan cut to the band keeps its own choices
inside it, the exact tail honours the band, and the pipeline's decision (exact band plan, method inside the band,
dense with the mask) with what ``runtime_stats`` records. Errors are judged against float64, beside what SDPA in
the same precision makes of the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from sparse_compile import SparseConfig, reset_runtime_stats, runtime_stats, sparse_attention
from sparse_compile.kernels import block_sparse_attention
from sparse_compile.local import Local
from sparse_compile.methods import build_plan
from sparse_compile.padding import padding_layout
from sparse_compile.pipeline import attend_causal, attend_site, method_in_band
from sparse_compile.plan import (VISIBLE_FULL, VISIBLE_NONE, BlockPlan, block_visibility, causal_plan,
                                 causal_tile_count, check_plan, execute_plan, local_plan, local_tiles_per_block,
                                 plan_density, plan_from_block_mask, reference_attention, restrict_to_local)
from sparse_compile.registry import method_spec
from sparse_compile.site import SiteSpec

from helpers import BUILT_IN, SMALL, TOL, random_qkv, rel_error


def band_sdpa(q, k, v, local: Local, scale=None, dtype=torch.float64):
    """SDPA with the band as an explicit mask, queries at the last positions, in ``dtype``."""
    nq, nk = q.shape[-2], k.shape[-2]
    mask = local.visible(torch.arange(nk - nq, nk), torch.arange(nk))
    out = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                                           scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out


def assert_exact(out, q, k, v, local: Local, what: str = ""):
    """``out`` within rounding of the band's attention: its float64 error at most a few times that of SDPA in
    ``q``'s precision (and within the kernels' tolerance)."""
    truth = band_sdpa(q, k, v, local)
    same = rel_error(band_sdpa(q, k, v, local, dtype=q.dtype if q.dtype != torch.float16 else torch.float32)
                     .to(q.dtype), truth)
    err = rel_error(out, truth)
    assert err <= max(4 * same, TOL.get(q.dtype, 1e-12)), f"{what}: rel error {err:.2e} (SDPA in {q.dtype}: {same:.2e})"


def tile_truth(nq: int, nk: int, bm: int, bn: int, local: Local):
    """Per (query block, key tile): how many pairs are visible, and whether every pair of the tile is (a tile
    reaching past the keys never is): the element-by-element truth, N x N."""
    seen = local.visible(torch.arange(nk - nq, nk), torch.arange(nk))
    nqb, nkt = -(-nq // bm), -(-nk // bn)
    padded = torch.zeros(nqb * bm, nkt * bn, dtype=torch.bool)
    padded[:nq, :nk] = seen
    blocks = padded.view(nqb, bm, nkt, bn)
    count = blocks.sum((1, 3))
    rows = torch.clamp(torch.arange(nqb) * bm + bm, max=nq) - torch.arange(nqb) * bm
    cols = torch.clamp(torch.arange(nkt) * bn + bn, max=nk) - torch.arange(nkt) * bn
    whole = (count == rows[:, None] * cols[None, :]) & (cols == bn)[None, :]
    return count, whole


def listed(plan: BlockPlan, b: int = 0, h: int = 0):
    """{query block: (masked tiles in order, unmasked tiles in order)} of one (batch, head)."""
    out = {}
    for i in range(plan.num_query_blocks):
        n, m = int(plan.tile_counts[b, h, i]), int(plan.masked_counts[b, h, i])
        tiles = [int(x) // plan.block_n for x in plan.tile_offsets[b, h, i, :n]]
        out[i] = (tiles[:m], tiles[m:])
    return out


# ------------------------------------------------------------------------------------------------- the kernel

KERNEL_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, block, window, chunk, dtype
    (2, 2, 1, 97, 97, 64, 16, 5, 0, torch.float32),  # prime length, window smaller than a tile, GQA, batch 2
    (1, 2, 1, 61, 131, 80, 32, 40, 0, torch.float16),  # chunked prefill, window not a tile multiple, head dim 80
    (1, 2, 2, 113, 113, 64, 16, 0, 24, torch.float32),  # chunks not a tile multiple
    (1, 4, 2, 89, 89, 64, 16, 20, 33, torch.float16),  # window AND chunks
    (1, 2, 1, 45, 45, 64, 16, 1000, 0, torch.float32),  # window past the prompt: plain causal tiles
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"N{c[3]}x{c[4]}-D{c[5]}-W{c[7]}-C{c[8]}-{c[9]}"[:40])
def test_kernel_band_plan_equals_dense_with_the_mask(case):
    B, Hq, Hkv, nq, nk, D, block, window, chunk, dtype = case
    local = Local(window, chunk)
    q, k, v = random_qkv(B, Hq, Hkv, nq, nk, D, dtype=dtype)
    plan = local_plan(B, Hq, nq, nk, block, block, window=window, chunk=chunk)
    check_plan(plan, q, k)
    out, visited = execute_plan(q, k, v, plan, kernel="triton", return_visited=True)
    ref, ref_visited = reference_attention(q, k, v, plan, return_visited=True)
    assert torch.equal(visited, ref_visited) and torch.equal(visited, plan.tile_counts.expand_as(visited))
    assert_exact(out, q, k, v, local, "kernel")
    assert_exact(ref, q, k, v, local, "reference")


def test_kernel_keep_all_plan_with_the_band_in_masked_tiles():
    """A keep-all causal plan whose every tile is masked, the band applied by the kernel's masked tiles alone."""
    q, k, v = random_qkv(1, 2, 1, 70, 70, 64)
    plan = causal_plan(1, 2, 70, 70, 16, 16)
    plan = plan.with_options(masked_counts=plan.tile_counts.clone(), window=9, chunk=30)
    check_plan(plan, q, k)
    assert_exact(execute_plan(q, k, v, plan, kernel="triton"), q, k, v, Local(9, 30), "kernel")
    assert_exact(reference_attention(q, k, v, plan), q, k, v, Local(9, 30), "reference")


@pytest.mark.parametrize("dim", [256, 80])
def test_reference_band_plan_head_dims(dim):
    q, k, v = random_qkv(2, 4, 2, 150, 190, dim)
    for local in (Local(window=37), Local(chunk=48)):
        plan = local_plan(2, 4, 150, 190, 32, 32, window=local.window, chunk=local.chunk)
        assert_exact(execute_plan(q, k, v, plan, kernel="reference"), q, k, v, local, f"D={dim} {local}")


def test_kernel_validates_band_and_hopper_refuses_it():
    q, k, v = random_qkv(1, 1, 1, 16, 16, 16)
    plan = causal_plan(1, 1, 16, 16, 16, 16)
    tables = (plan.tile_offsets, plan.tile_counts, plan.masked_counts)
    with pytest.raises(ValueError, match="window"):
        block_sparse_attention(q, k, v, *tables, block_m=16, block_n=16, window=-1)
    with pytest.raises(ValueError, match="chunk"):
        block_sparse_attention(q, k, v, *tables, block_m=16, block_n=16, chunk=1.5)
    with pytest.raises(ValueError, match="sliding window or chunks"):
        block_sparse_attention(q, k, v, *tables, block_m=16, block_n=16, window=4, backend="hopper")
    with pytest.raises(ValueError, match="BlockPlan.window"):
        plan.with_options(window=-2)
    with pytest.raises(ValueError, match="chunk"):
        local_plan(1, 1, 16, 16, 16, 16, chunk=True)


# --------------------------------------------------------------------------------------------------- the plans

PLAN_SHAPES = [(nq, nk, bm, bn, w, c)
               for nq, nk in ((1, 1), (37, 37), (50, 131), (128, 128), (200, 257))
               for bm, bn in ((16, 16), (32, 16), (16, 64))
               for w, c in ((1, 0), (5, 0), (16, 0), (45, 0), (300, 0), (0, 1), (0, 7), (0, 32), (0, 50),
                            (13, 40), (64, 16))]


def test_band_plan_lists_exactly_the_tiles_that_meet_the_band():
    for nq, nk, bm, bn, w, c in PLAN_SHAPES:
        local = Local(w, c)
        count, whole = tile_truth(nq, nk, bm, bn, local)
        plan = local_plan(1, 1, nq, nk, bm, bn, window=w, chunk=c)
        vis = block_visibility(nq, nk, bm, bn, window=w, chunk=c)[0, 0]
        assert torch.equal(vis != VISIBLE_NONE, count > 0), (nq, nk, bm, bn, w, c)
        assert torch.equal(vis == VISIBLE_FULL, whole), (nq, nk, bm, bn, w, c)
        for i, (masked, unmasked) in listed(plan).items():
            assert sorted(masked + unmasked) == count[i].nonzero().flatten().tolist(), (nq, nk, bm, bn, w, c, i)
            assert sorted(unmasked) == whole[i].nonzero().flatten().tolist(), (nq, nk, bm, bn, w, c, i)
        per_block = local_tiles_per_block(plan.num_query_blocks, nq, nk, bm, bn, w, c)
        assert torch.equal(per_block, (count > 0).sum(1))
        # density: the share of the causal tiles
        density = float(plan_density(plan, nq, nk)[0, 0])
        assert density == pytest.approx(int((count > 0).sum()) / causal_tile_count(nq, nk, bm, bn))
    q, k = torch.zeros(1, 1, 200, 16), torch.zeros(1, 1, 257, 16)
    check_plan(local_plan(1, 1, 200, 257, 16, 16, window=45, chunk=40), q, k)
    # no band: causal_plan's tiles in causal_plan's order
    a, b = local_plan(1, 1, 50, 131, 16, 32), causal_plan(1, 1, 50, 131, 16, 32)
    assert listed(a) == listed(b)


def _random_plan(nq, nk, bm, bn, heads=2, keep=0.5, **indices):
    vis = block_visibility(nq, nk, bm, bn, heads=heads, **indices)
    mask = torch.rand(vis.shape) < keep
    scores = torch.rand(vis.shape)
    return plan_from_block_mask(mask, vis, bm, bn, order_scores=scores, **indices)


def test_restricted_plan_keeps_its_choices_inside_the_band():
    nq, nk, bm, bn = 150, 201, 16, 16
    for local in (Local(window=40), Local(chunk=64), Local(17, 50)):
        plan = _random_plan(nq, nk, bm, bn)
        cut = restrict_to_local(plan, nq, nk, window=local.window, chunk=local.chunk)
        assert (cut.window, cut.chunk) == (local.window, local.chunk)
        count, whole = tile_truth(nq, nk, bm, bn, local)
        q, k, v = random_qkv(1, 2, 2, nq, nk, 16, dtype=torch.float64)
        check_plan(cut, q, k)
        for h in range(2):
            before, after = listed(plan, 0, h), listed(cut, 0, h)
            for i in before:
                kept = [t for t in before[i][0] + before[i][1] if count[i, t] > 0]
                assert sorted(after[i][0] + after[i][1]) == sorted(kept)
                # the plan's own masked tiles first, in its order; its unmasked ones keep their order
                assert after[i][0][:len([t for t in before[i][0] if count[i, t] > 0])] == \
                    [t for t in before[i][0] if count[i, t] > 0]
                assert after[i][1] == [t for t in before[i][1] if whole[i, t]]
        # the same keys as a plan built from the block mask of the band
        vis = block_visibility(nq, nk, bm, bn, heads=2, window=local.window, chunk=local.chunk)
        chosen = torch.zeros(vis.shape, dtype=torch.bool)
        for h in range(2):
            for i, (masked, unmasked) in listed(plan, 0, h).items():
                chosen[0, h, i, masked + unmasked] = True
        direct = plan_from_block_mask(chosen, vis, bm, bn, window=local.window, chunk=local.chunk)
        torch.testing.assert_close(reference_attention(q, k, v, cut), reference_attention(q, k, v, direct),
                                   rtol=1e-12, atol=1e-12)


def test_restricted_keep_all_under_permutations_is_exact():
    """Key and query permutations: tiles of scattered positions, cut by the bounds of their positions."""
    nq = nk = 96
    heads = 2
    key_index = torch.stack([torch.randperm(nk) for _ in range(heads)])[None].to(torch.int32)
    query_index = torch.stack([torch.randperm(nq) for _ in range(heads)])[None].to(torch.int32)
    q, k, v = random_qkv(1, heads, heads, nq, nk, 16)
    for local in (Local(window=20), Local(chunk=32)):
        plan = _random_plan(nq, nk, 16, 16, heads=heads, keep=1.0, key_index=key_index, query_index=query_index)
        cut = restrict_to_local(plan, nq, nk, window=local.window, chunk=local.chunk)
        check_plan(cut, q, k)
        assert int(cut.tile_counts.sum()) <= int(plan.tile_counts.sum())
        assert_exact(reference_attention(q.double(), k.double(), v.double(), cut), q.double(), k.double(), v.double(),
                     local, "reference")
    assert_exact(execute_plan(q, k, v, cut, kernel="triton"), q, k, v, local, "kernel")


def test_method_plan_cut_to_the_band():
    nq = nk = 300
    config = SparseConfig(method="sampled", sampled={"block_size": 16, "sample_every": 4, "budget": 0.2})
    q, k, v = random_qkv(1, 2, 1, nq, nk, 32)
    plan = build_plan(q, k, None, config, implementation="reference")
    local = Local(window=100)
    cut = restrict_to_local(plan, nq, nk, window=100)
    count, _ = tile_truth(nq, nk, 16, 16, local)
    for h in range(2):
        before, after = listed(plan, 0, h), listed(cut, 0, h)
        for i in before:
            assert sorted(after[i][0] + after[i][1]) == sorted(t for t in before[i][0] + before[i][1] if count[i, t])
    check_plan(cut, q, k)
    # the exact tail stays exact in the band
    assert cut.exact_tail == plan.exact_tail > 0
    tail = cut.exact_tail
    out = reference_attention(q, k, v, cut)
    truth = band_sdpa(q, k, v, local)
    assert rel_error(out[:, :, -tail:], truth[:, :, -tail:]) < TOL[torch.float32]
    assert float(cut.density(nq, nk).max()) <= float(plan.density(nq, nk).min()) + 1e-6


def test_exact_tail_on_the_kernel_honours_the_band():
    nq = nk = 80
    q, k, v = random_qkv(1, 2, 1, nq, nk, 16)
    keep_diagonal = torch.eye(5, dtype=torch.bool).expand(1, 2, 5, 5)
    vis = block_visibility(nq, nk, 16, 16, heads=2, window=12)
    plan = plan_from_block_mask(keep_diagonal, vis, 16, 16, exact_tail=20, window=12)
    truth = band_sdpa(q, k, v, Local(window=12))
    for kernel in ("triton", "reference"):
        out, visited = execute_plan(q, k, v, plan, kernel=kernel, return_visited=True)
        assert rel_error(out[:, :, -20:], truth[:, :, -20:]) < TOL[torch.float32], kernel
        assert visited[0, 0, -2:].tolist() == local_tiles_per_block(5, nq, nk, 16, 16, 12)[-2:].tolist()


# ------------------------------------------------------------------------------------------------ the pipeline

def _stats():
    return runtime_stats()["sparse_attention"]


def test_sparse_attention_short_band_runs_exact_band_plan():
    q, k, v = random_qkv(2, 4, 2, 120, 170, 64)
    for window, chunk in ((33, None), (None, 40), (20, 64)):
        reset_runtime_stats()
        local = Local(window or 0, chunk or 0)
        out = sparse_attention(q, k, v, window=window, chunk=chunk, config=SparseConfig(record_density=True))
        assert_exact(out, q, k, v, local, str(local))
        entry = _stats()
        assert entry.last_path == "sparse" and entry.last_reason.startswith(f"exact band: {local.describe()}")
        assert sum(entry.calls.values()) == 1 and sum(entry.rows.values()) == 2
        # the band's share of the causal tiles at its tile size
        plan = local_plan(1, 1, 120, 170, 64, 64, window=local.window, chunk=local.chunk)
        assert entry.last_density_per_head == pytest.approx([float(plan_density(plan, 120, 170)[0, 0])] * 4)
        assert entry.mean_density < 1


def test_sparse_attention_band_on_the_kernel():
    q, k, v = random_qkv(1, 2, 1, 100, 100, 64, dtype=torch.float16)
    reset_runtime_stats()
    out = sparse_attention(q, k, v, window=30, config=SparseConfig(kernel="triton"))
    assert_exact(out, q, k, v, Local(window=30), "triton")
    assert _stats().last_reason == "exact band: sliding window 30 (triton)"


def test_sparse_attention_long_window_runs_the_method_inside():
    q, k, v = random_qkv(1, 2, 1, 256, 256, 32)
    config = SparseConfig(method="sampled", min_seq_len=64, dense_when_faster=False,
                          sampled={"block_size": 16, "sample_every": 4, "budget": 1.0})
    assert method_in_band(Local(window=100), 256, 256, 64) and not method_in_band(Local(window=63), 256, 256, 64)
    assert not method_in_band(Local(chunk=100), 256, 256, 64) and not method_in_band(Local(window=100), 60, 60, 64)
    reset_runtime_stats()
    out = sparse_attention(q, k, v, window=100, config=config)  # budget 1: keep-all inside the band
    assert_exact(out, q, k, v, Local(window=100), "method")
    assert _stats().last_reason == "method sampled (reference) inside the sliding window 100"
    reset_runtime_stats()
    out = sparse_attention(q, k, v, window=40, config=config)
    assert _stats().last_reason.startswith("exact band: sliding window 40")


def test_dense_fallback_applies_the_mask():
    q, k, v = random_qkv(1, 2, 2, 90, 90, 16, dtype=torch.float64)  # float64: the rules send it dense
    reset_runtime_stats()
    out = sparse_attention(q, k, v, chunk=25)
    torch.testing.assert_close(out, band_sdpa(q, k, v, Local(chunk=25)))
    assert _stats().last_path == "dense" and _stats().last_reason.endswith("chunks of 25 as an explicit mask")
    q, k, v = (t.float() for t in (q, k, v))
    reset_runtime_stats()
    out = sparse_attention(q, k, v, window=10, config=SparseConfig(enabled=False))
    assert_exact(out, q, k, v, Local(window=10), "disabled")
    assert _stats().last_reason == "sparsity disabled in this region; sliding window 10 as an explicit mask"
    reset_runtime_stats()  # a window covering every key binds nowhere: plain causal, today's path
    out = sparse_attention(q, k, v, window=90, config=SparseConfig(enabled=False))
    assert _stats().last_reason == "sparsity disabled in this region"
    assert_exact(out, q, k, v, Local(), "causal")


def test_sparse_attention_validates_window_and_chunk():
    q, k, v = random_qkv(1, 1, 1, 8, 8, 16)
    with pytest.raises(ValueError, match="window must be a positive int"):
        sparse_attention(q, k, v, window=0)
    with pytest.raises(TypeError, match="window"):
        sparse_attention(q, k, v, window=True)
    with pytest.raises(TypeError, match="chunk"):
        sparse_attention(q, k, v, chunk=4.0)
    with pytest.raises(ValueError, match="chunk"):
        sparse_attention(q, k, v, chunk=-3)


def _padded_truth(q, k, v, valid: torch.Tensor, local: Local):
    """Per row: positions counted from its first valid key, only valid keys seen; padded query rows zeros."""
    nq, nk = q.shape[-2], k.shape[-2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        first = int(valid[b].nonzero()[0])
        positions = torch.arange(nk) - first
        seen = local.visible(positions[nk - nq:], positions) & valid[b][None, :]
        rows = valid[b, nk - nq:]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1].double(), k[b:b + 1].double(), v[b:b + 1].double(), attn_mask=seen,
            enable_gqa=q.shape[1] != k.shape[1])
        out[b][:, rows] = o[0][:, rows]
    return out


def test_padded_rows_through_the_pipeline():
    B, n = 4, 120
    q, k, v = random_qkv(B, 2, 1, n, n, 32)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, :37] = False  # left padding: a slice, positions from key 37
    valid[2, 100:] = False  # right padding
    valid[3, 50:61] = False  # holes: dense with the mask in raw positions
    layout = padding_layout(valid, n)
    for local in (Local(window=30), Local(chunk=40)):
        reset_runtime_stats()
        out = attend_causal(q, k, v, None, SparseConfig(), "padded", layout, local=local)
        truth = _padded_truth(q, k, v, valid, local)
        assert rel_error(out, truth) < TOL[torch.float32], local
        entry = runtime_stats()["padded"]
        assert sum(entry.calls.values()) == 1
        rows = {path: 0 for path in ("sparse", "dense")}
        for (path, reason), count in entry.rows.items():
            rows[path] += count
            if path == "dense":
                assert "holes" in reason
        assert rows == {"sparse": 3, "dense": 1}


def test_attend_site_reads_the_site_band():
    q, k, v = random_qkv(1, 2, 2, 70, 70, 16)
    reset_runtime_stats()
    site = SiteSpec("banded", SparseConfig(), queries_last=True, window=21)
    out = attend_site(q, k, v, None, site)
    assert_exact(out, q, k, v, Local(window=21), "site")
    assert runtime_stats()["banded"].last_reason.startswith("exact band: sliding window 21")


def test_attend_site_reads_a_runtime_mask_band():
    """A 4-D mask checked at run time: causal AND a sliding window AND left padding (``MaskVerdict.local``)."""
    q, k, v = random_qkv(2, 2, 2, 70, 70, 16)
    mask = Local(window=21).visible(torch.arange(70), torch.arange(70))[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :5] = False
    reset_runtime_stats()
    out = attend_site(q, k, v, None, SiteSpec("checked", SparseConfig(), queries_last=True), runtime_mask=mask)
    truth = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert rel_error(out[0], truth[0]) < TOL[torch.float32]
    assert rel_error(out[1, :, 5:], truth[1, :, 5:]) < TOL[torch.float32]
    (path, reason), = runtime_stats()["checked"].calls
    assert path == "sparse" and reason.startswith("exact band: sliding window 21")


METHOD_KERNELS = [(m, "reference") for m in BUILT_IN] + [("pbs", "triton"), ("s2o", "triton")]


@pytest.mark.parametrize("method,kernel", METHOD_KERNELS)
def test_every_method_at_keep_all_is_exact_inside_the_band(method, kernel):
    """The method's plan cut to a long window (keep-all: every tile it could choose), on key/query permutations
    too (PBS, S2O), through ``sparse_attention``."""
    q, k, v = random_qkv(1, 4, 2, 130, 130, 32)
    params = {**SMALL.get(method, {}), **method_spec(method).keep_all}
    config = SparseConfig(method=method, dense_when_faster=False, kernel=kernel, **{**SMALL, method: params})
    reset_runtime_stats()
    out = sparse_attention(q, k, v, window=40, config=config)
    assert_exact(out, q, k, v, Local(window=40), method)
    assert _stats().last_reason == f"method {method} ({kernel}) inside the sliding window 40"
