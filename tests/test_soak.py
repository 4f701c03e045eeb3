"""A day in a server, small: 10,000 calls of one compiled model over hundreds of lengths and batch sizes, methods and
densities switching by region. Every cache the package keeps stays within its bound, the process's memory stays
flat after warm-up, and nothing recompiles after each shape bucket's first call."""

import gc
import os
import random

import pytest
import torch

import sparse_compile
from helpers import SMALL_PBS
from state_bounds import cache_sizes

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

CALLS = 10_000
SPARSE_FROM = 64  # min_seq_len inside the sparse regions: the longer prompts run sparse
# regions switch every REGION_CALLS calls: dense, each method at two densities, and one whose min_seq_len leaves
# every prompt dense, each short length with its own reason (the per-site reason cap is reached)
REGION_CALLS = 250
REGIONS = (
    dict(enabled=False),
    dict(method="pbs", min_seq_len=SPARSE_FROM, threshold=0.5),
    dict(method="sparge", min_seq_len=SPARSE_FROM, cdf_threshold=0.9),
    dict(min_seq_len=4096),
    dict(method="pbs", min_seq_len=SPARSE_FROM, threshold=0.9),
    dict(method="sparge", min_seq_len=SPARSE_FROM, cdf_threshold=0.5),
)
OPTIONS = dict(SMALL_PBS, kernel="reference", planner="reference",
               sparge={"block_size_q": 16, "block_size_kv": 16})


def tiny_model():
    """One layer, 2 query heads over 1 key/value head of dim 16: the pipeline's cost, not the model's."""
    from models import ModelArgs, Transformer

    return Transformer(ModelArgs(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                 intermediate_size=32)).eval()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second intra-op thread only adds waiting
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_ten_thousand_calls_keep_every_cache_bounded_memory_flat_and_no_recompile(one_thread):
    from torch._dynamo.utils import counters

    model = tiny_model()
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS, dynamic=True)
    rng = random.Random(0)
    # mostly short prompts (dense, cheap), one in ten long enough to run sparse in a sparse region
    shapes = [(rng.randint(1, 4), rng.randint(SPARSE_FROM, 90) if rng.random() < 0.1
               else rng.randint(2, SPARSE_FROM - 1)) for _ in range(CALLS)]
    assert len(set(shapes)) >= 300
    buckets_seen, expected_sparse, warm_rss = set(), 0, None
    regions = [sparse_compile.sparsity(**region) for region in REGIONS]
    with torch.no_grad():
        for i, (batch, length) in enumerate(shapes):
            region = REGIONS[(i // REGION_CALLS) % len(REGIONS)]
            graphs = counters["stats"]["unique_graphs"]
            with regions[(i // REGION_CALLS) % len(REGIONS)]:
                compiled(torch.randint(0, 32, (batch, length)))
            bucket = batch == 1  # dynamic shapes: Dynamo specialises sizes of 1 only (lengths here are >= 2)
            if counters["stats"]["unique_graphs"] != graphs:
                assert bucket not in buckets_seen, f"call {i} (batch {batch}, length {length}) recompiled"
            buckets_seen.add(bucket)
            expected_sparse += region.get("min_seq_len") == SPARSE_FROM and length >= SPARSE_FROM
            if i == 2000:
                gc.collect()
                warm_rss = rss_bytes()
    gc.collect()
    grown = rss_bytes() - warm_rss
    assert grown < 8 << 20, f"resident memory grew {grown / 2**20:.1f} MiB over the last {CALLS - 2000} calls"

    (site, entry), = sparse_compile.runtime_stats().items()
    sparse = sum(n for (path, _), n in entry.calls.items() if path == "sparse")
    assert sum(entry.calls.values()) == CALLS and sparse == expected_sparse > 400
    assert {reason.split(" (")[0] for (path, reason), n in entry.calls.items() if path == "sparse"} == {
        "method pbs", "method sparge"}
    assert any(reason == sparse_compile.report.OTHER_REASONS for _, reason in entry.calls)
    for name, (size, bound) in cache_sizes().items():
        assert size <= bound, f"{name}: {size} entries, bound {bound}"


def test_density_history_keeps_its_most_recent_entries_within_its_bound():
    from sparse_compile.breakeven import DensityHistory
    from sparse_compile.config import SparseConfig

    history = DensityHistory(max_entries=4, max_configs=2)
    configs = [SparseConfig(pbs={"threshold": t}) for t in (0.1, 0.2, 0.3)]
    for i in range(10):
        history.record(("site", i), torch.tensor(0.5), "16x16", configs[i % 3])
    assert len(history) == 4 and history.configs_held() == 2
    assert history.prediction(("site", 9)) == (0.5, "16x16") and history.prediction(("site", 5)) is None
    assert history.shape_of(configs[0]) == "16x16" and history.shape_of(configs[1]) is None  # 9 % 3 == 0, 8 % 3 == 2
    with pytest.raises(ValueError, match="max_entries"):
        DensityHistory(max_entries=0)
