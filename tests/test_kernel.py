"""The Triton block-sparse attention core against ``reference_attention`` and dense attention.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1): small shapes, fp32/fp16 only
(bf16 ``tl.dot`` is wrong in the interpreter). Early stop and P.V skip, non-finite inputs, the GPU (bf16 at 8K+)
and the Hopper kernel have files of their own (``test_kernel_*.py``).
Every test draws fresh random inputs (conftest seeds per test); errors are measured in float64 terms.
"""

import math

import pytest
import torch

from sparse_compile.kernels import KernelConfig, block_sparse_attention
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.plan import BlockPlan, block_visibility, causal_plan, check_plan, execute_plan, plan_from_block_mask

from helpers import (
    DEV,
    _assert_close,
    _kernel,
    _perm,
    _ref,
    _segment_permutation,
    _sink_qkv,
    dense_reference,
    random_qkv,
    rel_error,
)


def _assert_matches_reference(q, k, v, plan, dtype, what="vs reference", **options):
    """The kernel on ``plan`` against the float64 reference of the same plan: the output within ``dtype``'s
    tolerance, the tiles visited exactly. Returns the kernel's output."""
    out, visited = _kernel(q, k, v, plan, return_visited=True, **options)
    ref, ref_visited = _ref(q, k, v, plan)
    _assert_close(out, ref, dtype, what)
    assert torch.equal(visited, ref_visited)
    return out


# ------------------------------------------------------------------------------------------------- dense plans

DENSE_SHAPES = [
    # batch, Hq, Hkv, Nq, Nk, D, block_m, block_n, dtype
    (2, 4, 4, 77, 77, 64, 16, 16, torch.float32),  # GQA 1, batch 2, ragged last blocks
    (1, 8, 2, 50, 130, 32, 32, 16, torch.float32),  # GQA 4, q_len < kv_len (chunked prefill)
    (2, 8, 1, 45, 45, 128, 16, 32, torch.float16),  # GQA 8, D 128, fp16
    (1, 4, 1, 33, 70, 64, 32, 32, torch.float16),
    (1, 2, 1, 20, 20, 48, 16, 16, torch.float32),  # head dim padded on chip
    (1, 2, 2, 5, 5, 16, 16, 32, torch.float32),  # shorter than one block
]


@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=lambda s: "x".join(str(x) for x in s[:8]) + f"-{s[8]}"[6:])
def test_causal_plan_equals_dense_and_reference(shape):
    B, Hq, Hkv, Nq, Nk, D, bm, bn, dtype = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device=DEV)
    plan = causal_plan(B, Hq, Nq, Nk, bm, bn, device=DEV)
    out = _assert_matches_reference(q, k, v, plan, dtype)
    assert out.dtype == dtype and out.shape == q.shape
    _assert_close(out, dense_reference(q, k, v), dtype, "vs dense")


def test_plan_with_kv_heads_and_custom_scale():
    B, Hq, Hkv, N, D = 2, 8, 2, 70, 32
    q, k, v = random_qkv(B, Hq, Hkv, N, N, D, device=DEV)
    plan = causal_plan(B, Hkv, N, N, 16, 16, device=DEV)  # plan tensors with Hkv heads: shared by the group
    out = _kernel(q, k, v, plan, scale=0.3)
    _assert_close(out, dense_reference(q, k, v, scale=0.3), torch.float32)


def test_subtile_and_split_configs_equal_dense():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 90, 100, 32
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, device=DEV)
    plan = causal_plan(B, Hq, Nq, Nk, 32, 32, device=DEV)
    ref = dense_reference(q, k, v)
    for cfg in (KernelConfig(16, 16), KernelConfig(32, 16), KernelConfig(16, 32),
                KernelConfig(32, 32, num_stages=3, masked_stages=1)):
        out, visited = _kernel(q, k, v, plan, config=cfg, return_visited=True)
        _assert_close(out, ref, torch.float32, str(cfg))
        assert torch.equal(visited, plan.tile_counts)


