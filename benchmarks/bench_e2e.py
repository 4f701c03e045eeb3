"""End-to-end prefill: time to first token of a Llama-3.1-8B-shaped model, dense and sparse, compiled as users do.

    python benchmarks/bench_e2e.py                                  # H100: 8K..128K, every method (> 10 min)
    python benchmarks/bench_e2e.py --lengths 65536 131072 --budget-lengths 65536 131072 --budgets-only
    python benchmarks/bench_e2e.py --from-jsonl results/runs/e2e.jsonl   # table + plot from (merged) rows
    python benchmarks/bench_e2e.py --smoke                          # CPU: tiny model, seconds
    python benchmarks/bench_e2e.py --front-door --lengths 65536 --budget-lengths 65536 --budgets 0.1 --methods pbs

A ``transformers`` ``LlamaForCausalLM`` built from a config (random bf16 weights, no download), batch 1, logits of
the last position only, called as ``model(ids)`` with its default cache. The whole model is compiled once
(``torch.compile(model, backend="sparse_prefill", dynamic=True)``), as a user would; ``--regional`` compiles each
decoder layer instead. On transformers <= 5.17 the traced graph builds the causal mask itself; the rewrite proves
it causal and drops it (``sparse_compile/masks.py``), so every row checks that all layers ran sparse. Contenders,
all on the same prompt:

* ``eager``: transformers' SDPA attention (cuDNN on the H100), no compilation;
* ``inductor``: the model compiled with ``backend="sparse_prefill"`` and sparsity switched off at run time
  (``sparsity(enabled=False)``): Inductor for everything, the causal cuDNN SDPA for attention (never a masked one).
  ``--inductor`` also compiles with ``backend="inductor"``: what plain ``torch.compile`` gives (on transformers
  <= 5.17 its SDPA reads a materialised N x N mask);
* ``<method>``: the same compiled model with each method at its defaults (``sparsity(method=...)``);
* ``<method>@ρ``: each method with its density parameter calibrated so that the selection keeps about ρ of the
  causal tiles (random weights make attention nearly uniform, so the defaults keep almost everything; fixed
  budgets show speed against density; ``budget_fixed`` holds SpargeAttn's judge off and BFLA's alpha at
  1/(g sqrt(C)) so that the targets are reachable);
* ``floor``: the same compiled model with its attention ops doing nothing: the non-attention time.

At each length every contender is set up first (compile, calibration, density, warm-up), then all are timed
alternately (every contender once per round, rounds in shuffled orders: ``harness.alternating_rounds``) with the SM
clock sampled after each run: the H100's clock drifts under sustained load. Reported per run: TTFT (median of
``--reps``), the mean SM clock, the achieved density (mean over sites and heads, from a separate recorded run), the number of attention calls that ran sparse in that run (it must equal the
number of layers), and end-to-end efficiency ``(t_floor + ρ·t_attn) / TTFT`` with
``t_attn = TTFT_inductor − t_floor``: the share of the possible gain the system delivers at its density.
The meta block records each compiled contender's first call (compile included). ``--mask-overhead`` times, at
the op, one layer's worth of calls per model layer with a tokenizer's all-ones ``attention_mask`` against none.
``--front-door`` times instead transformers' ``"sparse_prefill"`` attention implementation (no torch.compile:
``enable_transformers_attention(model, config)``, i.e. ``model.set_attn_implementation("sparse_prefill")``, run
eagerly) against the compiled model with the same configuration and the same ``sparsity(method=..., ...)`` region
at each setting, the dense compiled model (``inductor``) and transformers' SDPA (``eager``); rows carry
``mode: front_door``.
Writes the run's ``e2e.json``/``.md``/``.jsonl`` and a PNG plot (when matplotlib is present) under ``--out``
(default ``benchmarks/results/runs/``) and appends its rows to the store ``benchmarks/results/bench_e2e.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from harness import RUNS_DIR, alternating_rounds, sm_clock_mhz, write_results  # noqa: E402
from density_calibration import (METHODS, calibrate, dispatch_summary, method_spec,  # noqa: E402
                                 recorded_density, split_spec)
from e2e_model import (build_model, capture_qkv, compile_contenders, in_region,  # noqa: E402
                       register_noop_attention, sync, time_first_call, with_attention)


def partial_rows_file(args) -> Path:
    """The run's row-by-row file (emptied): a run cut short still leaves its measurements."""
    partial = (Path(args.out) if args.out else RUNS_DIR) / f"{args.name}.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    return partial


