"""Plans size themselves by the prompt where a size parameter is longer than it, with the same plans and outputs.

Reported: on the CPU reference, 32 query heads of dim 128 and a 200-token prompt, S2O with ``segment_size=2**16``
took 2.9 GB extra (the queries of the whole segment were padded and pooled) and BFLA with
``coarse_block_size=2**16`` 1.3 GB (queries and keys padded to the whole coarse block). A segment or coarse block
holding the whole prompt is its only one, so it plans exactly as one of the prompt's length rounded up to the
blocks: ``s2o.planned_segment`` and ``bfla.planned_coarse_block`` say which they run with. Here: plans and outputs
at the largest span equal, bit for bit, those at the prompt's length rounded up, and the extra memory of a plan at
the largest span stays near the prompt's own (a fresh process's peak resident memory).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sparse_compile import SparseConfig, methods
from sparse_compile.methods.bfla import MAX_GROUPS, BFLAParams, planned_coarse_block
from sparse_compile.methods.s2o import S2OParams, planned_segment
from sparse_compile.params import MAX_SPAN

LENGTHS = [7, 200, 257]

pytestmark = pytest.mark.usefixtures("one_thread")




def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _inputs(n, nk=None, heads=4, kv_heads=2, dim=16, zero_rows=False):
    nk = n if nk is None else nk
    q = torch.randn(1, heads, n, dim)
    k = torch.randn(1, kv_heads, nk, dim)
    v = torch.randn(1, kv_heads, nk, dim)
    if zero_rows:  # guide scores of +0 and -0, ties everywhere: the query sort must still agree
        q[:, :, ::3] = 0.0
        q[:, :, 1::5] = -0.0
    return q, k, v


def _plan_and_output(q, k, v, config, planner="reference", kernel="reference"):
    plan = methods.build_plan(q, k, None, config, implementation=planner)
    out, visited = methods.execute(q, k, v, plan, q.shape[-1] ** -0.5, config, kernel=kernel, return_visited=True)
    return plan, out, visited


def _bits(x):
    return x.contiguous().view(-1).view(torch.uint8) if x.is_floating_point() else x


def _assert_same(a, b, what):
    plan_a, out_a, vis_a = a
    plan_b, out_b, vis_b = b
    for name in ("tile_offsets", "tile_counts", "masked_counts", "key_index", "query_index"):
        x, y = getattr(plan_a, name), getattr(plan_b, name)
        assert (x is None) == (y is None), f"{what}: {name}"
        if x is not None:
            assert x.shape == y.shape and torch.equal(x, y), f"{what}: plan.{name} differs"
    assert (plan_a.early_stop, plan_a.block_m, plan_a.block_n) == (plan_b.early_stop, plan_b.block_m, plan_b.block_n)
    assert torch.equal(vis_a, vis_b), f"{what}: visited tiles differ"
    assert out_a.dtype == out_b.dtype and torch.equal(_bits(out_a), _bits(out_b)), f"{what}: outputs differ"


def _both(method, huge, fit, n, nk=None, reorder=None, zero_rows=False, **run):
    q, k, v = _inputs(n, nk, zero_rows=zero_rows)
    extra = {"reorder": reorder, "select": method, "pbs": {"block_size": 16, "segment_size": 32}} if reorder else {}
    at = [_plan_and_output(q, k, v, SparseConfig(method=method, **{method: params}, **extra), **run)
          for params in (huge, fit)]
    _assert_same(*at, f"{method} n={n} {huge} vs {fit}")


# -- 1. bit for bit: the largest span plans as the prompt rounded up (the reference planner) ------------------------
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("early_stop, sort_queries", [(0.005, True), (0.3, True), (0.0, False)])
def test_s2o_at_the_largest_segment_equals_the_prompt_rounded_up(n, early_stop, sort_queries):
    common = dict(block_size_q=16, block_size_kv=32, early_stop=early_stop, sort_queries=sort_queries)
    _both("s2o", dict(common, segment_size=MAX_SPAN), dict(common, segment_size=_round_up(n, 32)), n,
          zero_rows=n % 2 == 1)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("mass_threshold", [0.5, 0.998, 0.0])
def test_bfla_at_the_largest_coarse_block_equals_the_prompt_rounded_up(n, mass_threshold):
    group = MAX_SPAN // MAX_GROUPS  # the smallest group the largest coarse block takes
    common = dict(group_size=group, tile_size_q=16, tile_size_kv=32, local_tiles=1, stride=4,
                  mass_threshold=mass_threshold)
    fit = max(_pow2(n), group)  # coarse blocks are powers of two, of whole groups
    _both("bfla", dict(common, coarse_block_size=MAX_SPAN), dict(common, coarse_block_size=fit), n)


@pytest.mark.parametrize("n, nk, reorder", [(57, 200, None), (200, 200, "pbs"), (257, 257, "pbs")])
def test_bfla_chunked_prefill_and_under_the_pbs_permutation(n, nk, reorder):
    common = dict(group_size=MAX_SPAN // MAX_GROUPS, tile_size_q=16, tile_size_kv=16, local_tiles=0, stride=8,
                  mass_threshold=0.9)
    _both("bfla", dict(common, coarse_block_size=MAX_SPAN), dict(common, coarse_block_size=max(_pow2(nk), 512)), n,
          nk, reorder=reorder)


@pytest.mark.parametrize("n", LENGTHS)
def test_pbs_at_the_largest_segment_equals_a_segment_just_past_the_prompt(n):
    # a PBS segment sorts keys only when whole: one of exactly the prompt's length would sort them all, so the
    # rounded-up segment is the first multiple of the block past the prompt
    common = dict(block_size=16, threshold=0.9)
    _both("pbs", dict(common, segment_size=MAX_SPAN), dict(common, segment_size=_round_up(n + 1, 16)), n)


# -- 2. the fast planner (the Triton interpreter on a CPU) -----------------------------------------------------------
def _fast_available():
    from sparse_compile.methods.fast_path import available

    return available(torch.device("cpu"), torch.float32) is None


@pytest.mark.skipif(not _fast_available(), reason="no Triton (or no GPU and no interpreter)")
def test_the_fast_planner_too():
    """S2O's fast reorder sorts the queries of a segment past ``kernels.sorting.MAX_SEGMENT`` (4096) apart, over the
    planned segment: 8192 takes that path as 2**16 does, in fewer interpreted steps (BFLA's fast selector reads no
    score where it plans a shorter block: nothing to compare)."""
    n = 40
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x.to(dev, torch.float16) for x in _inputs(n, zero_rows=True))
    common = dict(block_size_q=16, block_size_kv=16, early_stop=0.2)
    at = [_plan_and_output(q, k, v, SparseConfig(method="s2o", s2o=dict(common, segment_size=size)), planner="fast")
          for size in (8192, _round_up(n, 16))]
    _assert_same(*at, "fast s2o")


# -- 3. what the plans are laid out with --------------------------------------------------------------------------
def test_the_planned_spans_are_bounded_by_the_prompt_and_never_exceed_the_span_asked_for():
    for n in (1, 7, 16, 100, 200, 256, 257, 4095, 65535, 65536):
        for S in (16, 48, 384, 4096, MAX_SPAN):
            params = S2OParams(segment_size=S, block_size_q=16, block_size_kv=16)
            planned = planned_segment(params, n)
            assert planned == S if S <= n else n <= planned <= min(S, max(_pow2(n), 16))
            assert planned % 16 == 0
        for mass in (0.0, 0.5, 1.0):
            params = BFLAParams(coarse_block_size=MAX_SPAN, group_size=512, mass_threshold=mass)
            planned = planned_coarse_block(params, n, n)
            assert planned == (max(_pow2(n), 512) if mass == 0.5 else MAX_SPAN)
    # chunked prefill: the keys count (Nq < Nk); a prompt longer than the block keeps it
    params = BFLAParams(coarse_block_size=1024, group_size=64, mass_threshold=0.9)
    assert planned_coarse_block(params, 10, 300) == 512
    assert planned_coarse_block(params, 10, 3000) == 1024
    # the reference planner lays S2O's key list out with it
    q, k, _ = _inputs(200)
    config = SparseConfig(method="s2o", s2o={"segment_size": MAX_SPAN})
    reordering = methods.s2o.reorder_s2o(q, k, 0.25, config.params_of("s2o"))
    assert reordering.extras["layout"].segment == 256 and reordering.key_index.shape[-1] == 256


#: the reported case: 32 query heads, 8 KV heads, dim 128, 200 tokens, float32 (Q is 3.3 MB); (method, a span of the
#: prompt's length, the largest span). At the largest spans it took 2789 MiB (S2O) and 1280 MiB (BFLA) more than
#: before the call; now about what the prompt's spans take (20-40 MiB: scores, the output, the reference's blocks)
REPORTED = [("s2o", {"segment_size": 256}, {"segment_size": MAX_SPAN}),
            ("bfla", {"coarse_block_size": 512, "group_size": 512}, {"coarse_block_size": MAX_SPAN, "group_size": 512}),
            ("pbs", {"segment_size": 256}, {"segment_size": MAX_SPAN})]
EXTRA_MB = 200


def _reported_run(q, k, v, method, params):
    config = SparseConfig(method=method, planner="reference", **{method: params})
    plan = methods.build_plan(q, k, None, config)
    methods.execute(q, k, v, plan, q.shape[-1] ** -0.5, config, kernel="reference")


def _status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def _peak_over_mb(run):
    """The peak resident memory ``run()`` takes over what the process holds before it (MiB), from the high-water
    mark /proc resets (Linux >= 4.0); None where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_mb("VmRSS")
        if _status_mb("VmHWM") > before + 1:
            return None
    except (OSError, StopIteration):
        return None
    run()
    return _status_mb("VmHWM") - before