# ------------------------------------------------------------------------------------------ permuted rows


@pytest.mark.parametrize(
    "kheads,qheads,mode",
    [("kv", None, "gather"), ("kv", None, "copy"), ("q", None, "auto"), (None, "q", "auto"), ("kv", "kv", "auto"),
     ("q", "q", "gather")],
)
def test_permuted_keys_and_queries_equal_dense(kheads, qheads, mode):
    B, Hq, Hkv, Nq, Nk, D, bm, bn = 2, 4, 2, 61, 77, 32, 16, 16
    dtype = torch.float16 if mode == "copy" else torch.float32
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, device=DEV)
    heads = {"kv": Hkv, "q": Hq, None: None}
    ki = _perm(B, heads[kheads], Nk) if kheads else None
    qi = _perm(B, heads[qheads], Nq) if qheads else None
    vis = block_visibility(Nq, Nk, bm, bn, key_index=ki, query_index=qi)
    plan = plan_from_block_mask(torch.ones_like(vis, dtype=torch.bool), vis, bm, bn, key_index=ki, query_index=qi)
    check_plan(plan, q, k)
    out = _assert_matches_reference(q, k, v, plan, dtype, key_mode=mode)
    _assert_close(out, dense_reference(q, k, v), dtype, "vs dense")


def test_key_index_with_padding_and_longer_than_keys():
    """Negative entries and a key_index longer than Nk are padding: masked, never read."""
    B, H, N, D, bn = 1, 2, 40, 16, 16
    q, k, v = random_qkv(B, H, H, N, N, D, device=DEV)
    ki = torch.full((B, H, 64), -1, dtype=torch.int32, device=DEV)
    ki[..., 8:48] = _perm(B, H, N)  # real keys in the middle, padding around
    vis = block_visibility(N, N, 16, bn, key_index=ki)
    plan = plan_from_block_mask(torch.ones_like(vis, dtype=torch.bool), vis, 16, bn, key_index=ki)
    check_plan(plan, q, k)
    for mode in ("gather", "copy"):
        out = _kernel(q, k, v, plan, key_mode=mode)
        _assert_close(out, dense_reference(q, k, v), torch.float32, mode)


# ------------------------------------------------------------------------------------------- sparse plans


@pytest.mark.parametrize("plan_heads", ["q", "kv"])
@pytest.mark.parametrize("ordered", [False, True])
def test_random_sparse_blocks_match_reference(plan_heads, ordered):
    B, Hq, Hkv, Nq, Nk, D, bm, bn = 2, 8, 2, 100, 100, 64, 16, 32
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, device=DEV)
    H = Hq if plan_heads == "q" else Hkv
    vis = block_visibility(Nq, Nk, bm, bn, batch=B, heads=H, device=DEV)
    keep = torch.rand(vis.shape, device=DEV) < 0.5
    scores = torch.rand(vis.shape, device=DEV) if ordered else None
    plan = plan_from_block_mask(keep, vis, bm, bn, order_scores=scores)
    out = _assert_matches_reference(q, k, v, plan, torch.float32, "", check=True)
    assert rel_error(out, dense_reference(q, k, v)) > 1e-3  # dropping tiles must matter


def test_sparse_permuted_gqa8_fp16_chunked():
    B, Hq, Hkv, Nq, Nk, D, bm, bn = 1, 8, 1, 64, 96, 128, 32, 16
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float16, device=DEV)
    ki, qi = _perm(B, Hkv, Nk), _perm(B, Hq, Nq)
    vis = expand_heads(block_visibility(Nq, Nk, bm, bn, key_index=ki, query_index=qi), Hq)
    keep = torch.rand(vis.shape, device=DEV) < 0.6
    plan = plan_from_block_mask(keep, vis, bm, bn, key_index=ki, query_index=qi)
    for mode in ("gather", "copy"):
        _assert_matches_reference(q, k, v, plan, torch.float16, mode, key_mode=mode)


