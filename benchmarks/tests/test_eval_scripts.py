"""CPU smoke tests of the quality benchmarks: train_small_lm.py, quality.py, attention_map.py.

One tiny model is trained once per session (a few steps, seconds); the evaluation scripts then run in their
``--smoke`` mode on it, in process, and their outputs are checked for shape and sanity (not for quality numbers,
which need the GPU run).
"""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

tsl = importlib.import_module("train_small_lm")
corpus = importlib.import_module("lm_corpus")
quality = importlib.import_module("quality")
attention_map = importlib.import_module("attention_map")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    record = tsl.main(["--smoke", "--steps", "2", "--max-train-bytes", "300000", "--eval-windows", "2",
                       "--out-dir", str(out)])
    return out / "small_lm.pt", record


def test_training_smoke_writes_small_checkpoint_and_manifest(trained):
    ckpt, record = trained
    assert ckpt.exists() and ckpt.stat().st_size < 8 << 20
    saved = json.loads(ckpt.with_suffix(".json").read_text())
    assert saved["model_args"]["dim"] // saved["model_args"]["n_heads"] == 64  # the kernels' head dim
    for per_len in saved["final"].values():
        assert math.isfinite(per_len["train_loss"]) and math.isfinite(per_len["heldout_loss"])
    m = saved["manifest"]
    assert m["train"]["files"] > 0 and m["heldout"]["long_files"]
    for entry in m["heldout"]["long_files"]:  # every listed evaluation file obeys the split rule
        assert corpus.is_heldout(entry["path"]) and entry["bytes"] >= corpus.LONG_DOC_BYTES
    model, _ = tsl.load_checkpoint(ckpt)
    assert next(model.parameters()).dtype == torch.float32


def test_heldout_documents_checks_hashes(trained):
    ckpt, _ = trained
    manifest = json.loads(ckpt.with_suffix(".json").read_text())["manifest"]
    docs = corpus.heldout_documents(manifest, 1024, 1)
    assert len(docs[0]["data"]) >= 1024
    manifest["heldout"]["long_files"] = [dict(e, sha1="0" * 40) for e in manifest["heldout"]["long_files"]]
    with pytest.raises(FileNotFoundError):
        corpus.heldout_documents(manifest, 1024, 1)


def test_split_is_deterministic_by_path():
    assert corpus.is_heldout("stdlib/x.py") == corpus.is_heldout("stdlib/x.py")
    share = sum(corpus.is_heldout(f"stdlib/f{i}.py") for i in range(4000)) / 4000
    assert abs(share - corpus.HELDOUT_PER_MILLE / 1000) < 0.015


def test_quality_smoke(trained, tmp_path):
    ckpt, _ = trained
    result = quality.main(["--smoke", "--checkpoint", str(ckpt), "--out-dir", str(tmp_path), "--attention", "hook",
                           "--docs", "1"])
    rows = result["ppl"]["rows"]
    assert {r["method"] for r in rows} == {"dense", *quality.METHODS, quality.BFLA_BLOCK_SCALE}
    for r in rows:
        assert math.isfinite(r["bpb"])
        if r["method"] != "dense":
            assert r["sparse_sites"] >= 1 and 0 < r["density"] < 2, r  # the sparse path really ran
    op = result["operator"]["512"]
    assert set(op["curves"]) == {c[0] for c in quality.OP_CURVES}
    for label, points in op["curves"].items():
        assert points and all(math.isfinite(p["rel_l1"]) and p["sparse_layers"] == op["layers"] for p in points)
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["operator"]["512"]["layers"] == op["layers"]
    assert "(b) operator error" in (tmp_path / "quality.md").read_text()


def test_at_density_interpolates_log_linearly():
    pts = [{"density": 0.1, "e": 1e-2}, {"density": 0.3, "e": 1e-4}, {"density": 0.2, "e": 1e-3}]
    assert quality.at_density(pts, 0.15, "e") == pytest.approx(10 ** -2.5)
    assert quality.at_density(pts, 0.05, "e") is None  # outside the curve: no extrapolation
    assert quality.at_density(pts, 0.3, "e") == pytest.approx(1e-4)