_PEAKS = textwrap.dedent("""
    import json, resource, sys
    import torch
    from test_plan_sizes import REPORTED, _reported_run

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 32, 200, 128), torch.randn(1, 8, 200, 128), torch.randn(1, 8, 200, 128)
    for method, small, _ in REPORTED:  # libraries loaded, caches filled
        _reported_run(q, k, v, method, small)
    extra = {}
    for method, _, largest in REPORTED:  # the peak only grows: an earlier method's can hide a later one's, not fail it
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        _reported_run(q, k, v, method, largest)
        extra[method] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps(extra))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory read from /proc (Linux)")
def test_a_short_prompt_at_the_largest_spans_allocates_for_the_prompt_not_the_span():
    q, k, v = torch.randn(1, 32, 200, 128), torch.randn(1, 8, 200, 128), torch.randn(1, 8, 200, 128)
    extra_mb = {}
    for method, small, largest in REPORTED:
        _reported_run(q, k, v, method, small)  # lazily built state (thread pools, caches) counts for neither
        extra_mb[method] = _peak_over_mb(lambda: _reported_run(q, k, v, method, largest))
    if None in extra_mb.values():  # no resettable high-water mark: a fresh process's peak (ru_maxrss, KiB)
        tests = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, "-c", _PEAKS], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        extra_mb = json.loads(done.stdout.strip().splitlines()[-1])
    for method, mb in extra_mb.items():
        assert mb < EXTRA_MB, f"{method} at the largest span: {mb:.0f} MiB over the memory before the call"
