"""The sparse methods (sparse_compile.methods): exact at keep-all, valid plans, clear errors, and real sparsity on
structured inputs. Their pieces have files of their own: ``test_methods_pieces.py`` and
``test_methods_sampled_antidiag.py``.
"""

import dataclasses

import pytest
import torch

import sparse_compile.methods.scoring as common
from sparse_compile import SparseConfig
from sparse_compile.methods import Unsupported, build_plan
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.registry import check_stage_pair, valid_pairs
from sparse_compile.plan import causal_tile_count, check_plan, plan_density, reference_attention

from helpers import dense_reference, random_qkv, rel_error
from method_helpers import SMALL, _config, sink_inputs


PAIRS = sorted(valid_pairs())
PRESETS = {"pbs": ("pbs", "pbs"), "sparge": ("none", "sparge"), "bfla": ("none", "bfla"), "s2o": ("s2o", "s2o"),
           "sampled": ("none", "sampled"), "antidiag": ("none", "antidiag"), "peak": ("none", "peak")}
SHAPES = [
    # batch, Hq, Hkv, Nq, Nk, D
    (2, 4, 1, 201, 201, 16),  # GQA 4, ragged
    (1, 4, 4, 300, 300, 16),  # MHA, ragged
    (2, 2, 2, 77, 150, 8),  # chunked prefill
    (1, 2, 1, 9, 9, 8),  # shorter than one block
]


def _pair_id(pair):
    return "+".join(pair)


def _supported(pair, shape):
    return not (pair[0] == "s2o" and shape[3] != shape[4])


def _checked_plan(pair, shape, dtype, scale, keep_all=False):
    """Random q, k, v of ``shape`` and the pair's plan for them (its defaults, or keep-all), checked valid; the
    test is skipped where the pair cannot run the shape."""
    if not _supported(pair, shape):
        pytest.skip("s2o needs Nq == Nk")
    q, k, v = random_qkv(*shape, dtype=dtype)
    config = _config(*pair)
    plan = build_plan(q, k, scale, config.keep_all() if keep_all else config)
    check_plan(plan, q, k)
    return q, k, v, plan


def _computed_fraction(q, k, v, plan):
    """Tiles actually computed (early stop included) over the causal tiles of the identity tiling."""
    _, visited = reference_attention(q, k, v, plan, return_visited=True)
    total = causal_tile_count(q.shape[2], k.shape[2], plan.block_m, plan.block_n) * q.shape[0] * q.shape[1]
    return int(visited.sum()) / total


