"""Break-even table (``sparse_compile/breakeven_tables.json``) and the "never slower than dense" check.

    python benchmarks/bench_breakeven.py --measure            # GPU: the table for this GPU (its own entry)
    python benchmarks/bench_breakeven.py --verify             # GPU: each method at its defaults vs cuDNN
    python benchmarks/bench_breakeven.py --memory             # GPU: peak extra memory per method, 64K-256K
    python benchmarks/bench_breakeven.py --tiles              # GPU: each method's plans per tile vs our dense kernel
    python benchmarks/bench_breakeven.py --s2o-parts          # GPU: where S2O's time per visited tile goes

``--measure``: per length and per default plan shape of every registered method, the sparse kernel's time with
every causal tile kept (early stop and P.V skip present but inert, so their branches cost what they cost) and the
selection time, each over cuDNN's dense causal time. All three are timed alternately in one loop (the clock
drifts under load), medians. Writes this GPU's own entry of the table (``--table``), keyed ``sm_90:NVIDIA H200``;
a GPU without its own entry reads its architecture's (``sm_90``, measured on an H100).

``--verify``: ``sparse_attention`` at each method's defaults against cuDNN SDPA on the same inputs, random and
structured (``bench_methods.structured_inputs``), alternately timed, medians, after warm-up calls that give each
site its density history: the ratio, the path taken and why. The target is <= 1.02x cuDNN everywhere.

``--memory``: peak memory above the inputs for cuDNN and each method at its defaults.
Shape: bf16, B=1, 32 query / 8 KV heads, head dim 128 (Llama-3.1-8B attention). Each mode appends its rows to the
store ``benchmarks/results/bench_breakeven.jsonl`` (tagged ``mode``); the run's tables go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from sparse_compile import SparseConfig  # noqa: E402
from sparse_compile.breakeven import HISTORY, TABLE_FILE, device_keys, plan_shape  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.methods import execute  # noqa: E402
from sparse_compile.site import SiteSpec  # noqa: E402
from sparse_compile.plan import execute_plan  # noqa: E402
from sparse_compile.registry import registered_methods  # noqa: E402

from harness import alternating_samples, sm_clock_mhz, write_results  # noqa: E402

HQ, HKV, D = 32, 8, 128


def alternate(contenders: dict, reps: int, calls: int = 1, queue_ahead: bool = False) -> dict:
    """Median milliseconds of each callable and, as ``<name>_mean``, the means (``harness.alternating_samples``:
    every contender once per round in shuffled orders, after two warm-up rounds, which also let a density history
    land). With a ``cudnn`` contender, ``<name>_paired``: the median over rounds of the round's time over cuDNN's in
    the same round (the clock drifts between rounds, less within one)."""
    times = alternating_samples(contenders, reps, calls=calls, queue_ahead=queue_ahead)
    out = {name: statistics.median(t) for name, t in times.items()} | {
        f"{name}_mean": statistics.fmean(t) for name, t in times.items()}
    if "cudnn" in times:
        out |= {f"{name}_paired": statistics.median(a / b for a, b in zip(t, times["cudnn"]))
                for name, t in times.items()}
    return out


def random_inputs(n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def in_model_layout(*tensors):
    """The same values laid out as a transformers model passes them: (B, H, N, D) views of (B, N, H, D) memory
    (the projection's output, transposed)."""
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors)


def cudnn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def inert_full_plan_config(method: str) -> SparseConfig:
    """The method's defaults with every causal tile kept, its early stop / P.V skip present but never firing."""
    defaults = SparseConfig(method=method).params_of(method)
    config = SparseConfig(method=method).keep_all()
    params = config.params_of(method)
    if getattr(defaults, "early_stop", 0) > 0:
        params = params.updated({"early_stop": 1e-30})
    if getattr(defaults, "pv_threshold", None) is not None:
        params = params.updated({"pv_threshold": -1e30})
    return config.replace(**{method: params})


