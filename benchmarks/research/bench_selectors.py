"""Selectors against retrieval on CPU: a few prompts at 8K-16K through the retrieval model, each attention call run by
``sparse_compile.sparse_attention`` with one contender's configuration.

    python benchmarks/research/bench_selectors.py --lengths 8192 --per-family 1 --per-task 1   # CPU: ~2 min per contender

Contenders: ``dense``; ``sampled`` at ``--budget``; ``antidiag`` over ``--strides`` x ``--row-strides`` x
``--temperatures`` x ``--antidiagonals`` (temperature ``inv`` = 1/S) at ``--budget``; PBS's selector without its
permutation (``pbs-noperm``), ``pbs`` and ``sparge`` with their knob calibrated (``density_calibration.calibrate``)
to the mean density ``--density`` on the first prompt's dense (q, k). Prompts: the held-out retrieval families
(reworded needles, the formats the model never trained on) and the trained task styles. Per contender: values
retrieved exactly (relative to dense) and the measured plan density; and, from the dense run's (q, k), for every
row that predicts a value byte, whether the contender's plan of its reading head (the (layer, head) putting the
most mass on the needle) lists the needle byte that head reads (``rows_listed``; needs no sparse forward, so it is
free of the model's cascade).
Rows: ``results/bench_selectors.jsonl`` (``harness.append_store``, one contender at a time).

``--plan-only`` skips the sparse forwards and scores only ``rows_listed`` for the sampled-row ranking at each
``--sample-every``, two ways: ``mass`` (the ``sampled`` selector: each tile's softmax mass, two passes with exp) and
``max`` (each tile's largest score minus its row's max over the block's sampled rows: one pass, no exp), the
question being whether a cheaper one-pass planner ranks tiles as well:

    python benchmarks/research/bench_selectors.py --plan-only --sample-every 8 16 32 64 \
        --checkpoint benchmarks/checkpoints/retrieval_families_lm.pt                   # CPU: ~3 min
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the maintained helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sparse_compile  # noqa: E402
import retrieval_families as rf  # noqa: E402
import retrieval_tasks as rt  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from density_calibration import calibrate  # noqa: E402
from harness import append_store, format_table  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402

NEEDLE_BYTES = 50  # a needle line's span: its key and its value


def sampled_max_scores(q, k, scale: float, block: int, every: int) -> torch.Tensor:
    """(B, Hq, nqb, nkt): per query block and key tile, the max over the block's sampled rows (``sampled``'s rows)
    of the tile's largest causal score minus the row's largest score; one pass, no exp (a reference, O(rows x N))."""
    from sparse_compile.methods.sampled import sampled_rows

    batch, heads, num_queries, _ = q.shape
    num_keys = k.shape[2]
    rows = sampled_rows(num_queries, block, every, q.device)
    per = max(1, block // every)
    z = q[:, :, rows].float() @ k.float().repeat_interleave(heads // k.shape[1], 1).transpose(-1, -2) * scale
    z = z.masked_fill(torch.arange(num_keys)[None, :] > (rows + num_keys - num_queries)[:, None], float("-inf"))
    z = z - z.amax(-1, keepdim=True)
    tiles = -(-num_keys // block)
    z = torch.nn.functional.pad(z, (0, tiles * block - num_keys), value=float("-inf"))
    return z.view(batch, heads, -1, per, tiles, block).amax(-1).amax(-2)


@contextlib.contextmanager
def attention_by(model, config, capture=None, values: bool = False):
    """Inside the block the model's attention calls run ``sparse_compile.sparse_attention`` with ``config`` (None:
    dense SDPA); ``capture`` collects each call's (q, k), or (q, k, v) with ``values``. Only this model's module sees
    the replacement."""
    module = sys.modules[type(model.layers[0].attention).__module__]
    functional = module.F

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal and attn_mask is None, "the example model's call only"
        if capture is not None:
            # the readers of a capture score it at the default scale 1/sqrt(D)
            assert scale is None, "a captured call must use the default scale"
            capture.append(tuple(x.detach().clone() for x in ((q, k, v) if values else (q, k))))
        if config is None:
            return functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                           enable_gqa=enable_gqa)
        return sparse_compile.sparse_attention(q, k, v, scale=scale, config=config)

    module.F = types.SimpleNamespace(**{n: getattr(functional, n) for n in dir(functional) if not n.startswith("__")})
    module.F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        module.F = functional


def reading_heads(layers: list, answer) -> list:
    """Per row that predicts a value byte: (layer, query head, the needle byte it reads) of the head whose dense
    attention row puts the most mass on the needle."""
    rows = torch.arange(answer.start - 1, answer.end - 1)
    needle = torch.arange(answer.needle_start, answer.needle_start + NEEDLE_BYTES)
    best = [(-1.0, None)] * len(rows)
    for layer, (q, k) in enumerate(layers):
        for h in range(q.shape[1]):
            kv = k[0, h * k.shape[1] // q.shape[1], : int(rows[-1]) + 1].float()
            logits = q[0, h, rows].float() @ kv.T / math.sqrt(q.shape[-1])
            logits = logits.masked_fill(torch.arange(kv.shape[0])[None, :] > rows[:, None], float("-inf"))
            on_needle = torch.softmax(logits, -1)[:, needle]
            for i, (mass, read) in enumerate(zip(on_needle.sum(-1).tolist(), on_needle.argmax(-1).tolist())):
                if mass > best[i][0]:
                    best[i] = (mass, (layer, h, int(needle[read])))
    return [(int(r), who) for r, (_, who) in zip(rows, best)]


def listed(plan, head: int, heads: int, row: int, key: int) -> bool:
    """Whether ``plan`` (batch 0, identity order) lists ``key``'s tile for query head ``head`` (of ``heads``) in the
    query block of ``row``."""
    head = head * plan.tile_offsets.shape[1] // heads
    block = row // plan.block_m
    offsets = plan.tile_offsets[0, head, block, : int(plan.tile_counts[0, head, block])].long()
    return bool(((offsets <= key) & (key < offsets + plan.block_n)).any())


def plan_only(args, base, instances, dense_layers, readers, length, done) -> None:
    """``--plan-only``: rows_listed of the sampled-row ranking by mass and by max at each sample rate."""
    from sparse_compile.methods.tiles import finish_budget_plan
    from sparse_compile.methods.scoring import Reordering
    from sparse_compile.methods.peak import peak_tile_scores
    from sparse_compile.methods.sampled import SampledParams, sampled_tile_logits
    from sparse_compile.registry import NO_REORDER

    for every in args.sample_every:
        params = base.with_overrides("sampled", {"budget": args.budget, "sample_every": every}).params_of(
            SampledParams)
        for score in ("mass", "max", "peak"):
            started, listed_rows = time.perf_counter(), []
            for n, layers in enumerate(dense_layers):
                plans = []
                for q, k in layers:
                    scale = 1.0 / math.sqrt(q.shape[-1])
                    scores = (sampled_tile_logits(q, k, scale, params.block_size, every) if score == "mass" else
                              sampled_max_scores(q, k, scale, params.block_size, every) if score == "max" else
                              peak_tile_scores(q, k, scale, params.block_size, every, params.keep_first_block))
                    plans.append(finish_budget_plan(scores, q, k, Reordering(NO_REORDER), params))
                heads = layers[0][0].shape[1]
                listed_rows += [listed(plans[layer], head, heads, row, key) for row, (layer, head, key) in readers[n]]
            done({"N": length, "contender": f"sampled/{score}/every{every}", "rows_listed":
                  sum(listed_rows) / len(listed_rows), "rows": len(listed_rows),
                  "params": f"budget={args.budget}, sample_every={every}, score={score}",
                  "seconds": round(time.perf_counter() - started, 1)})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--per-family", type=int, default=1, help="instances per held-out family (3 queries each)")
    parser.add_argument("--per-task", type=int, default=1, help="instances per trained task (vkey style)")
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--row-strides", nargs="+", default=["S", "2"],
                        help="row_stride: a number or S (= the stride: XAttention's square antidiagonal)")
    parser.add_argument("--temperatures", nargs="+", default=["1", "inv"], help="temperature_factor: a number or inv")
    parser.add_argument("--antidiagonals", type=int, nargs="+", default=[2])
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--density", type=float, default=0.1, help="calibration target of pbs, pbs-noperm, sparge")
    parser.add_argument("--baselines", nargs="*", default=["sampled", "pbs-noperm", "pbs", "sparge"])
    parser.add_argument("--checkpoint", default=str(tsl.REPO / "benchmarks" / "checkpoints" / "retrieval_lm.pt"))
    parser.add_argument("--out", default=None, help="store folder (default benchmarks/results)")
    parser.add_argument("--plan-only", action="store_true",
                        help="rows_listed of the sampled-row ranking (mass and max) at each --sample-every only")
    parser.add_argument("--sample-every", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = tsl.load_checkpoint(args.checkpoint, device="cpu", dtype=torch.float32)
    corpus = tsl.build_corpus(1 << 20)
    base = sparse_compile.SparseConfig(min_seq_len=1024, dense_when_faster=False, record_density=True)
    rows = []
    extra = {"checkpoint": Path(args.checkpoint).name, "per_family": args.per_family, "per_task": args.per_task}

    def done(row):  # each row stored as it comes: a long run stopped early keeps what it measured
        rows.append(row)
        print(row, flush=True)
        append_store("bench_selectors", [row], params=("N",), out_dir=args.out, extra=extra)

    for length in args.lengths:
        frng, trng = random.Random(5_555_555 + length), random.Random(7_777_777 + length)
        instances = [i for f in rf.HELDOUT_FAMILIES for i in rf.make_batch([f.name] * args.per_family,
                                                                              corpus.heldout, length, frng)]
        instances += [i for t in rt.TASKS for i in rt.make_batch([t] * args.per_task, corpus.heldout, length, trng,
                                                                 "vkey")]
        # the dense run first: its accuracy, and each prompt's (q, k) per layer (calibration, coverage)
        dense_layers, results, started = [], [], time.perf_counter()
        for inst in instances:
            capture = []
            with attention_by(model, None, capture):
                logits = model(inst.tokens[None].long())[0]
            results += [r["exact"] for r in rt.score(logits.float(), inst)]
            dense_layers.append(capture)
        dense_exact = sum(results) / len(results)
        readers = [[x for answer in inst.answers for x in reading_heads(layers, answer)]
                   for inst, layers in zip(instances, dense_layers)]
        done({"N": length, "contender": "dense", "exact": dense_exact, "relative": 1.0, "values": len(results),
              "seconds": round(time.perf_counter() - started, 1)})
        if args.plan_only:
            plan_only(args, base, instances, dense_layers, readers, length, done)
            continue
        contenders = []
        if "sampled" in args.baselines:
            contenders.append(("sampled", base.with_overrides("sampled", {"budget": args.budget}),
                               {"budget": args.budget}))
        for stride in args.strides:
            for rows_per in dict.fromkeys(stride if r == "S" else int(r) for r in args.row_strides):
                for temp in args.temperatures:
                    for count in args.antidiagonals:
                        factor = None if temp == "inv" else float(temp)
                        params = {"score_stride": stride, "row_stride": rows_per, "temperature_factor": factor,
                                  "antidiagonals": count, "budget": args.budget}
                        contenders.append((f"antidiag/S{stride}/R{rows_per}/t{temp}/a{count}",
                                           base.with_overrides("antidiag", params), params))
        for m in args.baselines:  # knobs calibrated on the first prompt's dense (q, k)
            if m in ("pbs", "pbs-noperm", "sparge"):
                method, reorder = ("pbs", "none") if m == "pbs-noperm" else (m, None)
                knob, _ = calibrate(method, args.density, dense_layers[0], base, reorder=reorder, steps=12)
                config = base.with_overrides(method, knob)
                contenders.append((f"{m}@{args.density}", config.replace(reorder=reorder) if reorder else config,
                                   knob))
        for name, config, params in contenders:
            started = time.perf_counter()
            results, listed_rows, values = [], [], []
            for n, inst in enumerate(instances):
                sparse_compile.reset_runtime_stats()
                with attention_by(model, config):
                    logits = model(inst.tokens[None].long())[0]
                results += [r["exact"] for r in rt.score(logits.float(), inst)]
                stats = sparse_compile.runtime_stats().get("sparse_attention")
                if stats is not None and stats.mean_density is not None:
                    values.append(stats.mean_density)
                plans = [build_plan(q, k, None, config) for q, k in dense_layers[n]]
                if all(p.key_index is None and p.query_index is None for p in plans):
                    heads = dense_layers[n][0][0].shape[1]
                    for row, (layer, head, key) in readers[n]:
                        listed_rows.append(listed(plans[layer], head, heads, row, key))
            exact = sum(results) / len(results)
            row = {"N": length, "contender": name, "exact": exact, "relative": exact / dense_exact if dense_exact
                   else None, "values": len(results), "density": sum(values) / len(values) if values else None,
                   "rows_listed": sum(listed_rows) / len(listed_rows) if listed_rows else None,
                   "params": ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in params.items()),
                   "seconds": round(time.perf_counter() - started, 1)}
            done(row)
    print(format_table(rows, ["N", "contender", "exact", "relative", "density", "rows_listed", "values", "params"]))


if __name__ == "__main__":
    main()
