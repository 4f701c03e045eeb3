"""Real weights through what users run: SmolLM2-135M-Instruct (``tests/real_model.py``) compiled whole with
``backend="sparse_prefill"`` (the registered backend, Inductor for the rest) on 1,024 tokens of standard-library
source, small blocks and ``min_seq_len`` lowered so that every call goes sparse. One compile, three forwards
switched by ``sparsity(...)`` regions: dense, the keep-everything setting, the default method at its default
density."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import real_model
import sparse_compile
from sparse_compile.registry import method_spec

pytestmark = pytest.mark.slow

LENGTH = 1024
SCORED = 512  # the loss is the mean over the last SCORED tokens
NLL_BOUND = 0.05  # nats/token; measured +0.0... at these settings (float32, CPU)


def small_blocks(method: str) -> dict:
    """``method``'s tiling at 32-token blocks: 32 query blocks at 1,024 tokens, so plans have room to be sparse."""
    sizes = {"block_size": 32, "block_size_q": 32, "block_size_kv": 32, "tile_size_q": 32, "tile_size_kv": 32,
             "segment_size": 64, "coarse_block_size": 64, "group_size": 16, "sample_every": 4}
    params = dataclasses.asdict(sparse_compile.SparseConfig().params_of(method))
    return {name: value for name, value in sizes.items() if name in params}


@pytest.fixture(scope="module")
def runs():
    model, tokenizer = real_model.load_or_skip()
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :LENGTH]
    assert ids.shape[1] == LENGTH
    method = sparse_compile.SparseConfig().method
    config = sparse_compile.SparseConfig(method=method, min_seq_len=LENGTH // 2, dense_when_faster=False,
                                         record_density=True, **{method: small_blocks(method)}).keep_all()
    compiled = torch.compile(model, backend="sparse_prefill", options=config)
    knob = method_spec(method).density.name
    default = getattr(sparse_compile.SparseConfig().params_of(method), knob)
    out = {"ids": ids, "method": method}
    for name, region in (("dense", {"enabled": False}), ("keep_all", {}), ("sparse", {knob: default})):
        sparse_compile.reset_runtime_stats()
        with torch.no_grad(), sparse_compile.sparsity(**region):
            out[name] = compiled(ids, logits_to_keep=SCORED + 1, use_cache=False).logits.float()
        out[name + "_stats"] = sparse_compile.runtime_stats()
    return out


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[0, :-1], ids[0, -SCORED:]))


def sparse_calls(stats: dict) -> dict:
    return {site: sum(n for (path, _), n in entry.calls.items() if path == "sparse") for site, entry in stats.items()}


def test_keep_all_runs_every_site_sparse_and_equals_dense(runs):
    stats = runs["keep_all_stats"]
    assert len(stats) == 30  # one site per decoder layer
    assert all(n == 1 for n in sparse_calls(stats).values()), {s: dict(e.calls) for s, e in stats.items()}
    assert all(not entry.plain_sdpa for entry in stats.values())
    assert all(n == 0 for n in sparse_calls(runs["dense_stats"]).values())
    torch.testing.assert_close(runs["keep_all"], runs["dense"], rtol=1e-4, atol=1e-3)
    assert abs(nll(runs["keep_all"], runs["ids"]) - nll(runs["dense"], runs["ids"])) < 1e-4


def test_default_method_stays_close_to_dense_at_a_sparse_setting(runs):
    stats = runs["sparse_stats"]
    assert all(n == 1 for n in sparse_calls(stats).values()), {s: dict(e.calls) for s, e in stats.items()}
    densities = [entry.mean_density for entry in stats.values()]
    assert all(d is not None for d in densities)
    mean_density = sum(densities) / len(densities)
    assert mean_density < 0.8, f"{runs['method']} kept {mean_density:.3f} of the tiles: not a sparse setting"
    dense, sparse = nll(runs["dense"], runs["ids"]), nll(runs["sparse"], runs["ids"])
    assert sparse - dense <= NLL_BOUND, (f"{runs['method']} at density {mean_density:.3f}: NLL {sparse:.4f} "
                                         f"against dense {dense:.4f}")