def measure(args) -> None:
    arch = device_keys(torch.device("cuda"))[0]  # this GPU's own entry: its break-even points, not its family's
    table = json.loads(Path(args.table).read_text()) if Path(args.table).exists() else {}
    entry = table.setdefault(arch, {})
    rows = []
    for n in args.lengths:
        q, k, v = random_inputs(n)
        scale = 1.0 / math.sqrt(D)
        for method in args.methods:
            defaults = SparseConfig(method=method)
            full = inert_full_plan_config(method)
            full_plan = build_plan(q, k, scale, full)
            shape = plan_shape(build_plan(q, k, scale, defaults), method)  # keyed by the selector too
            # the method's own executor (S2O: segment chunks), as the op runs it
            run_full = lambda: execute(q, k, v, full_plan, scale, full, kernel="triton", return_visited=False)  # noqa: E731
            ms = alternate({
                "cudnn": lambda: cudnn(q, k, v),
                "kernel": run_full,
                "select": lambda: build_plan(q, k, scale, defaults),
            }, args.reps, queue_ahead=args.queue_ahead)
            row = {"N": n, "method": method, "shape": shape, "cudnn_ms": ms["cudnn"], "kernel_ms": ms["kernel"],
                   "select_ms": ms["select"], "kernel": ms["kernel"] / ms["cudnn"],
                   "select": ms["select"] / ms["cudnn"], "sm_clock_mhz": sm_clock_mhz()}
            row["break_even"] = (1 - row["select"]) / row["kernel"]  # the tie (the op keeps a MARGIN below it)
            rows.append(row)
            entry.setdefault(shape, {})[str(n)] = {"kernel": round(row["kernel"], 4), "select": round(row["select"], 4)}
            print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    Path(args.table).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(write_results(f"{args.name}_table", rows, out_dir=args.out, **_store("table"),
                        columns=["N", "method", "shape", "cudnn_ms", "kernel", "select", "break_even",
                                 "sm_clock_mhz"]))


def verify(args) -> None:
    from bench_methods import structured_inputs

    sparse_compile.breakeven._TABLES = None  # read the table again: --measure may just have written it

    rows = []
    for n in args.lengths:
        for inputs in ("random", "structured"):
            q, k, v = random_inputs(n) if inputs == "random" else structured_inputs(n, device="cuda")
            if args.layout == "model":
                q, k, v = in_model_layout(q, k, v)
            for method in args.methods:
                HISTORY.clear()
                sparse_compile.reset_runtime_stats()
                config = SparseConfig(method=method, min_seq_len=4096)
                spec = SiteSpec("op", config, enable_gqa=True).to_json()
                ms = alternate({
                    "cudnn": lambda: cudnn(q, k, v),
                    "sparse": lambda: sparse_compile.sparse_attention(q, k, v, config=config),
                    # the registered op as the compiled graph calls it (its own site, its own history)
                    "op": lambda: torch.ops.sparse_compile.causal_attention(q, k, v, None, spec),
                }, args.reps, calls=args.calls, queue_ahead=args.queue_ahead)
                op_stats = sparse_compile.runtime_stats()["op"]
                stats = sparse_compile.runtime_stats()["sparse_attention"]
                calls: dict = {}
                for (path, _), count in stats.calls.items():
                    calls[path] = calls.get(path, 0) + count
                with torch.no_grad():
                    out = sparse_compile.sparse_attention(q, k, v, config=config.replace(dense_when_faster=False))
                    ref = cudnn(q, k, v).float()
                    rel_l1 = float((out.float() - ref).abs().sum() / ref.abs().sum())
                    density = float(build_plan(q, k, None, config).density(n, n).mean())
                row = {"N": n, "inputs": inputs, "method": method, "calls_per_sample": args.calls,
                       "layout": args.layout, "queue_ahead": args.queue_ahead, "cudnn_ms": ms["cudnn"],
                       "sparse_attention_ms": ms["sparse"], "ratio": ms["sparse"] / ms["cudnn"],
                       "ratio_of_means": ms["sparse_mean"] / ms["cudnn_mean"], "op_ms": ms["op"],
                       "op_ratio": ms["op"] / ms["cudnn"], "op_ratio_of_means": ms["op_mean"] / ms["cudnn_mean"],
                       "paired_ratio": ms["sparse_paired"], "op_paired_ratio": ms["op_paired"],
                       "op_last_path": op_stats.last_path,
                       "listed_density": density, "rel_l1_sparse": rel_l1, "last_path": stats.last_path,
                       "last_reason": stats.last_reason, "calls": calls, "sm_clock_mhz": sm_clock_mhz()}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    print(write_results(f"{args.name}_verify", rows, out_dir=args.out, **_store("verify"),
                        columns=["N", "inputs", "method", "cudnn_ms", "sparse_attention_ms", "ratio", "ratio_of_means",
                                 "op_ratio", "op_ratio_of_means", "paired_ratio", "op_paired_ratio", "last_path",
                                 "listed_density", "rel_l1_sparse", "last_reason"]))


