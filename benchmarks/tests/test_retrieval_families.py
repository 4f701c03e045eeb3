"""Retrieval format families (training vs held-out), the natural retrieval measure, and their benchmark and
training options (CPU smoke runs)."""

import importlib
import json
import random
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

rf = importlib.import_module("retrieval_families")
rt = importlib.import_module("retrieval_tasks")


def _code(n: int) -> bytes:
    lines = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(n // 30 + 1)]
    return "".join(lines).encode()[:n]


def _planted(inst) -> str:
    """The instance's text with the filler code removed: what the family rendered (needles and queries)."""
    data = bytes(inst.tokens.tolist()).decode()
    filler = _code(len(data) + 100).decode()
    return "\n".join(line for line in data.split("\n") if line and line not in filler)


def test_the_split_is_by_construction():
    assert {f.split for f in rf.TRAIN_FAMILIES} == {"train"} and {f.split for f in rf.HELDOUT_FAMILIES} == {"heldout"}
    assert len(rf.TRAIN_FAMILIES) >= 8 and len(rf.HELDOUT_FAMILIES) >= 5
    assert set(rf.FAMILIES) == {f.name for f in rf.TRAIN_FAMILIES + rf.HELDOUT_FAMILIES}
    assert any(f.alias for f in rf.TRAIN_FAMILIES) and any(f.alias for f in rf.HELDOUT_FAMILIES)  # multi-hop


def test_no_heldout_skeleton_appears_in_training_samples():
    skeletons = [(f.name, rf.skeleton(t)) for f in rf.HELDOUT_FAMILIES
                 for t in (f.needle, *f.queries, *([f.alias] if f.alias else []))]
    rng = random.Random(11)
    for fam in rf.TRAIN_FAMILIES:
        text = "\n".join(_planted(rf.make_instance(fam.name, _code(20000), 16384, rng)) for _ in range(40))
        assert text.count("\n") > 40 * 12  # every instance planted its 12 keys (and queries)
        for name, pattern in skeletons:
            match = pattern.search(text)
            assert match is None, f"training family {fam.name} renders held-out {name}'s skeleton: {match.group()!r}"
        # each fixed training family is matched by its own skeletons (the check can see a template)
        if not fam.composed:
            assert rf.skeleton(fam.needle).search(text) and all(rf.skeleton(q).search(text) for q in fam.queries)


def test_composed_family_draws_its_syntax_per_instance():
    rng = random.Random(2)
    needles = {rf.compose(rng)[0] for _ in range(200)}
    queries = {rf.compose(rng)[1][0] for _ in range(200)}
    assert len(needles) > 150 and len(queries) > 150
    for needle in needles:  # every draw formats as a template: one key, one value, one line
        text = needle.format(key="k_1", value="v1v1v1v1")
        assert text.endswith("\n") and text.count("\n") == 1 and "k_1" in text and "v1v1v1v1" in text
    assert rf.training_weights(["assign", "composed"]) == [1.0, rf.FAMILIES["composed"].weight]


@pytest.mark.parametrize("family", list(rf.FAMILIES))
def test_every_family_renders_ascii_with_each_value_planted_and_queried(family):
    rng = random.Random(5)
    for length in (2048, 16384):
        for _ in range(4):
            inst = rf.make_instance(family, _code(length + 100), length, rng)
            data = bytes(inst.tokens.tolist())
            assert len(data) == length and data.isascii() and data.endswith(b"\n")
            assert inst.task == family and inst.style == rf.FAMILIES[family].split and inst.answers
            for answer in inst.answers:
                value = data[answer.start:answer.end]
                assert answer.task == family and len(value) >= 8
                # the value is on its needle's line, planted once before the queries, which ask for it
                line = data[answer.needle_start:].split(b"\n")[0]
                assert value in line and line.index(value) <= rf.NEEDLE_LEAD, (value, line)
                assert data.count(value) == 2 and data.find(value) < answer.start
                assert 0 <= answer.depth <= 1


def test_same_seed_same_bytes_and_choices_vary():
    a = rf.make_batch(list(rf.FAMILIES), _code(60000), 4096, random.Random(3))
    b = rf.make_batch(list(rf.FAMILIES), _code(60000), 4096, random.Random(3))
    assert all(torch.equal(x.tokens, y.tokens) and x.answers == y.answers for x, y in zip(a, b))
    values = [bytes(i.tokens[a.start:a.end].tolist()) for i in a for a in i.answers]
    assert len(set(values)) == len(values)
    # the independent choices: several alphabets, lengths and naming schemes over a few instances
    rng = random.Random(9)
    assigned = [_planted(rf.make_instance("subscript", _code(5000), 4096, rng)) for _ in range(30)]
    assert any("_" in t.split("[")[1][:30] for t in assigned) and any("." in t.split("[")[1][:30] for t in assigned)
    lengths = {a.end - a.start for i in rf.make_batch(["assign"] * 30, _code(9000), 4096, random.Random(2))
               for a in i.answers}
    assert len(lengths) >= 4


def test_natural_positions_on_handmade_text():
    # "abcd" recurs 12 bytes after its first occurrence, "wxyz" 30 bytes after: with 4-grams and buckets
    # [10, 20) and [20, inf) the last byte of each recurrence counts, in its bucket
    text = b"abcd" + b"." * 8 + b"abcd" + b"wxyz" + b"-" * 26 + b"wxyz"
    got = rf.natural_positions(text, ngram=4, distances=(10, 20))
    assert got == {"10-20": [15], "20+": [49]}
    # a run copied from far back counts at every byte whose n-gram lies wholly in the repeat; the dots repeat
    # within one byte, so they never count
    text = b"0123456789" + b"." * 40 + b"0123456789"
    got = rf.natural_positions(text, ngram=4, distances=(10, 100))
    assert got == {"10-100": list(range(53, 60)), "100+": []}
    with pytest.raises(ValueError, match="distances"):
        rf.natural_positions(text, ngram=4, distances=(20, 10))


def test_score_natural_counts_argmax_hits_and_bits():
    tokens = torch.tensor([1, 2, 3, 4])
    logits = torch.full((4, 8), -30.0)
    logits[0, 2] = 0.0  # predicts token 1 (2): right
    logits[2, 0] = 0.0  # predicts token 3 (4): wrong
    got = rf.score_natural(logits, tokens, {"a": [1, 3], "b": []})
    assert got["a"]["count"] == 2 and got["a"]["hits"] == 1 and got["b"]["count"] == 0
    assert got["a"]["bits"] > 30  # the wrong one costs ~30 nats


def test_benchmark_smoke_scores_families_and_the_natural_measure(tmp_path):
    bench = importlib.import_module("bench_retrieval")
    bench.main(["--smoke", "--per-task", "0", "--families", "alias_assign", "yaml",
                "--natural", "1", "--methods", "sampled", "--densities", "0.2", "--calibrate-errors", "--coverage",
                "1", "--bpb-windows", "0", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "retrieval.json").read_text())
    rows = doc["rows"]
    assert {r["contender"] for r in rows} == {"dense", "sampled", "sampled@0.2"}
    for r in rows:
        assert r["N"] == 2048 and r["exact"] is None
        assert 0 <= r["family_train"] <= 1 and 0 <= r["family_heldout"] <= 1
        assert {"family.alias_assign", "family.yaml"} <= set(r) and "family.assign" not in r
        assert r["natural_count.256-1K"] + r["natural_count.1K+"] > 0
        assert {"natural_acc.256-1K", "natural_bpb.256-1K", "natural_acc.1K+", "natural_bpb.1K+"} <= set(r)
    sparse = next(r for r in rows if r["contender"] == "sampled@0.2")
    assert abs(sparse["density"] - 0.2) < 0.15
    assert "family_missed_lookup_head_listed" in sparse  # the untrained model misses: coverage of its misses
    stored = [json.loads(line) for line in (tmp_path / "bench_retrieval.jsonl").read_text().splitlines()]
    assert {"family_heldout", "family.yaml", "natural_acc.256-1K"} <= {r["metric"] for r in stored}


def test_training_on_families_smoke(tmp_path):
    tsl = importlib.import_module("train_small_lm")
    record = tsl.main(["--smoke", "--retrieval", "--families", "--steps", "2", "--max-train-bytes", "300000",
                       "--eval-windows", "1", "--eval-instances", "1", "--phases", "1024x2:1", "--out-dir",
                       str(tmp_path)])
    assert record["families"] == [f.name for f in rf.TRAIN_FAMILIES]
    fam = record["retrieval"]["1024"]
    assert 0 <= fam["family_train"] <= 1 and 0 <= fam["family_heldout"] <= 1


def test_family_training_batches_weigh_the_values_and_use_training_families_only():
    retrieval_training = importlib.import_module("lm_retrieval_training")
    names = [f.name for f in rf.TRAIN_FAMILIES]
    x, y, weight = retrieval_training._retrieval_batches(_code(50000), 4096, 4, random.Random(1), 1.0, torch.device("cpu"),
                                          answer_weight=16.0, families=names)
    heavy = retrieval_training.answer_weight_at(4096, 16.0)
    # 3 queries per instance plus about 0.75 more (12 per 64K), each value 8 bytes or more
    assert x.shape == (4, 4096) and all(int((weight[r] == heavy).sum()) >= 3 * 8 for r in range(4))


def test_more_queries_come_with_twice_as_many_keys():
    inst = rf.make_instance("assign", _code(20000), 16384, random.Random(4), queries=10)
    data = bytes(inst.tokens.tolist())
    assert len(inst.answers) == 10 and data.count(b"\nassert ") + data.count(b"\nprint(") >= 10
    with pytest.raises(ValueError, match="queries"):
        rf.make_instance("assign", _code(20000), 16384, random.Random(4), queries=0)