# ---------------------------------------------------------------------------------------------------------------
# every pair: exact at keep-all, valid by default


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_keep_all_equals_dense(pair, shape):
    q, k, v, plan = _checked_plan(pair, shape, torch.float64, None, keep_all=True)
    Hq = shape[1]
    out, visited = reference_attention(q, k, v, plan, return_visited=True)
    assert rel_error(out, dense_reference(q, k, v)) < 1e-10
    assert bool((visited == expand_heads(plan.tile_counts, Hq)).all())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_defaults_give_valid_plan_and_finite_output(pair, shape):
    q, k, v, plan = _checked_plan(pair, shape, torch.float32, 0.3)
    B, Hq, _, Nq, Nk, _ = shape
    out = reference_attention(q, k, v, plan, scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(torch.isfinite(out).all())
    density = plan_density(plan, Nq, Nk, Hq)
    assert density.shape == (B, Hq) and bool((density > 0).all())


@pytest.mark.parametrize("method", sorted(PRESETS))
def test_paper_defaults(method):
    # the papers' block sizes on a ragged sequence; fp16 inputs (selection runs in fp32)
    q, k, v = random_qkv(1, 4, 2, 300, 300, 32, dtype=torch.float16)
    config = SparseConfig(method=method)
    assert (config.reorder_stage, config.select_stage) == PRESETS[method]
    plan = build_plan(q, k, None, config)
    check_plan(plan, q, k)
    out = reference_attention(q.float(), k.float(), v.float(), plan)
    assert bool(torch.isfinite(out).all())
    exact = reference_attention(q.double(), k.double(), v.double(), build_plan(q, k, None, config.keep_all()))
    assert rel_error(exact, dense_reference(q, k, v)) < 1e-10


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_deterministic(pair):
    q, k, _ = random_qkv(2, 4, 2, 160, 160, 16)
    a = build_plan(q, k, None, _config(*pair))
    b = build_plan(q.clone(), k.clone(), None, _config(*pair))
    for name in ("tile_offsets", "tile_counts", "masked_counts", "key_index", "query_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), name
    assert (a.early_stop, a.pv_skip) == (b.early_stop, b.pv_skip)


def _kv_head_slice(plan, kv_head: int, num_kv_heads: int):
    """The plan of one KV head's GQA group: every per-head table cut to that group's heads (a table has Hq or Hkv
    heads, so the group is its ``heads / num_kv_heads`` consecutive heads)."""
    def cut(table):
        if table is None:
            return None
        per = table.shape[1] // num_kv_heads
        return table[:, kv_head * per:(kv_head + 1) * per]

    return dataclasses.replace(plan, **{name: cut(getattr(plan, name)) for name in (
        "tile_offsets", "tile_counts", "masked_counts", "key_index", "query_index")})


@pytest.mark.parametrize("method", sorted(PRESETS))
def test_one_kv_group_plans_as_its_slice_of_the_whole_plan(method):
    """Plans are per head: a KV head's group planned alone (the op's early-stop re-plan) gets the whole plan's
    slice for that group."""
    q, k, _ = random_qkv(2, 8, 2, 160, 160, 16)
    config = _config(*PRESETS[method])
    whole = build_plan(q, k, None, config)
    for kv_head in range(2):
        part = build_plan(q[:, 4 * kv_head:4 * kv_head + 4], k[:, kv_head:kv_head + 1], None, config)
        expected = _kv_head_slice(whole, kv_head, 2)
        for name in ("tile_offsets", "tile_counts", "masked_counts", "key_index", "query_index"):
            x, y = getattr(part, name), getattr(expected, name)
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y), (method, kv_head, name)


@pytest.mark.parametrize("pair", [p for p in PAIRS if p != ("none", "sparge")], ids=_pair_id)
def test_chunked_intermediates_give_the_same_plan(pair, monkeypatch):
    # the chunk loops (importance, strided scores, group scores, S2O ranking) must not change any result
    q, k, _ = random_qkv(2, 4, 2, 150, 150, 16, dtype=torch.float64)
    ref = build_plan(q, k, None, _config(*pair))
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64)
    got = build_plan(q, k, None, _config(*pair))
    for name in ("tile_offsets", "tile_counts", "masked_counts", "key_index", "query_index"):
        x, y = getattr(ref, name), getattr(got, name)
        assert (x is None and y is None) or torch.equal(x, y), name


def test_plan_options_per_method():
    q, k, _ = random_qkv(1, 2, 1, 64, 64, 8)
    sparge = build_plan(q, k, None, _config("none", "sparge"))
    assert sparge.pv_skip == SMALL["sparge"].pv_threshold and sparge.early_stop == 0.0
    s2o = build_plan(q, k, None, _config("s2o", "s2o"))
    assert s2o.early_stop == SMALL["s2o"].early_stop and s2o.pv_skip is None
    assert build_plan(q, k, None, _config("s2o", "s2o").keep_all()).early_stop == 0.0
    assert build_plan(q, k, None, _config("none", "sparge").keep_all()).pv_skip is None
    bfla = build_plan(q, k, None, _config("none", "bfla"))
    assert bfla.tile_counts.shape[1] == 1  # one tile list per KV head, shared by its GQA group


# ---------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("reorder,select", [("s2o", "pbs"), ("s2o", "bfla"), ("none", "s2o"), ("pbs", "s2o")])
def test_invalid_stage_pairs_raise(reorder, select):
    q, k, _ = random_qkv(1, 2, 2, 64, 64, 8)
    with pytest.raises(ValueError, match="valid pairs.*none\\+pbs.*s2o\\+s2o"):
        build_plan(q, k, None, _config(reorder, select))
    with pytest.raises(ValueError, match="unknown"):
        check_stage_pair("hilbert", "pbs")