def dense_path(args) -> None:
    """Whether a site's dense path costs more than cuDNN's call (item 5): ``sparse_attention`` at each method's
    defaults on random inputs, where every timed call runs cuDNN, against cuDNN alternately. Variants: a fresh site
    (``default``), one that never plans again (``no_probe``), one warmed by 40 untimed calls (``warmed``)."""
    rows = []
    for n in args.lengths:
        q, k, v = in_model_layout(*random_inputs(n))
        for method in args.methods:
            for variant in ("default", "no_probe", "warmed"):
                HISTORY.clear()
                config = SparseConfig(method=method, min_seq_len=4096)
                run = lambda: sparse_compile.sparse_attention(q, k, v, config=config)  # noqa: E731
                if variant == "no_probe":
                    run = _with_module_value(HISTORY, "should_probe", lambda key: False, run)
                if variant == "warmed":
                    for _ in range(40):
                        run()
                    if q.is_cuda:
                        torch.cuda.synchronize()
                ms = alternate({"cudnn": lambda: cudnn(q, k, v), "sparse": run}, args.reps, calls=args.calls,
                               queue_ahead=args.queue_ahead)
                row = {"N": n, "method": method, "variant": variant, "ratio": ms["sparse"] / ms["cudnn"],
                       "paired": ms["sparse_paired"], "ratio_of_means": ms["sparse_mean"] / ms["cudnn_mean"],
                       "last_path": sparse_compile.runtime_stats()["sparse_attention"].last_path}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    print(write_results(f"{args.name}_dense_path", rows, out_dir=args.out, **_store("dense_path")))


