"""bench_selectors.py's one-pass ranking against a brute force (``python -m pytest benchmarks/research``)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def test_selector_bench_max_scores_equal_brute_force():
    """bench_selectors' one-pass ranking: per (block, tile) the max over the block's sampled rows of the tile's best
    causal score minus the row's best score; GQA, chunked prefill, a ragged last tile."""
    from bench_selectors import sampled_max_scores
    from sparse_compile.methods.sampled import sampled_rows

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 70, 8, generator=g), torch.randn(1, 2, 90, 8, generator=g)
    block, every, scale = 16, 4, 0.3
    got = sampled_max_scores(q, k, scale, block, every)
    rows = sampled_rows(70, block, every)
    want = torch.full((1, 4, 5, 6), float("-inf"))
    for h in range(4):
        for r in rows.tolist():
            z = (q[0, h, r] @ k[0, h // 2].T) * scale
            z[r + 20 + 1:] = float("-inf")
            z = z - z.max()
            for t in range(6):
                want[0, h, r // block, t] = torch.maximum(want[0, h, r // block, t], z[t * block:(t + 1) * block].max())
    assert torch.allclose(got, want, atol=1e-5)
