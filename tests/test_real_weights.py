"""Real weights through what users run: SmolLM2-135M-Instruct (``tests/real_model.py``) compiled whole with
``backend="sparse_prefill"`` (the registered backend, Inductor for the rest) on 1,024 tokens of standard-library
source, 32-token blocks and ``min_seq_len`` lowered so that every call goes sparse. One compile, three forwards
switched by ``sparsity(...)`` regions: dense, the keep-everything setting (``SparseConfig(...).keep_all()``, the
compiled configuration), the default method at a sparse setting.

One test, not several: under ``pytest -n 2`` tests of one module may land on both workers, and each would load and
compile the model."""

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
# sampled at budget 0.2 (density 0.34 at these blocks): Δ NLL +0.009 nats/token (float32, CPU, torch 2.13,
# transformers 5.24); budget 0.1 (density 0.24) gave +0.079
SPARSE_SHARE = 0.2
NLL_BOUND = 0.05


def small_blocks(method: str) -> dict:
    """``method``'s tiling at 32-token blocks: 32 query blocks at 1,024 tokens, so plans have room to be sparse."""
    sizes = {"block_size": 32, "block_size_q": 32, "block_size_kv": 32, "tile_size_q": 32, "tile_size_kv": 32,
             "segment_size": 64, "coarse_block_size": 64, "group_size": 16, "sample_every": 4}
    params = dataclasses.asdict(sparse_compile.SparseConfig().params_of(method))
    return {name: value for name, value in sizes.items() if name in params}


def sparse_setting(method: str) -> dict:
    """The method's defaults, with a share-of-tiles knob (``budget``) at SPARSE_SHARE."""
    knob = method_spec(method).density.name
    default = getattr(sparse_compile.SparseConfig().params_of(method), knob)
    return {knob: SPARSE_SHARE if knob == "budget" else default}


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[0, :-1], ids[0, -SCORED:]))


def sparse_calls(stats: dict) -> dict:
    return {site: sum(n for (path, _), n in entry.calls.items() if path == "sparse") for site, entry in stats.items()}


def test_real_model_keep_all_equals_dense_and_default_method_stays_close():
    model, tokenizer = real_model.load_or_skip()
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :LENGTH]
    assert ids.shape[1] == LENGTH
    method = sparse_compile.SparseConfig().method
    config = sparse_compile.SparseConfig(method=method, min_seq_len=LENGTH // 2, dense_when_faster=False,
                                         record_density=True, **{method: small_blocks(method)}).keep_all()
    compiled = torch.compile(model, backend="sparse_prefill", options=config)
    logits, stats = {}, {}
    for name, region in (("dense", {"enabled": False}), ("keep_all", {}), ("sparse", sparse_setting(method))):
        sparse_compile.reset_runtime_stats()
        with torch.no_grad(), sparse_compile.sparsity(**region):
            logits[name] = compiled(ids, logits_to_keep=SCORED + 1, use_cache=False).logits.float()
        stats[name] = sparse_compile.runtime_stats()

    # keep-all: every site ran the sparse path once, and the logits are dense's to float32 rounding
    assert len(stats["keep_all"]) == model.config.num_hidden_layers
    for name, path_count in (("keep_all", 1), ("sparse", 1), ("dense", 0)):
        calls = sparse_calls(stats[name])
        assert all(n == path_count for n in calls.values()), (name, {s: dict(e.calls) for s, e in stats[name].items()})
    assert all(not entry.plain_sdpa for entry in stats["keep_all"].values())
    torch.testing.assert_close(logits["keep_all"], logits["dense"], rtol=1e-4, atol=1e-3)
    dense_nll = nll(logits["dense"], ids)
    assert abs(nll(logits["keep_all"], ids) - dense_nll) < 1e-4

    # the default method at a sparse setting: density recorded below 1, loss near dense's
    densities = [entry.mean_density for entry in stats["sparse"].values()]
    assert all(d is not None for d in densities)
    density = sum(densities) / len(densities)
    assert density < 0.8, f"{method} {sparse_setting(method)} kept {density:.3f} of the tiles: not a sparse setting"
    sparse_nll = nll(logits["sparse"], ids)
    assert sparse_nll - dense_nll <= NLL_BOUND, (f"{method} {sparse_setting(method)} at density {density:.3f}: NLL "
                                                 f"{sparse_nll:.4f} against dense {dense_nll:.4f}")