def tiles(args) -> None:
    """Each method's own plans at its defaults against our dense kernel, per computed tile.

    Structured inputs, contenders timed alternately: cuDNN, our dense kernel (``causal_plan`` through
    ``execute_plan``: the Hopper kernel on an H100) and the method's executor on its defaults' plan (S2O: segment
    chunks, permuted K/V copies, early stop); with early stop or permuted queries also the Triton kernel on the same
    plan. Efficiency against our dense kernel = visited density x t_dense / t_method (1: a computed tile costs what
    a dense one does).
    """
    import os

    from bench_methods import structured_inputs
    from sparse_compile.kernels import attention as kernel_module
    from sparse_compile.plan import causal_plan, causal_tile_count

    rows = []
    scale = 1.0 / math.sqrt(D)
    for n in args.lengths:
        q, k, v = in_model_layout(*structured_inputs(n, device="cuda"))
        dense_plan = causal_plan(1, HQ, n, n, 128, 128, device="cuda")
        for method in args.methods:
            config = SparseConfig(method=method)
            plan = build_plan(q, k, scale, config)
            run_method = lambda: execute(q, k, v, plan, scale, config, kernel="triton", return_visited=False)  # noqa: E731
            contenders = {"cudnn": lambda: cudnn(q, k, v),
                          "dense": lambda: execute_plan(q, k, v, dense_plan, scale, kernel="triton"),
                          "method": run_method}
            if plan.pv_skip is not None:  # what the P.V skip's per-element select costs: the same plan without it
                plain = dataclasses.replace(plan, pv_skip=None)
                contenders["method_no_pv_skip"] = lambda: execute(q, k, v, plain, scale, config, kernel="triton", return_visited=False)
            if plan.early_stop > 0 or plan.query_index is not None:
                def run_triton(run=run_method):
                    os.environ[kernel_module.BACKEND_ENV] = "triton"
                    try:
                        return run()
                    finally:
                        del os.environ[kernel_module.BACKEND_ENV]
                contenders["method_triton"] = run_triton
            with torch.no_grad():
                _, visited = execute(q, k, v, plan, scale, config, kernel="triton", return_visited=True)
                backend = kernel_module.last_backend
            causal = causal_tile_count(n, n, plan.block_m, plan.block_n) * HQ
            density = float(visited.sum()) / causal
            ms = alternate(contenders, args.reps)
            row = {"N": n, "method": method, "shape": plan_shape(plan), "backend": backend,
                   "listed_density": float(plan.density(n, n, HQ).mean()), "visited_density": density,
                   "cudnn_ms": ms["cudnn"], "dense_ms": ms["dense"], "method_ms": ms["method"],
                   "dense_over_cudnn": ms["cudnn"] / ms["dense"],
                   "efficiency_vs_dense": density * ms["dense"] / ms["method"],
                   "sm_clock_mhz": sm_clock_mhz()}
            if "method_no_pv_skip" in ms:
                row["efficiency_without_pv_skip"] = density * ms["dense"] / ms["method_no_pv_skip"]
            if "method_triton" in ms:
                row["method_triton_ms"] = ms["method_triton"]
                row["triton_efficiency_vs_dense"] = density * ms["dense"] / ms["method_triton"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del plan, visited
        del q, k, v
        torch.cuda.empty_cache()
    print(write_results(f"{args.name}_tiles", rows, out_dir=args.out, **_store("tiles"),
                        columns=["N", "method", "shape", "backend", "listed_density", "visited_density", "dense_ms",
                                 "method_ms", "efficiency_vs_dense", "triton_efficiency_vs_dense",
                                 "efficiency_without_pv_skip",
                                 "dense_over_cudnn", "sm_clock_mhz"]))


def _static_plan(plan, visited, *, drop_masked: bool = False, query_index: bool = True):
    """``plan`` cut to the tiles an early-stopping run visited, with early stop off (the same work without the
    vote); ``drop_masked`` also leaves out the masked (intra-segment) tiles; ``query_index=False`` drops the
    query permutation (same work, queries read in place: timing only)."""
    counts, offsets, masked = visited.to(torch.int32), plan.tile_offsets, plan.masked_counts
    if drop_masked:
        t = torch.arange(offsets.shape[-1], device=offsets.device)
        shifted = (t + masked[..., None].long()).clamp(max=offsets.shape[-1] - 1)
        offsets = torch.gather(offsets, -1, shifted.expand_as(offsets)).contiguous()
        counts = (counts - masked).clamp(min=0)
        masked = torch.zeros_like(masked)
    return dataclasses.replace(plan, tile_offsets=offsets, tile_counts=counts.contiguous(),
                               masked_counts=masked.contiguous(), early_stop=0.0,
                               query_index=plan.query_index if query_index else None)


def _kernel_times(fn) -> dict:
    """CUDA time per kernel name (ms) of one call of ``fn``, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:  # kernels only, not the ops that launch them
            continue
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if cuda_us and event.key:
            totals[event.key[:60]] = round(cuda_us / 1e3, 3)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:8])


def _with_module_value(module, name: str, value, run):
    """``run`` with ``module.name`` set to ``value`` for the call (restored after it)."""
    def patched():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return run()
        finally:
            setattr(module, name, saved)
    return patched


def s2o_parts(args) -> None:
    """Where S2O's time per visited tile goes: structured inputs, S2O's defaults, contenders
    timed alternately: our dense kernel; the method as it runs (``s2o``: the intra-segment window pass, then the
    ranked walk resumed from it); the same in one pass (``s2o_one_pass``: the masked squares of the sorted queries
    in the walk, as before ``WINDOW_PASS``); the window pass alone and the resumed walk alone (also with its keys
    gathered in place at every length: ``walk_gathered``); the visited tiles as
    a static plan (no early-stop vote), whole and its walk alone; the plan without the query sort
    (``sort_queries=False``, its own visited tiles); and, timing only, our dense kernel with every tile masked (what
    the position masks cost). Efficiency = tiles x t_dense / (causal tiles x t), with each contender's own tiles
    (the window pass: each segment's causal triangle). ``--queue-ahead`` starts each sample behind a GPU sleep, as
    inside a forward pass (host time then shows only where it exceeds GPU time)."""
    from bench_methods import structured_inputs
    import sparse_compile.methods.s2o as s2o_method
    from sparse_compile.methods.s2o import _window_plan
    from sparse_compile.plan import causal_plan, causal_tile_count

    rows = []
    scale = 1.0 / math.sqrt(D)
    for n in args.lengths:
        q, k, v = in_model_layout(*structured_inputs(n, device="cuda"))
        dense_plan = causal_plan(1, HQ, n, n, 128, 128, device="cuda")
        causal = causal_tile_count(n, n, 128, 128) * HQ
        config = SparseConfig(method="s2o")
        if args.s2o_segment:
            config = config.replace(s2o=config.params_of("s2o").updated({"segment_size": args.s2o_segment}))
        params = config.params_of("s2o")
        unsorted = config.replace(s2o=params.updated({"sort_queries": False}))
        one_pass = lambda run: _with_module_value(s2o_method, "WINDOW_PASS", False, run)  # noqa: E731
        with torch.no_grad():
            plan = build_plan(q, k, scale, config)
            _, visited = execute(q, k, v, plan, scale, config, kernel="triton", return_visited=True)
            _, one_visited = one_pass(lambda: execute(q, k, v, plan, scale, config, kernel="triton", return_visited=True))()
            unsorted_plan = build_plan(q, k, scale, unsorted)
            _, unsorted_visited = execute(q, k, v, unsorted_plan, scale, unsorted, kernel="triton", return_visited=True)
            window = _window_plan(q, params.segment_size, 128, 128)
            window_tiles = float(window.tile_counts.sum())  # already expanded to every query head
            masked = torch.minimum(plan.masked_counts, plan.tile_counts)
            walked = visited - window.tile_counts  # the tiles the resumed walk computed
            static = _static_plan(plan, walked + masked)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            state = execute_plan(q, k, v, window, scale, kernel="triton", lse=lse)
            errors = {}
            ref = cudnn(q, k, v).float()
            for name, p, cfg in (("s2o", plan, config), ("s2o_unsorted", unsorted_plan, unsorted)):
                out = execute(q, k, v, p, scale, cfg, kernel="triton", return_visited=False)
                errors[name] = float((out.float() - ref).abs().sum() / ref.abs().sum())
            del ref
        # the walks resume from the window pass's state in place: repeated calls change the values, not the work
        walk = lambda p: lambda: s2o_method._ranked_walk(  # noqa: E731
            q, k, v, p, scale, params, "triton", False, "auto",
            {"out": state, "lse": lse, "resume": True, "skip_masked": True})
        all_masked = dataclasses.replace(dense_plan, masked_counts=dense_plan.tile_counts.clone())
        contenders = {
            "dense": lambda: execute_plan(q, k, v, dense_plan, scale, kernel="triton"),
            "dense_all_masked": lambda: execute_plan(q, k, v, all_masked, scale, kernel="triton"),
            "s2o": lambda: execute(q, k, v, plan, scale, config, kernel="triton", return_visited=False),
            "s2o_one_pass": one_pass(lambda: execute(q, k, v, plan, scale, config, kernel="triton", return_visited=False)),
            "window_pass": lambda: execute_plan(q, k, v, window, scale, kernel="triton", lse=lse),
            "walk": walk(plan),
            # the same with its keys gathered in place whatever the list's length ("auto" copies short lists)
            "walk_gathered": lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode="gather",
                                                  out=state, lse=lse, resume=True, skip_masked=True),
            "static": lambda: execute(q, k, v, static, scale, config, kernel="triton", return_visited=False),
            "static_walk": walk(static),
            "s2o_unsorted": lambda: execute(q, k, v, unsorted_plan, scale, unsorted, kernel="triton", return_visited=False),
        }
        work = {"dense_all_masked": causal, "s2o": float(visited.sum()), "s2o_one_pass": float(one_visited.sum()),
                "window_pass": window_tiles, "walk": float(walked.sum()), "walk_gathered": float(walked.sum()),
                "static": float(visited.sum()),
                "static_walk": float(walked.sum()), "s2o_unsorted": float(unsorted_visited.sum())}
        ms = alternate(contenders, args.reps, queue_ahead=args.queue_ahead)
        row = {"N": n, "kernels_ms": _kernel_times(contenders["s2o"]), "dense_ms": ms["dense"],
               "window_share": window_tiles / max(work["s2o"], 1),
               "one_pass_masked_share": float(masked.sum()) * (HQ // masked.shape[1]) / max(work["s2o_one_pass"], 1),
               "rel_l1": errors["s2o"], "rel_l1_unsorted": errors["s2o_unsorted"], "queue_ahead": args.queue_ahead,
               "segment_size": params.segment_size,
               "sm_clock_mhz": sm_clock_mhz()}
        for name in work:
            row[f"{name}_ms"] = ms[name]
            row[f"{name}_density"] = work[name] / causal
            if work[name]:
                row[f"{name}_efficiency"] = work[name] / causal * ms["dense"] / ms[name]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, plan, static, state
        torch.cuda.empty_cache()
    print(write_results(f"{args.name}_s2o_parts", rows, out_dir=args.out, **_store("s2o_parts")))


def _store(mode: str) -> dict:
    """write_results' arguments that append a run's rows to the benchmark's store, tagged with its mode."""
    return {"store": "bench_breakeven", "params": ("N", "calls_per_sample"), "extra": {"mode": mode}}


def memory(args) -> None:
    rows = []
    for n in args.memory_lengths:
        q, k, v = random_inputs(n)
        for name in ["cudnn"] + list(args.methods):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                with torch.no_grad():
                    if name == "cudnn":
                        out = cudnn(q, k, v)
                    else:
                        config = SparseConfig(method=name, min_seq_len=4096, dense_when_faster=False)
                        out = sparse_compile.sparse_attention(q, k, v, config=config)
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**30
                del out
            except torch.cuda.OutOfMemoryError:
                extra = "OOM"
            torch.cuda.empty_cache()
            row = {"N": n, "contender": name, "peak_extra_gib": extra}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    print(write_results(f"{args.name}_memory", rows, out_dir=args.out, **_store("memory")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--tiles", action="store_true")
    parser.add_argument("--dense-path", action="store_true",
                        help="GPU: the dense path of a fresh, a never re-planning and a warmed site against cuDNN")
    parser.add_argument("--s2o-parts", action="store_true",
                        help="GPU: where S2O's time per visited tile goes (its window pass and resumed walk, "
                             "one pass, the early-stop vote, masks, the plan without the query sort)")
    parser.add_argument("--s2o-segment", type=int, default=None,
                        help="--s2o-parts: S2O's segment size S (default: S2OParams' own)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=[65536, 131072, 262144])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1,
                        help="--verify: back-to-back calls per timed sample (1: each call's host time shows)")
    parser.add_argument("--queue-ahead", nargs="?", type=int, const=True, default=False,
                        help="--verify / --measure / --s2o-parts: start each sample behind a GPU sleep (host ahead, "
                             "as in a forward pass); a value sets the sleep in GPU cycles (default 2M, ~1 ms)")
    parser.add_argument("--layout", choices=("model", "contiguous"), default="model",
                        help="--verify: q/k/v as a model passes them (B, N, H, D memory) or contiguous (B, H, N, D)")
    parser.add_argument("--hopper-constant", action="append", default=[], metavar="NAME=VALUE",
                        help="set a kernels.hopper module constant (an int, or None) for the whole run")
    parser.add_argument("--table", default=str(TABLE_FILE))
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="breakeven")
    args = parser.parse_args(argv)
    args.methods = args.methods or list(registered_methods())
    if not torch.cuda.is_available():
        raise SystemExit("bench_breakeven.py needs a CUDA GPU")
    for setting in args.hopper_constant:
        from sparse_compile.kernels import hopper

        name, _, value = setting.partition("=")
        if not hasattr(hopper, name):
            raise SystemExit(f"--hopper-constant: kernels.hopper has no constant {name!r}")
        setattr(hopper, name, None if value == "None" else int(value))
    started = time.perf_counter()
    for wanted, step in ((args.measure, measure), (args.verify, verify), (args.tiles, tiles),
                         (args.dense_path, dense_path), (args.s2o_parts, s2o_parts), (args.memory, memory)):
        if wanted:  # in this order: --verify reads the table --measure writes
            step(args)
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