def test_block_mass_matches_full_softmax_and_permutations():
    torch.manual_seed(0)
    n, d = 96, 16
    q, k = torch.randn(n, d), torch.randn(n, d)
    full = torch.softmax((q @ k.T / 4).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")), -1)
    ref = full.view(3, 32, 3, 32).sum(-1).mean(1)
    mass = attention_map.block_mass(q, k, 0.25, 32, 32)
    torch.testing.assert_close(mass, ref)
    # a key permutation moves mass between tiles but keeps every row's total
    perm = torch.randperm(n)
    moved = attention_map.block_mass(q, k, 0.25, 32, 32, key_index=perm, query_index=torch.randperm(n))
    torch.testing.assert_close(moved.sum(-1), torch.ones(3))


def test_attention_map_smoke(trained, tmp_path):
    ckpt, _ = trained
    summary = attention_map.main(["--smoke", "--checkpoint", str(ckpt), "--out-dir", str(tmp_path)])
    for name in ("meanpool", "pbs", "s2o"):
        p = summary["panels"][name]
        assert 0 < p["coverage"] <= 1 + 1e-5 and 0 < p["density"] < 2
    assert (tmp_path / "attention_map.json").exists()


def _run_script(args, tmp_path):
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(BENCH.parent))
    proc = subprocess.run([sys.executable, *args], cwd=BENCH.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _e2e_rows(tmp_path, *args, methods=("pbs", "sparge", "bfla", "s2o")):
    _run_script(["benchmarks/bench_e2e.py", "--smoke", "--lengths", "256", "--budgets", "--out", str(tmp_path),
                 "--methods", *methods, *args], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "e2e.jsonl").read_text().splitlines()]
    method_rows = [r for r in rows if r["contender"] in methods]
    assert len(method_rows) == len(methods)
    dense = {r["contender"] for r in rows} - {r["contender"] for r in method_rows}
    assert dense == {"eager", "inductor", "floor"}
    assert (tmp_path / "e2e.md").exists()
    return method_rows, json.loads((tmp_path / "e2e.json").read_text())


def test_e2e_benchmark_smoke_whole_model_every_layer_sparse(tmp_path):
    # the default: the whole model compiled as users do (the traced mask proven causal), compile time recorded
    methods, result = _e2e_rows(tmp_path, "--layers", "3", "--mask-overhead",
                                methods=("pbs", "sparge", "bfla", "s2o", "sampled"))
    for r in methods:
        assert r["sparse_calls"] == 3, r
        assert 0 < r["density"] <= 2 and r["ttft_s"] > 0
    meta = result["meta"]
    assert meta["compile"] == "whole model" and meta["first_call_s"]["sparse_prefill"] > 0
    assert meta["mask_overhead"][0]["N"] == 256


def test_e2e_benchmark_smoke_regional_runs_every_layer_sparse(tmp_path):
    # regression: with regional compilation, transformers' per-layer cache index made Dynamo recompile per layer,
    # and past its default limit of 8 the remaining layers ran eager (dense); the script must lift the limit and
    # count the sparse calls. 10 layers > 8 (two methods: the limit is per compiled layer, not per method).
    methods, _ = _e2e_rows(tmp_path, "--layers", "10", "--regional", methods=("pbs", "s2o"))
    for r in methods:
        assert r["sparse_calls"] == 10, r


def test_e2e_benchmark_smoke_front_door_against_compiled(tmp_path):
    # transformers' "sparse_prefill" attention (no torch.compile) and the compiled model at the same settings, both
    # counted sparse at every layer, alternated with the dense baselines; rows into the store under --out
    _run_script(["benchmarks/bench_e2e.py", "--smoke", "--front-door", "--lengths", "256", "--methods", "pbs",
                 "--budgets", "0.5", "--skip-defaults", "--skip-eager", "--reps", "1", "--out", str(tmp_path)],
                tmp_path)
    rows = {r["contender"]: r for r in map(json.loads, (tmp_path / "e2e.jsonl").read_text().splitlines())}
    assert set(rows) == {"inductor", "front door pbs@0.5", "compiled pbs@0.5"}
    front, compiled = rows["front door pbs@0.5"], rows["compiled pbs@0.5"]
    for r in (front, compiled):
        assert r["sparse_calls"] == r["timed_sparse_calls"] == 2 and r["ttft_s"] > 0, r
    assert front["params"] == compiled["params"] and front["density"] == pytest.approx(compiled["density"])
    stored = [json.loads(line) for line in (tmp_path / "bench_e2e.jsonl").read_text().splitlines()]
    assert {(r["contender"], r["mode"]) for r in stored if r["metric"] == "ttft_s"} == {
        (c, "front_door") for c in rows}
    assert any(r["metric"] == "front_door_over_compiled" for r in stored)


def test_profile_layer_smoke(tmp_path):
    _run_script(["benchmarks/profile_layer.py", "--smoke", "--methods", "bfla", "--no-profile", "--out",
                 str(tmp_path)], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "profile_layer.jsonl").read_text().splitlines()]
    parts = {r["part"] for r in rows}
    assert {"isolated build_plan", "isolated kernel (as passed)", "model TTFT", "in situ run_sparse (synced)"} <= parts
    situ = [r for r in rows if r["part"] == "in situ run_sparse (synced)"]
    assert situ and "2 calls" in situ[0]["detail"]  # both layers went through the sparse path
    assert all(r["ms"] is None or r["ms"] > 0 for r in rows)