def test_unaligned_overlapping_masked_tiles_match_reference():
    """Offsets need not be multiples of block_n, and tiles may overlap: masked tiles follow the plan literally."""
    B, Hq, Hkv, Nq, Nk, D, bm, bn, T = 1, 4, 2, 40, 57, 32, 16, 16, 5
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, device=DEV)
    nqb = -(-Nq // bm)
    offsets = torch.randint(0, Nk, (B, Hq, nqb, T), dtype=torch.int32, device=DEV)
    counts = torch.randint(1, T + 1, (B, Hq, nqb), dtype=torch.int32, device=DEV)
    plan = BlockPlan(bm, bn, offsets, counts, counts.clone())  # every tile masked: no visibility promise
    check_plan(plan, q, k)
    _assert_matches_reference(q, k, v, plan, torch.float32, "")


def test_empty_tile_lists_give_zeros():
    B, H, N, D = 1, 2, 48, 16
    q, k, v = random_qkv(B, H, H, N, N, D, device=DEV)
    vis = block_visibility(N, N, 16, 16, batch=B, heads=H, device=DEV)
    keep = torch.ones_like(vis, dtype=torch.bool)
    keep[:, 1, 1] = False  # head 1, query block 1: nothing
    plan = plan_from_block_mask(keep, vis, 16, 16)
    out = _kernel(q, k, v, plan)
    assert torch.equal(out[:, 1, 16:32], torch.zeros_like(out[:, 1, 16:32]))
    _assert_close(out, _ref(q, k, v, plan)[0], torch.float32)


# ------------------------------------------------------------------------ two passes over one softmax


def test_first_pass_writes_each_rows_log2_sum_exp2():
    """``lse=``: each row's log2-sum-exp2 of its scaled, visible scores; -inf for a row that saw no key."""
    B, Hq, Hkv, N, D, b = 2, 4, 2, 70, 32, 16
    q, k, v = random_qkv(B, Hq, Hkv, N, N, D, device=DEV)
    plan = causal_plan(B, Hq, N, N, b, b, device=DEV)
    plan = plan.with_options(tile_counts=plan.tile_counts.index_fill(2, torch.tensor([2], device=DEV), 0))
    lse = torch.full((B, Hq, N), 7.0, device=DEV)
    out = _kernel(q, k, v, plan, scale=0.3, lse=lse)
    kk = k.double().repeat_interleave(Hq // Hkv, 1)
    s = (q.double() @ kk.transpose(-1, -2) * 0.3).masked_fill(torch.ones(N, N, dtype=torch.bool, device=DEV).triu(1),
                                                            float("-inf"))
    want = torch.logsumexp(s, -1) / math.log(2)
    empty = torch.zeros(N, dtype=torch.bool, device=DEV)
    empty[2 * b:3 * b] = True  # query block 2 lists no tile
    want[:, :, empty] = float("-inf")
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))


# each option alone once (the interpreter makes every case cost ~15 s on 2 cores)
@pytest.mark.parametrize("early_stop, permuted", [(0.0, False), (0.05, True)], ids=["in-order", "early-stop-permuted"])
def test_two_passes_over_one_softmax_equal_one_pass(permuted, early_stop):
    """S2O's window pass: the masked tiles alone, writing ``lse``; then ``skip_masked`` + ``resume``, the unmasked
    tiles from that state. The same output and early-stop decisions as one pass over the whole list; the second
    pass counts its own tiles. Rows whose first pass saw nothing (lse = -inf) resume from an empty state."""
    B, Hq, Hkv, N, D, b = 2, 4, 2, 100, 32, 16
    q, k, v = _sink_qkv(B, Hq, Hkv, N, N, D, torch.float32)
    # queries permuted inside segments of 32 (as S2O's): tiles of earlier segments stay fully visible
    qi = _segment_permutation(B, Hq, N, seg=32, device=DEV) if permuted else None
    vis = expand_heads(block_visibility(N, N, b, b, query_index=qi, batch=B, heads=Hq, device=DEV), Hq)
    keep = torch.rand(vis.shape, device=DEV) < 0.7
    keep[:, 0, 3, 2:4] = False  # block 3 (rows 48-63) keeps none of its own segment's tiles: no first pass
    plan = plan_from_block_mask(keep, vis, b, b, query_index=qi, early_stop=early_stop)
    masked = torch.minimum(plan.masked_counts, plan.tile_counts)
    assert bool((masked == 0).any()) and bool((masked > 0).any())  # both kinds of first pass
    one, one_visited = _kernel(q, k, v, plan, return_visited=True)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=DEV)
    out = _kernel(q, k, v, plan.with_options(tile_counts=masked, early_stop=0.0), lse=lse)
    two, two_visited = _kernel(q, k, v, plan, return_visited=True, out=out, lse=lse, resume=True, skip_masked=True)
    assert two.data_ptr() == out.data_ptr()  # resumed in place
    _assert_close(two, one, torch.float32)
    assert torch.equal(two_visited + masked, one_visited)


