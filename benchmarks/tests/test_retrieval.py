"""The retrieval tasks, the retrieval model's training mode and the retrieval benchmark (CPU smoke runs)."""

import importlib
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

rt = importlib.import_module("retrieval_tasks")


def _code(n: int) -> bytes:
    lines = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(n // 30 + 1)]
    return "".join(lines).encode()[:n]


@pytest.mark.parametrize("style", list(rt.STYLES))
@pytest.mark.parametrize("task", rt.TASKS)
@pytest.mark.parametrize("length", [1024, 4096, 9000])
def test_instances_plant_every_queried_value_and_keep_the_length(task, length, style):
    rng = random.Random(length)
    inst = rt.make_instance(task, _code(length + 100), length, rng, style)
    fmt = rt.STYLES[style]
    data = bytes(inst.tokens.tolist())
    assert len(data) == length and inst.answers and inst.style == style
    for answer in inst.answers:
        value = data[answer.start:answer.end]
        assert len(value) == fmt.value_chars and set(value.decode()) <= set(fmt.alphabet)
        # the value sits in its needle line (before the queries), and the query reads it later
        assert data.find(value, answer.needle_start) < answer.start - fmt.value_chars
        needle = data[answer.needle_start:answer.needle_start + 80].split(b"\n")[0]
        assert value in needle or task == "multivalue"
        assert 0 <= answer.depth <= 1
    assert data.endswith(b"\n")


@pytest.mark.parametrize("style", list(rt.STYLES))
@pytest.mark.parametrize("task", rt.TASKS)
def test_extra_lookups_add_single_value_queries_before_the_tasks_own(task, style):
    length, extra = 9000, 5
    plain = rt.make_instance(task, _code(length + 100), length, random.Random(7), style)
    inst = rt.make_instance(task, _code(length + 100), length, random.Random(7), style, extra_lookups=extra)
    data = bytes(inst.tokens.tolist())
    fmt = rt.STYLES[style]
    assert len(data) == length
    extras = [a for a in inst.answers if a.task == rt.EXTRA_TASK]
    own = [a for a in inst.answers if a.task == task]
    assert len(extras) == extra and len(own) == len(plain.answers)
    assert max(a.start for a in extras) < min(a.start for a in own)  # the task's queries stay last
    keys = set()
    for answer in extras:
        value = data[answer.start:answer.end]
        needle = data[answer.needle_start:].split(b"\n")[0]
        assert value in needle and data.count(value) == 2  # planted once, answered once
        query = data[:answer.start].rsplit(b"\n", 1)[1]
        key = fmt.ask.split("{key}")[0]
        assert query.startswith(key.encode())
        keys.add(query)
    assert len(keys) == extra  # distinct keys, none of them the task's
    # no extras: the same draws as before extra lookups existed
    again = rt.make_instance(task, _code(length + 100), length, random.Random(7), style, extra_lookups=0)
    assert torch.equal(again.tokens, plain.tokens)
    # extras are interleaved among the task's needles, not all planted after them
    plans = [rt.make_instance(task, _code(length + 100), length, random.Random(seed), style, extra_lookups=extra)
             for seed in range(12)]
    assert any(min(a.needle_start for a in p.answers if a.task == rt.EXTRA_TASK) <
               max(a.needle_start for a in p.answers if a.task == task) for p in plans)


def test_extra_lookups_can_share_a_key_prefix():
    inst = rt.make_instance("recall", _code(20000), 16384, random.Random(4), extra_lookups=10, extra_near_miss_share=1.0)
    data = bytes(inst.tokens.tolist())
    keys = [data[:a.start].rsplit(b"\n", 1)[1][len(b"assert _vkey_"):][:6] for a in inst.answers
            if a.task == rt.EXTRA_TASK]
    assert len(set(keys)) == 10 and len({k[:4] for k in keys}) == 1


@pytest.mark.parametrize("style", list(rt.STYLES))
def test_extra_lookups_can_be_three_value_lists_in_order(style):
    length, fmt = 9000, rt.STYLES[style]
    inst = rt.make_instance("passkey", _code(length + 100), length, random.Random(3), style, extra_lookups=4,
                            extra_list_share=1.0)
    data = bytes(inst.tokens.tolist())
    extras = [a for a in inst.answers if a.task == rt.EXTRA_TASK]
    assert len(extras) == 12 and len(data) == length
    for first in range(0, 12, 3):
        entries = extras[first:first + 3]
        values = [data[a.start:a.end] for a in entries]
        positions = [data.find(v) for v in values]
        assert positions == sorted(positions) and max(positions) < entries[0].start  # planted in order, before
        query = data[:entries[0].start].rsplit(b"\n", 1)[1]
        assert query.startswith(fmt.list_ask.split("{key}")[0].encode())
        first_line = data[positions[0]:].split(b"\n")[0]
        line_start = data.rfind(b"\n", 0, positions[0]) + 1
        assert data[line_start:].startswith(fmt.first.split("{key}")[0].encode()) and values[0] in first_line
        for later in positions[1:]:
            line_start = data.rfind(b"\n", 0, later) + 1
            assert data[line_start:].startswith(fmt.extend.split("{key}")[0].encode())


def test_extra_lookups_per_window_scale_with_the_length():
    retrieval_training = importlib.import_module("lm_retrieval_training")
    rng = random.Random(0)
    assert retrieval_training.extra_lookups_at(65536, 16, rng) == 16 and retrieval_training.extra_lookups_at(16384, 16, rng) == 4
    counts = [retrieval_training.extra_lookups_at(4096, 8, rng) for _ in range(2000)]  # mean 0.5: 0 or 1, half each
    assert set(counts) == {0, 1} and 0.45 < sum(counts) / len(counts) < 0.55
    state = rng.getstate()
    assert retrieval_training.extra_lookups_at(65536, 0, rng) == 0 and rng.getstate() == state  # no draw


def test_the_default_style_is_the_first_results_format():
    inst = rt.make_instance("passkey", _code(5000), 4096, random.Random(2))
    data = bytes(inst.tokens.tolist())
    answer = inst.answers[0]
    assert data[answer.needle_start:].startswith(b"_vkey_")
    assert data[:answer.start].rsplit(b"\n", 1)[1].startswith(b"assert _vkey_")
    with pytest.raises(ValueError, match="unknown style"):
        rt.make_instance("passkey", _code(5000), 4096, random.Random(2), "yaml")


def test_multivalue_lists_the_extensions_in_order():
    inst = rt.make_instance("multivalue", _code(5000), 4096, random.Random(3))
    data = bytes(inst.tokens.tolist())
    starts = [a.needle_start for a in inst.answers]
    values = [data[a.start:a.end] for a in inst.answers]
    assert len(values) == 3 and starts == sorted(starts)
    assert [data.find(v) for v in values] == sorted(data.find(v) for v in values)


def test_depths_spread_over_the_prompt():
    rng = random.Random(0)
    depths = [a.depth for _ in range(40) for a in rt.make_instance("passkey", _code(5000), 4096, rng).answers]
    assert min(depths) < 0.2 and max(depths) > 0.8


def test_score_counts_exact_values_from_logits():
    inst = rt.make_instance("recall", _code(5000), 4096, random.Random(1))
    tokens = inst.tokens.long()
    perfect = torch.full((tokens.numel(), 256), -10.0)
    perfect[torch.arange(tokens.numel() - 1), tokens[1:]] = 10.0  # predicts every next byte
    assert all(r["exact"] and r["chars"] == 1.0 for r in rt.score(perfect, inst))
    wrong = perfect.clone()
    first = inst.answers[0]
    wrong[first.start + 3 - 1] = 0.0
    wrong[first.start + 3 - 1, (int(tokens[first.start + 3]) + 1) % 256] = 10.0
    results = rt.score(wrong, inst)
    assert not results[0]["exact"] and results[0]["chars"] == 1 - 1 / rt.VALUE_CHARS  # vkey values: 32 bytes
    assert all(r["exact"] for r in results[1:])


def test_training_batches_weigh_exactly_the_answer_bytes():
    retrieval_training = importlib.import_module("lm_retrieval_training")
    rng = random.Random(5)
    filler = bytes(random.Random(1).choice(b"abc =\n") for _ in range(60_000))
    seq = 4096
    x, y, weight = retrieval_training._retrieval_batches(filler, seq, 6, rng, 1.0, torch.device("cpu"), tuple(rt.STYLES), 8.0)
    heavy = retrieval_training.answer_weight_at(seq, 8.0)
    assert heavy == 8.0 and retrieval_training.answer_weight_at(65536, 8.0) == 128.0 and retrieval_training.answer_weight_at(256, 0.0) == 1.0
    # replay the same draws: the weighted targets are the value bytes of each instance's answers
    replay = random.Random(5)
    for row in range(6):
        start = replay.randrange(0, len(filler) - seq - 2)
        replay.random()
        task = replay.choice(rt.TASKS)
        style = replay.choice(tuple(rt.STYLES))
        inst = rt.make_instance(task, filler[start:start + seq + 1], seq + 1, replay, style)
        assert torch.equal(torch.cat([x[row], y[row, -1:]]), inst.tokens.long())
        expected = torch.ones(seq)
        for answer in inst.answers:
            expected[answer.start - 1:answer.end - 1] = heavy
        assert torch.equal(weight[row], expected)
        assert all(y[row, a.start - 1:a.end - 1].tolist() == list(inst.tokens[a.start:a.end]) for a in inst.answers)
    assert retrieval_training._retrieval_batches(filler, seq, 2, rng, 1.0, torch.device("cpu"))[2] is None  # no weight asked
    # extra lookups: their value bytes weigh like the task's
    seq = 16384
    filler = bytes(random.Random(1).choice(b"abc =\n") for _ in range(40_000))
    x, y, weight = retrieval_training._retrieval_batches(filler, seq, 2, random.Random(9), 1.0, torch.device("cpu"), ("vkey",), 8.0,
                                          None, 16.0)
    heavy = retrieval_training.answer_weight_at(seq, 8.0)
    for row in range(2):
        values = int((weight[row] == heavy).sum()) // rt.VALUE_CHARS
        assert values >= 4 + 1  # 4 extra lookups per 16K plus the task's own


def test_retrieval_training_smoke_records_dense_accuracy(tmp_path):
    tsl = importlib.import_module("train_small_lm")
    record = tsl.main(["--smoke", "--retrieval", "--steps", "2", "--max-train-bytes", "300000", "--eval-windows",
                       "1", "--out-dir", str(tmp_path)])
    assert record["model_args"]["dim"] // record["model_args"]["n_heads"] == 64  # smoke; the GPU model: 128
    assert set(record["retrieval"]) == {"1024", "2048"}
    assert set(record["retrieval"]["1024"]) == set(rt.TASKS) | {"mean_exact"} | {
        f"style_{s}" for s in rt.STYLES if s != "vkey"}
    assert record["styles"] == list(rt.STYLES)
    assert (tmp_path / "retrieval_lm.pt").exists()
    full = tsl.RETRIEVAL_MODEL
    assert full["dim"] // full["n_heads"] == 128 and full["n_heads"] == 4 * full["n_kv_heads"]


def test_retrieval_benchmark_smoke(tmp_path):
    bench = importlib.import_module("bench_retrieval")
    bench.main(["--smoke", "--methods", "pbs", "bfla", "sampled", "sampled:budget=1.0", "--coverage", "1",
                "--styles", "vkey", "comment", "--layer-ablation", "pbs", "--layer-densities", "1,0.2",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "retrieval.json").read_text())["rows"]
    names = {r["contender"] for r in rows}
    assert {"dense", "pbs", "bfla", "sampled", "pbs-noperm", "pbs@0.3", "bfla@0.3", "sampled@0.3", "pbs-noperm@0.3"} <= names
    # a method with fields set runs as given (its density knob is not fitted): budget 1.0 keeps every causal tile
    assert "sampled:budget=1.0@0.3" not in names
    assert abs(next(r for r in rows if r["contender"] == "sampled:budget=1.0")["density"] - 1.0) < 1e-6
    # one layer at a time at pbs@0.3's threshold: the other layers keep every tile, so the mean density is higher
    one_layer = [r for r in rows if r["contender"].startswith("pbs@0.3/layer")]
    assert len(one_layer) >= 2 and "bfla@0.3/layer0" not in names
    everywhere = next(r for r in rows if r["contender"] == "pbs@0.3")["density"]
    assert all(everywhere < r["density"] <= 1.0 + 1e-6 for r in one_layer)
    # per-layer densities, each layer calibrated alone: the mean of (1, ~0.2)
    mixed = next(r for r in rows if r["contender"] == "pbs@layers[1,0.2]")["density"]
    assert 0.45 < mixed < 0.75
    for r in rows:
        assert 0 <= r["exact"] <= 1 and set(rt.TASKS) <= set(r) and {"style_vkey", "style_comment"} <= set(r)
        if r["contender"] != "dense":
            assert r["density"] is not None and 0 < r["density"] <= 1.5
            if "missed_needle_listed" in r:  # the untrained model misses: coverage of all plans and the lookup head
                assert 0 <= r["missed_needle_listed"] <= 1 and r["missed_lookup_head_listed"] in (0, 1)
                assert 0 <= r["missed_value_rows_listed"] <= 1
    assert abs(next(r for r in rows if r["contender"] == "pbs@0.3")["density"] - 0.3) < 0.15
    assert (tmp_path / "retrieval.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_listed_keys_maps_permuted_tiles_to_physical_keys_and_drops_padding():
    from sparse_compile.plan import BlockPlan

    bench = importlib.import_module("bench_retrieval")
    # 4 keys listed in reverse, padded with -1 to 6; query block 1 (rows 2-3) lists logical tiles [0, 2) and [4, 6)
    plan = BlockPlan(block_m=2, block_n=2,
                     tile_offsets=torch.tensor([[[[0, 0], [0, 4]]]], dtype=torch.int32),
                     tile_counts=torch.tensor([[[1, 2]]], dtype=torch.int32),
                     masked_counts=torch.tensor([[[1, 1]]], dtype=torch.int32),
                     key_index=torch.tensor([[[3, 2, 1, 0, -1, -1]]], dtype=torch.int32))
    assert bench.listed_keys(plan, 0, 3).tolist() == [3, 2]
    assert bench.listed_keys(plan, 0, 0).tolist() == [3, 2]


@pytest.mark.parametrize("policy", ["dense", "oracle", "rowmax", "meanpool", "rowmax-meankeys", "keymax-meanquery",
                                    "sampled-rows"])
def test_oracle_study_attention_is_exact_with_every_tile_kept(policy):
    oracle = importlib.import_module("retrieval_oracle")
    q, k, v = torch.randn(2, 4, 301, 16), torch.randn(2, 2, 301, 16), torch.randn(2, 2, 301, 16)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(oracle.masked_attention(q, k, v, policy, 1.0, 32, 64), dense)


def test_oracle_study_keeps_the_tile_holding_the_mass():
    """Query block 7 of 32-row tiles: one tile (keys 64-95) carries keys aligned with its queries; at a budget of 2
    tiles the oracles keep it and the diagonal, so the output is attention over exactly those keys."""
    oracle = importlib.import_module("retrieval_oracle")
    n, d = 256, 16
    q, k, v = torch.randn(1, 1, n, d) * 0.1, torch.randn(1, 1, n, d) * 0.1, torch.randn(1, 1, n, d)
    direction = torch.randn(d)
    q[0, 0, 224:] += 3 * direction
    k[0, 0, 64:96] += 3 * direction
    keys = torch.zeros(n, dtype=torch.bool)
    keys[64:96] = keys[224:] = True
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal & keys[None, :])
    for policy in ("oracle", "rowmax", "sampled-rows", "rowmax-meankeys", "keymax-meanquery"):
        out = oracle.masked_attention(q, k, v, policy, 2 / 8, 32, 64)  # block 7: ceil(0.25 * 8) = 2 tiles
        torch.testing.assert_close(out[0, 0, 224:], expected[0, 0, 224:])


def test_oracle_study_smoke(tmp_path):
    oracle = importlib.import_module("retrieval_oracle")
    oracle.main(["--smoke", "--contenders", "dense", "oracle@0.1", "rowmax@0.1", "meanpool@0.1", "--out",
                 str(tmp_path)])
    rows = json.loads((tmp_path / "retrieval_oracle_smoke.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"dense", "oracle@0.1", "rowmax@0.1", "meanpool@0.1"}
    assert all(0 <= r["exact"] <= 1 and set(rt.TASKS) <= set(r) for r in rows)


def test_orthogonalized_pushes_singular_values_toward_one_and_keeps_the_singular_vectors():
    optimizers = importlib.import_module("lm_optimizers")
    gen = torch.Generator().manual_seed(0)
    for shape in [(96, 32), (32, 96), (3, 48, 24)]:  # tall, wide, a batch
        g = torch.randn(*shape, generator=gen)
        s = torch.linalg.svdvals(optimizers.orthogonalized(g).float())
        assert s.min() > 0.6 and s.max() < 1.25, (shape, s.min(), s.max())
    # badly conditioned: five steps lift the large singular values only, but never turn a direction around
    g = torch.randn(64, 32, generator=gen) * torch.logspace(-3, 1, 32)
    u, sigma, vh = torch.linalg.svd(g, full_matrices=False)
    out = u.mT @ optimizers.orthogonalized(g).float() @ vh.mT  # diagonal when the singular vectors are kept
    diagonal = out.diagonal()
    assert (out - torch.diag(diagonal)).abs().max() < 0.05
    assert (diagonal > 0).all() and diagonal.max() < 1.3
    assert (diagonal[sigma > 0.1 * sigma[0]] > 0.5).all()


def test_muon_orthogonalises_each_stacked_matrix_and_leaves_the_rest_to_adamw():
    tsl = importlib.import_module("train_small_lm")
    optimizers = importlib.import_module("lm_optimizers")
    mod = tsl.load_model_module()
    model = mod.Transformer(mod.ModelArgs(**tsl.RETRIEVAL_SMOKE_MODEL, max_seq_len=64))
    args = type("Args", (), {"optimizer": "muon", "muon_lr": 0.02, "lr": 1e-3, "weight_decay": 0.1})()
    muon, adamw = optimizers.make_optimizers(model, args, torch.device("cpu"))
    hidden = {id(p) for group in muon.param_groups for p in group["params"]}
    assert id(model.tok_embeddings.weight) not in hidden and id(model.output.weight) not in hidden
    assert all(p.dim() == 2 for group in muon.param_groups for p in group["params"])
    rest = {id(p) for group in adamw.param_groups for p in group["params"]}
    assert hidden.isdisjoint(rest) and len(hidden) + len(rest) == len(list(model.parameters()))
    # a fused q/k/v weight is three matrices: each block of rows moves by its own polar factor
    attn = model.layers[0].attention
    wqkv = attn.wqkv.weight
    rows = (attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim)
    assert muon.row_splits[wqkv] == rows
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grad, before = wqkv.grad.clone(), wqkv.detach().clone()
    muon.step()
    step = (before - wqkv.detach()) / 0.02  # first step: the Nesterov update is 1.95 x the gradient
    start = 0
    for n in rows:
        part = grad[start:start + n]
        expected = optimizers.orthogonalized(part) * max(1.0, n / part.shape[1]) ** 0.5
        # bf16 iterations on 1.95 x grad against grad: equal up to bf16 rounding
        assert (step[start:start + n] - expected).norm() < 0.06 * expected.norm()
        start += n
    fused = optimizers.orthogonalized(grad)  # the fused matrix orthogonalised as one differs
    assert (step - fused).norm() > 0.2 * fused.norm()


def test_retrieval_training_smoke_with_each_optimizer(tmp_path):
    tsl = importlib.import_module("train_small_lm")
    for optimizer in ("muon", "adamw"):
        record = tsl.main(["--smoke", "--retrieval", "--steps", "2", "--max-train-bytes", "300000", "--eval-windows",
                           "1", "--optimizer", optimizer, "--out-dir", str(tmp_path / optimizer)])
        assert record["training"]["optimizer"]["name"].startswith("Muon" if optimizer == "muon" else "AdamW")
        assert all(math.isfinite(r["loss"]) for r in record["training"]["log"])


def test_mixed_phases_cycle_their_shapes_and_record_each_one(tmp_path):
    tsl = importlib.import_module("train_small_lm")
    phases = tsl.parse_phases("1024x2:1,1024x2|2048x1:3")
    assert [p.shapes for p in phases] == [((1024, 2),), ((1024, 2), (2048, 1))]
    assert [p.share for p in phases] == [0.25, 0.75]
    assert tsl.phase_shapes(phases) == [(1024, 2), (2048, 1)]
    mixed = tsl._phase_record(phases[1], 5)  # steps alternate: 1024, 2048, 1024, 2048, 1024
    assert [s["steps"] for s in mixed["shapes"]] == [3, 2] and mixed["tokens"] == 3 * 2048 + 2 * 2048
    assert tsl._phase_record(phases[0], 4)["seq_len"] == 1024  # a plain phase keeps the earlier records' fields
    record = tsl.main(["--smoke", "--retrieval", "--steps", "4", "--phases", "1024x2:1,1024x2|2048x1:1",
                       "--max-train-bytes", "300000", "--eval-windows", "1", "--eval-instances", "1",
                       "--out-dir", str(tmp_path)])
    assert record["training"]["steps"] == 4 and set(record["final"]) == {"1024", "2048"}
    assert [p["steps"] for p in record["training"]["phases"]] == [2, 2]


def test_phase_steps_fix_each_phase_count(tmp_path):
    tsl = importlib.import_module("train_small_lm")
    record = tsl.main(["--smoke", "--retrieval", "--phases", "1024x2:1,1024x2|2048x1:1", "--phase-steps", "1", "3",
                       "--max-train-bytes", "300000", "--eval-windows", "1", "--eval-instances", "1",
                       "--out-dir", str(tmp_path)])
    assert [p["steps"] for p in record["training"]["phases"]] == [1, 3]
    assert record["training"]["time_budget_s"] is None
    with pytest.raises(SystemExit, match="phase-steps"):
        tsl.main(["--smoke", "--retrieval", "--phase-steps", "1", "--out-dir", str(tmp_path)])