def test_alternating_samples_shuffle_each_round_but_time_every_contender_each_round():
    """Each round times every contender once; after the first round the order changes (seeded), so no contender
    always runs right after the same one (on the H100 the call after a long one runs at a lower clock)."""
    from harness import alternating_samples

    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    times = alternating_samples(contenders, 6, warmup=1)
    assert {name: len(t) for name, t in times.items()} == dict.fromkeys("abcde", 6)
    rounds = [calls[i:i + 5] for i in range(0, len(calls), 5)]
    assert rounds[0] == rounds[1] == list("abcde")  # the warm-up and the first round keep the given order
    assert all(sorted(r) == list("abcde") for r in rounds)
    followers_of_a = {r[r.index("a") + 1] for r in rounds[1:] if r.index("a") < 4}
    assert len(followers_of_a) > 1
    alternating_samples(contenders, 6, warmup=1)
    assert calls[len(calls) // 2:] == calls[:len(calls) // 2]  # seeded: the same orders every time


def test_soak_benchmark_tiny_on_the_cpu(tmp_path, fresh_compile_state):
    # bench_soak.py as the GPU runs it, tiny: calls in random regions counted against runtime_stats(), no recompile
    # after the warm-up, memory and per-bucket times recorded, rows in the store under --out
    soak = importlib.import_module("bench_soak")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = soak.main(["--device", "cpu", "--calls", "4", "--layers", "1", "--max-batch", "1",
                            "--lengths", "40", "72", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    meta = result["meta"]
    assert meta["recompiles_after_warmup"] == 0
    assert meta["sparse_calls"] + meta["dense_calls"] == meta["attention_calls_made"] == 4
    assert meta["at_call_4"]["rss_mib"] > 0 and meta["at_end"]["rss_mib"] > 0
    buckets = {r["bucket"] for r in result["rows"]}
    assert "all" in buckets and buckets - {"all"} <= {40, 72}
    stored = [json.loads(line) for line in (tmp_path / "bench_soak.jsonl").read_text().splitlines()]
    assert {"median_p50_s", "max_p99_over_p50", "recompiles_after_warmup", "sparse_calls"} <= {r["metric"] for r in stored}


def test_real_weights_report_keeps_other_seeds_apart(tmp_path, capsys):
    """Rows of another seed (other windows) are their own contender in the report, dense ones showing their NLL,
    and never overwrite the default seed's rows."""
    brw = importlib.import_module("bench_real_weights")
    base = {"N": 16384, "task": "nll_prose", "rope": "yarn4", "commit": "c", "command": "x"}
    rows = []
    runs = ((brw.DEFAULT_SEED, "2026-01-01", 2.3, 0.010), (1, "2026-01-02", 2.4, -0.013))  # the other seed later
    for seed, date, dense_nll, delta in runs:
        for contender, setting, metric, value in (("dense", "dense", "nll", dense_nll),
                                                  ("sampled", "defaults", "delta_nll", delta)):
            rows.append({**base, "seed": seed, "date": date, "contender": contender, "setting": setting,
                         "method": None if contender == "dense" else "sampled", "metric": metric, "value": value})
    (tmp_path / f"{brw.STORE}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    brw.report([], str(tmp_path))
    table = {line.split("|")[3].strip(): line.split("|")[9].strip() for line in capsys.readouterr().out.splitlines()
             if line.startswith("| 16384")}
    assert table == {"dense": "2.300", "sampled": "0.010", "dense (seed 1)": "2.400", "sampled (seed 1)": "-0.013"}


def test_serving_benchmark_smoke_every_chunk_counted_sparse(tmp_path):
    # a prompt prefilled in chunks over one cache against one call, through the front door: every chunk's every
    # layer counted sparse, the dense contenders counted nowhere, rows in the store under --out
    _run_script(["benchmarks/bench_serving.py", "--smoke", "--out", str(tmp_path), "--store"], tmp_path)
    rows = {r["contender"]: r for r in json.loads((tmp_path / "bench_serving.json").read_text())["rows"]}
    assert rows["sparse one call"]["sparse_calls"] == 2 and rows["sparse chunked"]["sparse_calls"] == 2 * 4
    assert rows["dense one call"]["sparse_calls"] == rows["dense chunked"]["sparse_calls"] == 0
    stored = [json.loads(line) for line in (tmp_path / "bench_serving.jsonl").read_text().splitlines()]
    assert {r["contender"] for r in stored if r["metric"] == "ttft_ms"} == set(rows)


def test_windows_benchmark_smoke_band_exact_and_every_layer_sparse(tmp_path):
    # one window layer against its band's ideal and SDPA with the band's mask (exact), and whole window models
    # compiled: every layer counted sparse
    _run_script(["benchmarks/bench_windows.py", "--smoke", "--shapes", "gemma3-4b", "--out", str(tmp_path)], tmp_path)
    rows = json.loads((tmp_path / "bench_windows.json").read_text())["rows"]
    band = next(r for r in rows if r["part"] == "layer" and r["contender"] == "band")
    assert band["band_path"] == "sparse" and band["max_error_vs_sdpa"] < 1e-5
    model = {r["contender"]: r for r in rows if r["part"] == "model"}
    assert model["sparse_prefill"]["sparse_calls"] == model["sparse_prefill"]["layers"]
    assert model["inductor (sdpa)"]["sparse_calls"] == 0