def test_two_pass_arguments_are_checked():
    B, H, N, D = 1, 2, 32, 16
    q, k, v = random_qkv(B, H, H, N, N, D, device=DEV)
    plan = causal_plan(B, H, N, N, 16, 16, device=DEV)
    lse = torch.zeros(B, H, N, device=DEV)
    with pytest.raises(ValueError, match="resume=True .* needs that pass's out and lse"):
        _kernel(q, k, v, plan, lse=lse, resume=True)
    with pytest.raises(ValueError, match="lse must be a float32 tensor of shape"):
        _kernel(q, k, v, plan, lse=lse.double())
    with pytest.raises(ValueError, match="out must be a"):
        _kernel(q, k, v, plan, out=q[:, :, :8])
    with pytest.raises(ValueError, match="reference runs a plan in one pass"):
        execute_plan(q, k, v, plan, kernel="reference", lse=lse)


# ---------------------------------------------------------------------------------------------- bad inputs


def _good(B=1, Hq=4, Hkv=2, N=32, D=16, dtype=torch.float32):
    q, k, v = random_qkv(B, Hq, Hkv, N, N, D, dtype=dtype, device=DEV)
    return q, k, v, causal_plan(B, Hq, N, N, 16, 16, device=DEV)


def test_invalid_inputs_raise_clear_errors():
    q, k, v, plan = _good()
    bad = [
        ((q.double(), k.double(), v.double(), plan), "dtype"),
        ((q, k.half(), v.half(), plan), "share a dtype"),
        ((q[0], k, v, plan), "4-D"),
        ((q, k.to("meta"), v, plan), "one device"),
        ((q, k[:, :, :16], v[:, :, :16], plan), "q_len"),
        ((q, k, v[..., :8], plan), "shapes differ"),
        ((q[..., :8], k, v, plan), "head dims differ"),
        ((q, k[:, :1].expand(1, 3, 32, 16), v[:, :1].expand(1, 3, 32, 16), plan), "multiple"),
        ((q, k, v, "plan"), "BlockPlan"),
        ((q, k, v, plan.with_options(tile_counts=plan.tile_counts.long())), "int32"),
        ((q, k, v, plan.with_options(block_m=24)), "power of two"),
        ((q, k, v, plan.with_options(block_m=32)), "query blocks"),
        ((q, k, v, plan.with_options(tile_offsets=plan.tile_offsets[:, :3])), "tile_offsets"),
        ((q, k, v, plan.with_options(masked_counts=plan.masked_counts[..., :1])), "masked_counts"),
        ((q, k, v, plan.with_options(key_index=torch.zeros(1, 3, 32, dtype=torch.int32, device=DEV))), "key_index"),
        ((q, k, v, plan.with_options(key_index=torch.zeros(1, 2, 32, device=DEV))), "key_index"),
        ((q, k, v, plan.with_options(query_index=torch.zeros(1, 4, 31, dtype=torch.int32, device=DEV))),
         "query_index"),
        ((q, k, v, plan.with_options(pv_skip=0.5)), "pv_skip"),
        ((q, k, v, plan.with_options(early_stop=-1.0)), "early_stop"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            _kernel(*args)
    with pytest.raises(ValueError, match="scale"):
        _kernel(q, k, v, plan, scale=-1.0)
    with pytest.raises(ValueError, match="key_mode"):
        _kernel(q, k, v, plan, key_mode="fast")
    with pytest.raises(ValueError, match="config.block_m"):
        _kernel(q, k, v, plan, config=KernelConfig(48, 16))
    with pytest.raises(ValueError, match="config.block_n"):
        _kernel(q, k, v, plan, config=KernelConfig(16, 32))
    plan32 = causal_plan(1, 4, 32, 32, 32, 32, device=DEV).with_options(early_stop=0.1)
    with pytest.raises(ValueError, match="per table tile"):
        _kernel(q, k, v, plan32, config=KernelConfig(16, 16))
    ki = _perm(1, 4, 32)  # Hq heads: no per-KV-head copy possible
    with pytest.raises(ValueError, match="copy"):
        _kernel(q, k, v, plan.with_options(key_index=ki), key_mode="copy")


def test_check_flag_runs_check_plan():
    q, k, v, plan = _good()
    broken = plan.with_options(masked_counts=torch.zeros_like(plan.masked_counts))
    with pytest.raises(ValueError, match="not fully visible"):
        _kernel(q, k, v, broken, check=True)


def test_empty_query_is_refused_like_everywhere():
    # one validator for every door (kernels.validate): q_len 0 is an error, not an empty launch
    q, k, v = random_qkv(1, 2, 1, 0, 8, 16, device=DEV)
    plan = causal_plan(1, 2, 0, 8, 16, 16, device=DEV)
    with pytest.raises(ValueError, match="q_len"):
        _kernel(q, k, v, plan, return_visited=True)


def test_plain_tensor_signature():
    """The kernel takes tables and numbers (no plan class): the same as through execute_plan."""
    B, Hq, Hkv, N, D = 1, 4, 2, 40, 16
    q, k, v = random_qkv(B, Hq, Hkv, N, N, D, device=DEV)
    plan = causal_plan(B, Hq, N, N, 16, 16, device=DEV).with_options(early_stop=1e-30)
    out, visited = block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts,
                                          block_m=16, block_n=16, scale=0.3, early_stop=1e-30, return_visited=True)
    _assert_close(out, dense_reference(q, k, v, scale=0.3), torch.float32)
    assert torch.equal(visited, plan.tile_counts)
    via_plan, via_plan_visited = _kernel(q, k, v, plan, 0.3, return_visited=True)
    assert torch.equal(via_plan, out) and torch.equal(via_plan_visited, visited)
    with pytest.raises(ValueError, match="tile_counts"):
        block_sparse_attention(q, k, v, plan.tile_offsets, None, plan.masked_counts, block_m=16, block_n=16)


def test_kernel_options_tune_the_kernel_and_keep_its_result():
    """``SparseConfig(kernel_options=...)`` reaches the kernel's launch (an invalid one is refused there too) and
    changes nothing computed."""
    import sparse_compile
    from sparse_compile import SparseConfig

    q, k, v = random_qkv(1, 2, 1, 80, 80, 16, dtype=torch.float32)
    base = SparseConfig(method="pbs", min_seq_len=16, kernel="triton", dense_when_faster=False,
                        pbs={"block_size": 16, "segment_size": 32}).keep_all()
    tuned = base.replace(kernel_options={"num_warps": 2, "num_stages": 2})
    torch.testing.assert_close(sparse_compile.sparse_attention(q, k, v, config=tuned),
                               sparse_compile.sparse_attention(q, k, v, config=base), rtol=0, atol=0)
    plan = causal_plan(1, 2, 80, 80, 16, 16)
    with pytest.raises(ValueError, match="options\\['num_warps'\\]"):
        block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts, block_m=16,
                               block_n=16, options={"num_warps": 5})