def timed_call(fn, ids, times: list, clocks: list) -> None:
    """One timed call of ``fn(ids)``: its wall time to ``times``, the SM clock after it to ``clocks``. Run-time
    statistics start empty, so what the caller reads after it is this call's dispatch."""
    sparse_compile.reset_runtime_stats()
    sync()
    started = time.perf_counter()
    fn(ids)
    sync()
    times.append(time.perf_counter() - started)
    clocks.append(sm_clock_mhz())


def record_times(row: dict, times: list, clocks: list) -> bool:
    """The median of ``times`` as the row's ``ttft_s``, the mean of the clocks read as its ``sm_clock_mhz``;
    False (the row left as it is) where nothing was timed."""
    if not times:
        return False
    t = sorted(times)
    row["ttft_s"] = t[len(t) // 2]
    mhz = [c for c in clocks if c]
    row["sm_clock_mhz"] = round(sum(mhz) / len(mhz)) if mhz else None
    return True


def summarize(rows: list, args, meta: dict) -> None:
    """Speedup over the fastest dense path and end-to-end efficiency per row; JSON + table + plot."""
    reference = {(r["N"], r["contender"]): r.get("ttft_s") for r in rows}
    for row in rows:
        n, t = row["N"], row.get("ttft_s")
        dense = [reference.get((n, c)) for c in ("eager", "inductor", "inductor (backend=inductor)")]
        dense = [d for d in dense if isinstance(d, float)]
        t_floor, t_ind = reference.get((n, "floor")), reference.get((n, "inductor"))
        if isinstance(t, float) and dense:
            row["speedup"] = min(dense) / t
        rho = row.get("density")
        if isinstance(t, float) and isinstance(t_floor, float) and isinstance(t_ind, float) and rho is not None:
            attn = max(t_ind - t_floor, 0.0)
            row["efficiency"] = (t_floor + min(rho, 1.0) * attn) / t
            row["best_possible_speedup"] = t_ind / (t_floor + min(rho, 1.0) * attn)
        if isinstance(t, float):
            row["ttft_ms"] = t * 1e3
    columns = ["N", "contender", "ttft_ms", "speedup", "density", "efficiency", "best_possible_speedup",
               "sparse_calls", "dispatch", "sm_clock_mhz", "params"]
    # a smoke run leaves the repository's store alone; --from-jsonl re-renders rows a run stored already
    skip_store = (args.smoke and not args.out) or (args.from_jsonl and not args.store)
    table = write_results(args.name, rows, meta=meta, columns=columns, out_dir=args.out,
                          store=None if skip_store else "bench_e2e",
                          params=("N",))
    print(table)
    plot(rows, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), type=method_spec,
                        help="method names, or name:field=value,... for non-default parameters at the defaults' row")
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.3, 0.5])
    parser.add_argument("--budget-lengths", type=int, nargs="*", default=[32768, 131072],
                        help="lengths at which the fixed-density runs are made")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-reps", type=int, default=1, help="timed runs of each fixed-density setting")
    parser.add_argument("--inductor", action="store_true", help="also compile with backend='inductor'")
    parser.add_argument("--skip-defaults", action="store_true",
                        help="time the dense baselines and the fixed densities, not the methods at their defaults")
    parser.add_argument("--budgets-only", action="store_true",
                        help="only the fixed-density runs (merge with a run that has the dense rows, --from-jsonl)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 32)")
    parser.add_argument("--skip-eager", action="store_true", help="leave out uncompiled transformers (saves time)")
    parser.add_argument("--eager-floor", action="store_true", help="also time the non-attention floor uncompiled")
    parser.add_argument("--regional", action="store_true",
                        help="compile each decoder layer (regional compilation) instead of the whole model")
    parser.add_argument("--mask-overhead", action="store_true",
                        help="also time the op with an all-ones attention_mask against none (no model compile)")
    parser.add_argument("--front-door", action="store_true",
                        help="transformers' 'sparse_prefill' attention implementation (eager, no torch.compile) "
                             "against the compiled model, at the same settings")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, for testing the script")
    parser.add_argument("--out", default=None, help="this run's files and its store rows (default: the run's files in "
                        "benchmarks/results/runs, the rows in benchmarks/results/bench_e2e.jsonl)")
    parser.add_argument("--name", default="e2e")
    parser.add_argument("--from-jsonl", default=None,
                        help="render the table and plot from the rows a (possibly cut short) run wrote")
    parser.add_argument("--store", action="store_true",
                        help="with --from-jsonl: also append the rows to the store (a run cut short before it did)")
    args = parser.parse_args()
    if args.from_jsonl:
        rows = [json.loads(line) for line in Path(args.from_jsonl).read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: r["N"])  # runs merged from several calls: by length, run order within
        args.budget_lengths = sorted({r["N"] for r in rows if "@" in r["contender"]}) or args.budget_lengths
        summarize(rows, args, meta={"model": "Llama-3.1-8B shape", "dtype": "torch.bfloat16", "batch": 1,
                                    "source": str(args.from_jsonl)})
        return

    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.smoke:
        args.lengths = [n for n in args.lengths if n <= 512] or [256, 384]
        args.budget_lengths = [args.lengths[-1]]
    base = sparse_compile.SparseConfig(min_seq_len=4096 if not args.smoke else 128)
    if args.smoke:  # blocks small enough for a few-hundred-token prompt
        base = sparse_compile.SparseConfig(
            min_seq_len=128, pbs={"block_size": 32, "segment_size": 64},
            sparge={"block_size_q": 32, "block_size_kv": 32},
            bfla={"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32},
            s2o={"segment_size": 64, "block_size_q": 32, "block_size_kv": 32})
    options = {"min_seq_len": base.min_seq_len, **{m: base.params_of(m) for m in ("pbs", "sparge", "bfla", "s2o")}}

    torch.manual_seed(0)
    model = build_model(args.smoke, device, dtype, num_layers=args.layers)
    num_layers = model.config.num_hidden_layers
    if args.regional:
        # regional compilation recompiles each decoder layer once (transformers' cache update indexes the cache by
        # the layer's constant layer_idx, and Dynamo guards on it); past Dynamo's default limit of 8 the remaining
        # layers silently run eager, i.e. dense. Allow one entry per layer and per compiled contender.
        limit = 4 * num_layers + 8
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        torch._dynamo.config.accumulated_recompile_limit = max(
            getattr(torch._dynamo.config, "accumulated_recompile_limit", 0), 8 * limit)
    if args.front_door:
        return front_door(model, base, options, args, device, dtype)
    noop = register_noop_attention()
    run = lambda m: (lambda ids: m(ids, logits_to_keep=1))  # noqa: E731

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    compiled, inductor, compiled_floor = compile_contenders(model, options, args)

    def floor_compiled(ids):
        return compiled_floor(ids, logits_to_keep=1)

    partial = partial_rows_file(args)
    rows: list = []
    first_call: dict = {}  # compiled callable -> seconds of its first call (Dynamo + Inductor compile included)

    eager_floor = with_attention(model, noop, run(model))

    total = sum((0 if args.budgets_only else 4 - args.skip_eager + args.eager_floor + bool(inductor)
                 + len(args.methods) * (not args.skip_defaults))
                + (len(args.methods) * len(args.budgets) if n in args.budget_lengths else 0) for n in args.lengths)
    bar = tqdm(total=total, desc="prefill", unit="contender") if tqdm else None
    for n in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        # 1. set up every contender at this length: compile, calibrate, record density, warm up
        entries = []  # (row, fn, reps)
        if not args.budgets_only:
            if not args.skip_eager:
                entries.append(({"contender": "eager"}, run(model), args.reps))
            if args.eager_floor:
                entries.append(({"contender": "floor (eager)"}, eager_floor, args.reps))
            time_first_call(first_call, "sparse_prefill", in_region(run(compiled), enabled=False), ids)
            entries.append(({"contender": "inductor", "sparse_calls": 0}, in_region(run(compiled), enabled=False),
                            args.reps))
            entries.append(({"contender": "floor"}, floor_compiled, args.reps))
            if inductor is not None:
                time_first_call(first_call, "inductor", run(inductor), ids)
                entries.append(({"contender": "inductor (backend=inductor)"}, run(inductor), args.reps))
        budgets = ([None] * (not (args.budgets_only or args.skip_defaults))
                   + (list(args.budgets) if n in args.budget_lengths else []))
        qk = None  # this length's captured query/key, for calibration
        for budget in budgets:
            for spec in args.methods:
                method, params = split_spec(spec)
                row = {"contender": spec if budget is None else f"{method}@{budget}", "params": ""}
                if params and budget is not None:
                    continue  # a fixed density calibrates the method's own knob from its defaults
                try:
                    if budget is not None:
                        qk = qk or capture_qkv(model, ids)[:2]
                        params, _ = calibrate(method, budget, [qk], base)
                        row["params"] = ", ".join(f"{k}={v:.4g}" for k, v in params.items())
                    time_first_call(first_call, "sparse_prefill", run(compiled), ids)
                    row["density"], row["sparse_calls"] = recorded_density(run(compiled), ids, method, params)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    row["ttft_s"] = "OOM"
                # at fixed densities every layer must run the method (a dense layer would not measure it); at the
                # defaults the break-even dispatch may send layers to dense attention: the timed runs record that
                if budget is not None and row.get("sparse_calls") != num_layers:
                    print(f"warning: {method} at {n}: {row.get('sparse_calls')} of {num_layers} attention layers "
                          "ran sparse", file=sys.stderr)
                entries.append((row, in_region(run(compiled), method=method, **params),
                                args.reps if budget is None else args.budget_reps))
        times: dict = {id(row): [] for row, _, _ in entries}
        clocks: dict = {id(row): [] for row, _, _ in entries}
        live = [(row, fn, reps) for row, fn, reps in entries if row.get("ttft_s") != "OOM"]
        with torch.no_grad():
            for row, fn, _ in live:  # warm-up of the methods: density recording ran other kernel variants
                if "density" not in row and (row["contender"] != "eager" or n != args.lengths[0]):
                    continue  # compiled dense contenders ran at their timed first call; eager once per process
                try:
                    fn(ids)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    row["ttft_s"] = "OOM"
            live = [e for e in live if e[0].get("ttft_s") != "OOM"]
            # 2. time them alternately (shuffled rounds): the clock drifts under sustained load
            for round_, order in enumerate(alternating_rounds(live, max([reps for _, _, reps in live] or [0]))):
                for row, fn, reps in order:
                    if round_ >= reps:
                        continue
                    timed_call(fn, ids, times[id(row)], clocks[id(row)])
                    if "density" in row:  # which way the method's calls went in the timed run, and why
                        row["dispatch"] = dispatch_summary(sparse_compile.runtime_stats())
        for row, _, _ in entries:
            row["N"] = n
            record_times(row, times[id(row)], clocks[id(row)])
            rows.append(row)
            with partial.open("a") as f:  # row by row: a run cut short still leaves its measurements
                f.write(json.dumps(row) + "\n")
            if bar:
                bar.update(1)

    meta = {"model": "Llama-3.1-8B shape" if not args.smoke else "tiny", "dtype": str(dtype), "batch": 1,
            "reps": args.reps, "min_seq_len": base.min_seq_len, "device": device,
            "compile": "regional" if args.regional else "whole model", "first_call_s": first_call}
    if args.mask_overhead:
        meta["mask_overhead"] = mask_overhead(model, args.lengths, device, dtype, args.smoke)
        print("all-ones attention_mask at the op:", json.dumps(meta["mask_overhead"]))
    summarize(rows, args, meta=meta)


def front_door(model, base, options: dict, args, device: str, dtype) -> None:
    """``--front-door``: per length and setting (each method at its defaults, and at the fixed densities at the
    budget lengths, calibrated once and given to both), transformers' ``"sparse_prefill"`` attention run eagerly
    against the compiled model, alternated with the dense compiled model and transformers' SDPA."""
    num_layers = model.config.num_hidden_layers
    compiled = torch.compile(model, backend=functools.partial(sparse_compile.sparse_prefill, options=options),
                             dynamic=True)
    sparse_compile.enable_transformers_attention(model, base)  # the front door's configuration: the same as compiled
    model.config._attn_implementation = "sdpa"  # what the compiled model traces; the front door switches per call

    front = with_attention(model, "sparse_prefill", lambda ids: model(ids, logits_to_keep=1))

    def compiled_run(ids):
        return compiled(ids, logits_to_keep=1)

    rows: list = []
    first_call: dict = {}
    partial = partial_rows_file(args)
    for n in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        entries = []  # (row, fn)
        time_first_call(first_call, "inductor", in_region(compiled_run, enabled=False), ids)
        if not args.skip_eager:
            entries.append(({"contender": "eager", "path": "eager"}, lambda ids: model(ids, logits_to_keep=1)))
        entries.append(({"contender": "inductor", "path": "compiled dense"}, in_region(compiled_run, enabled=False)))
        settings = [(m, None, {}) for m in args.methods if not args.skip_defaults]
        if n in args.budget_lengths and args.budgets:
            qk = capture_qkv(model, ids)[:2]
            settings += [(m, b, calibrate(m, b, [qk], base)[0]) for b in args.budgets for m in args.methods]
        for method, budget, params in settings:
            setting = method if budget is None else f"{method}@{budget}"
            for path, fn in (("front door", front), ("compiled", compiled_run)):
                row = {"contender": f"{path} {setting}", "path": path, "setting": setting,
                       "params": ", ".join(f"{k}={v:.4g}" for k, v in params.items())}
                try:  # one recorded run each (not timed): the density, and every layer's call counted
                    row["density"], row["sparse_calls"] = recorded_density(fn, ids, method, params)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    row["ttft_s"] = "OOM"
                    continue
                if budget is not None and row["sparse_calls"] != num_layers:
                    print(f"warning: {row['contender']} at {n}: {row['sparse_calls']} of {num_layers} attention "
                          "layers ran sparse", file=sys.stderr)
                entries.append((row, in_region(fn, method=method, **params)))
        live = [(row, fn) for row, fn in entries if row.get("ttft_s") != "OOM"]
        times: dict = {id(row): [] for row, _ in entries}
        clocks: dict = {id(row): [] for row, _ in entries}
        with torch.no_grad():
            for row, fn in live:  # warm-up: density recording ran other kernel variants; eager once per process
                if "setting" in row or (row["path"] == "eager" and n == args.lengths[0]):
                    fn(ids)
            for order in alternating_rounds(live, args.reps):
                for row, fn in order:
                    timed_call(fn, ids, times[id(row)], clocks[id(row)])
                    if "setting" in row:  # the timed run's own count: the recorded one used other kernel variants
                        stats = sparse_compile.runtime_stats()
                        row["dispatch"] = dispatch_summary(stats)
                        row["timed_sparse_calls"] = sum(c for s in stats.values()
                                                        for (p, _), c in s.calls.items() if p == "sparse")
        reference = None
        for row, _ in entries:
            row.update(N=n, mode="front_door")
            if record_times(row, times[id(row)], clocks[id(row)]):
                row["ttft_ms"] = row["ttft_s"] * 1e3
                if row["contender"] == "inductor":
                    reference = row["ttft_s"]
        for row, _ in entries:
            if isinstance(row.get("ttft_s"), float) and reference:
                row["speedup_vs_inductor"] = reference / row["ttft_s"]
            rows.append(row)
            with partial.open("a") as f:  # row by row: a run cut short still leaves its measurements
                f.write(json.dumps(row) + "\n")
    # the compiled path against the front door, per setting and length: > 1 where the front door is slower
    by_key = {(r["N"], r.get("path"), r.get("setting")): r.get("ttft_s") for r in rows}
    for row in rows:
        other = by_key.get((row["N"], "compiled", row.get("setting")))
        if row.get("path") == "front door" and isinstance(other, float) and isinstance(row.get("ttft_s"), float):
            row["front_door_over_compiled"] = row["ttft_s"] / other
    meta = {"model": "Llama-3.1-8B shape" if not args.smoke else "tiny", "dtype": str(dtype), "batch": 1,
            "reps": args.reps, "min_seq_len": base.min_seq_len, "device": device, "mode": "front door",
            "first_call_s": first_call}
    columns = ["N", "contender", "ttft_ms", "speedup_vs_inductor", "front_door_over_compiled", "density",
               "sparse_calls", "timed_sparse_calls", "dispatch", "sm_clock_mhz", "params"]
    skip_store = args.smoke and not args.out  # a smoke run leaves the repository's store alone
    print(write_results(args.name, rows, meta=meta, columns=columns, out_dir=args.out,
                        store=None if skip_store else "bench_e2e", params=("N",)))


def mask_overhead(model, lengths, device, dtype, smoke: bool, rounds: int = 5) -> list:
    """Per length: one forward's worth of attention calls (one per layer, one shared mask tensor as in the compiled
    model) with an all-ones ``attention_mask`` and without, alternated, medians. The mask is summarised once per
    tensor (one device-to-host read), so the two should not differ measurably."""
    from sparse_compile.site import SiteSpec

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    config = sparse_compile.SparseConfig(min_seq_len=128 if smoke else 4096)
    spec = SiteSpec("mask_overhead", config, enable_gqa=True, queries_last=True).to_json()
    op = torch.ops.sparse_compile.causal_attention
    out = []
    for n in lengths:
        q = torch.randn(1, heads, n, dim, device=device, dtype=dtype)
        k = torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)

        def forward(with_mask: bool):
            mask = torch.ones(1, n, dtype=torch.long, device=device) if with_mask else None  # new per forward
            sync()
            started = time.perf_counter()
            for _ in range(layers):
                op(q, k, v, None, spec, mask)
            sync()
            return time.perf_counter() - started

        with torch.no_grad():
            forward(True), forward(False)
            times = {True: [], False: []}
            for _ in range(rounds):
                for flag in (True, False):
                    times[flag].append(forward(flag))
        med = {flag: sorted(t)[len(t) // 2] for flag, t in times.items()}
        out.append({"N": n, "layers": layers, "no_mask_ms": med[False] * 1e3, "ones_mask_ms": med[True] * 1e3,
                    "overhead_ms": (med[True] - med[False]) * 1e3})
    return out


def plot(rows, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    out = Path(args.out) if args.out else RUNS_DIR
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    contenders = [c for c in dict.fromkeys(r["contender"] for r in rows) if "@" not in c]
    for c in contenders:
        pts = [(r["N"], r["ttft_ms"]) for r in rows if r["contender"] == c and "ttft_ms" in r]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=c)
    ax1.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)", title="time to first token")
    ax1.legend(fontsize=7)
    for m in args.methods:
        pts = sorted((r["density"], r["speedup"]) for r in rows
                     if r["contender"].startswith(m) and r["N"] == max(args.budget_lengths or [0])
                     and isinstance(r.get("density"), float) and "speedup" in r)
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=m)
    n_top = max(args.budget_lengths or [0])
    ref = {r["contender"]: r.get("ttft_ms") for r in rows if r["N"] == n_top}
    if isinstance(ref.get("floor"), float) and isinstance(ref.get("inductor"), float):
        # what a system with no overhead would reach: floor + rho * dense attention
        t_floor, t_ind = ref["floor"], ref["inductor"]
        rhos = [i / 20 for i in range(1, 21)]
        ax2.plot(rhos, [t_ind / (t_floor + r * (t_ind - t_floor)) for r in rhos], "k--", lw=1,
                 label="no-overhead bound")
    ax2.set(xlabel="achieved density", ylabel="speedup over fastest dense",
            title=f"speed vs density at {max(args.budget_lengths or [0])} tokens")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
