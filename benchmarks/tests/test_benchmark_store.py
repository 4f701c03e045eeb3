"""The benchmarks' result stores (``benchmarks/harness.py``): long-format rows with their provenance, appended to
one JSON-lines file per benchmark; and the committed stores themselves carry that provenance on every row."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402

PROVENANCE = {"device", "torch", "triton", "commit", "date", "command"}


def test_append_store_writes_one_long_row_per_metric_with_provenance(tmp_path):
    rows = [{"N": 1024, "method": "pbs", "value": 0.9, "ms": 1.5, "ratio": 0.5, "skip": None, "dense": False,
             "per_task": {"passkey": 1.0, "recall": 0.5}},
            {"N": 2048, "method": "pbs", "value": 0.9, "ms": "OOM"}]
    path = harness.append_store("bench_x", rows, params=("N", "value"), extra={"mode": "verify"}, out_dir=tmp_path,
                                command=["benchmarks/bench_x.py", "--reps", "3"])
    harness.append_store("bench_x", rows[:1], params=("N", "value"), out_dir=tmp_path)  # appends, never rewrites
    got = [json.loads(line) for line in path.read_text().splitlines()]
    first = [r for r in got if r.get("mode") == "verify"]
    assert sorted(r["metric"] for r in first) == ["ms", "per_task.passkey", "per_task.recall", "ratio"]
    assert len(got) == 2 * len(first)
    for r in first:
        assert PROVENANCE <= set(r) and r["command"] == "python benchmarks/bench_x.py --reps 3"
        assert r["N"] == 1024 and r["method"] == "pbs" and r["param_value"] == 0.9 and r["dense"] is False
        assert "skip" not in r  # None is no measurement
    oom = [r for r in harness.read_store("bench_x", out_dir=tmp_path, N=2048)]
    assert oom == []  # a row without a number has nothing to store; its marker stays in the run's table
    assert harness.read_store("bench_x", out_dir=tmp_path, metric="ms", mode="verify")[0]["value"] == 1.5


def test_write_results_keeps_run_files_apart_from_the_store(tmp_path):
    table = harness.write_results("run_name", [{"N": 1, "t": 2.0}], out_dir=tmp_path, store="bench_y", params=("N",))
    assert "t" in table
    assert {p.name for p in tmp_path.iterdir()} == {"run_name.json", "run_name.md", "bench_y.jsonl"}


def test_committed_stores_carry_provenance_on_every_row():
    stores = sorted((BENCH / "results").glob("*.jsonl"))
    assert stores
    for store in stores:
        for number, line in enumerate(store.read_text().splitlines(), 1):
            row = json.loads(line)
            missing = PROVENANCE - set(row) | {"metric", "value"} - set(row)
            assert not missing, f"{store.name}:{number} lacks {sorted(missing)}"