def test_unsupported_inputs():
    q, k, _ = random_qkv(1, 2, 2, 32, 64, 8)
    with pytest.raises(Unsupported, match="Nq == Nk") as info:
        build_plan(q, k, None, SparseConfig(method="s2o", s2o=SMALL["s2o"]))
    assert "Nq=32" in info.value.reason
    for method in PRESETS:
        with pytest.raises(Unsupported, match="more queries than keys"):
            build_plan(k, q, None, SparseConfig(method=method))
        with pytest.raises(Unsupported, match="empty"):
            build_plan(q[:, :, :0], k, None, SparseConfig(method=method))
    with pytest.raises(Unsupported, match="floating"):
        build_plan(q.to(torch.int32), k.to(torch.int32), None, SparseConfig())
    with pytest.raises(ValueError, match="multiple"):
        build_plan(q[:, :1], k, None, SparseConfig())


# ---------------------------------------------------------------------------------------------------------------
# structured inputs: the selection must really drop blocks, and keep the mass


def local_inputs(batch, heads_q, heads_kv, n, dim=16, tile=32, seed=0):
    """Tokens of the same ``tile`` share a direction (distinct per tile): attention stays on the diagonal."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(dim, dtype=torch.float64)
    pos = (torch.arange(n) // tile) % dim
    q = 6 * eye[pos] + 0.1 * torch.randn(batch, heads_q, n, dim, generator=g, dtype=torch.float64)
    k = 6 * eye[pos] + 0.1 * torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    return q, k, v


def vertical_inputs(batch, heads_q, heads_kv, n, dim=16, every=16, seed=0):
    """One very strong key ("vertical line") in every ``every`` positions, at a varying offset."""
    g = torch.Generator().manual_seed(seed)
    e0 = torch.zeros(dim, dtype=torch.float64)
    e0[0] = 1.0
    q = 8 * e0 + 0.3 * torch.randn(batch, heads_q, n, dim, generator=g, dtype=torch.float64)
    k = 0.3 * torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    lines = torch.arange(0, n, every) + (torch.arange(0, n, every) * 7 // every) % every
    lines = lines[lines < n]
    k[:, :, lines] += 16 * e0
    v = torch.randn(batch, heads_kv, n, dim, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("kind", ["sink", "local"])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_selection_drops_blocks_on_structured_inputs(pair, kind):
    if pair == ("pbs", "pbs") and kind == "local":
        # by the paper's rule (App. B.1) the on-diagonal segment is masked out of the pooled softmax, so a purely
        # local head renormalises the (tiny, uniform) off-segment mass and keeps ~tau of it. PBS is tested on
        # sinks here and on vertical lines below.
        pytest.skip("PBS keeps ~tau of the off-segment blocks of a purely local head (App. B.1 rule)")
    make = {"sink": sink_inputs, "local": local_inputs}[kind]
    q, k, v = make(2, 4, 2, 256)
    plan = build_plan(q, k, None, _config(*pair))
    check_plan(plan, q, k)
    computed = _computed_fraction(q, k, v, plan)
    full = _computed_fraction(q, k, v, build_plan(q, k, None, _config(*pair).keep_all()))
    out = reference_attention(q, k, v, plan)
    assert computed < 0.6 * full, f"computed {computed:.3f} of the causal tiles, keep-all {full:.3f}"
    assert rel_error(out, dense_reference(q, k, v)) < 0.05


def test_pbs_permutation_beats_mean_pooling_on_vertical_lines():
    q, k, v = vertical_inputs(1, 2, 1, 256)
    permuted = build_plan(q, k, None, _config("pbs", "pbs"))
    baseline = build_plan(q, k, None, _config("none", "pbs"))
    d_perm = float(plan_density(permuted, 256, 256).mean())
    d_base = float(plan_density(baseline, 256, 256).mean())
    assert d_perm < 0.85 * d_base, (d_perm, d_base)
    ref = dense_reference(q, k, v)
    assert rel_error(reference_attention(q, k, v, permuted), ref) < 0.05
    # the permutation put each segment's two line keys at its front
    ki = permuted.key_index[0, 0].long()
    strong = (k[0, 0, :, 0] > 8).nonzero().flatten()
    for seg in range(256 // 32):
        part = ki[seg * 32: seg * 32 + 32]
        n_strong = int(torch.isin(part, strong).sum())
        assert bool(torch.isin(part[:n_strong], strong).all())
