"""A day in a server: one compiled model serving many prefill calls of several lengths, methods and densities.

    python benchmarks/bench_soak.py                              # H100: >= 1,000 calls, 16K-128K (< 9 min)
    python benchmarks/bench_soak.py --device cpu --calls 40 --lengths 64 96 160   # tiny, about a minute

The Llama-3.1-8B-shaped model of ``bench_e2e.py`` with ``--layers`` decoder layers (random bf16 weights; on the
CPU its tiny smoke shape in float32), compiled once as users do (``torch.compile(model, backend="sparse_prefill",
dynamic=True)``), serves ``--calls`` prefill calls. Each call draws a workload: batch 1..``--max-batch``, a length
from ``--lengths`` (default 16K, 24K + 1, 64K - 1, 128K: odd lengths too) and a contender from ``CONTENDERS``
(every registered method at its defaults, the fixed-share ones also at two other densities, PBS at another
threshold, sparsity off), each call in its own ``sparse_compile.sparsity(...)`` region. The warm-up serves every
workload once (what a server does on its first requests), after ``sparse_compile.precompile`` of every method up
to the longest length (what a server runs at start); calls stop being issued past ``--max-minutes``.

Recorded: the graphs Dynamo compiled after the warm-up (must be 0); the GPU memory high-water (allocated and
reserved) at call 100 and at the end and the host's resident memory at both; the time per call, p50 and p99, of
each workload (same length, batch and contender: what varies is the server, not the work), and per length the
largest p99 / p50 over its workloads; the attention calls that ran sparse and dense according to
``runtime_stats()`` against the calls made (layers x calls); and, last, two threads on two CUDA streams serving
calls at once, each output against the same call run alone. Writes the run's ``soak.json``/``.md`` under ``--out``
(default ``benchmarks/results/runs/``) and appends its rows to the store ``benchmarks/results/bench_soak.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from bench_e2e import build_model  # noqa: E402
from harness import write_results  # noqa: E402

MARK = 100  # the call after which memory is read the first time (the end of the warm period)


def rss_mib() -> float:
    """The process's resident set now (Linux), else its peak (``ru_maxrss``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def allocator_events(tiny: bool) -> tuple[int, int]:
    """(device allocations, retries after freeing the cache) of PyTorch's caching allocator so far: a call that
    grows or flushes the cache pays cudaMalloc / cudaFree and a device sync inside it."""
    if tiny:
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def gpu_memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    return {"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def contenders() -> dict:
    """name -> sparsity region: every registered method at its defaults; the fixed-share selectors also at budgets
    0.05 and 0.2 and PBS at threshold 0.9 (density switching per call); ``dense``: sparsity off."""
    regions = {"dense": {"enabled": False}}
    for name in sorted(sparse_compile.registry.registered_methods()):
        regions[name] = {"method": name}
    for name in ("sampled", "peak"):
        for budget in (0.05, 0.2):
            regions[f"{name}@{budget}"] = {"method": name, "budget": budget}
    regions["pbs@0.9"] = {"method": "pbs", "threshold": 0.9}
    return regions


class CallRecord(NamedTuple):
    """One timed call of the soak (``slow_calls`` lists them as plain lists, in this order)."""

    call: int
    length: int
    batch: int
    contender: str
    seconds: float
    gpu_s: float  # between events queued at the call's start and end
    queued_s: float  # until the host had queued the call
    sparse: int  # attention calls by path
    dense: int
    triton_compiles: int
    reason: str  # the site's last reason
    full_gcs: int  # Python's full garbage collections during the call
    device_allocs: int  # the caching allocator's new device segments
    alloc_retries: int  # its retries after freeing its cache

    def workload(self) -> tuple:
        return self.length, self.batch, self.contender


class TritonCompiles:
    """Counts the Triton kernels compiled in this process while installed (Triton's post-compile hook)."""

    def __init__(self):
        self.count = 0
        self._knobs = None
        try:
            from triton import knobs

            self._knobs, self._before = knobs.runtime, knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._hook
        except (ImportError, AttributeError):
            pass

    def _hook(self, *args, **kwargs):
        self.count += 1
        return self._before(*args, **kwargs) if self._before is not None else None

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._before


def path_counts() -> tuple:
    """(sparse, dense) attention calls that ``runtime_stats()`` has counted, and the last reason of each site."""
    counts, reasons = {"sparse": 0, "dense": 0}, []
    for entry in sparse_compile.runtime_stats().values():
        reasons.append(entry.last_reason)
        for (path, _), n in entry.calls.items():
            counts[path] = counts.get(path, 0) + n
    return counts["sparse"], counts["dense"], " | ".join(sorted(set(filter(None, reasons))))


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B shape (default 2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 24577, 65535, 131072])
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-calls", type=int, default=8, help="calls per thread of the two-stream phase")
    parser.add_argument("--max-minutes", type=float, default=8.0,
                        help="stop issuing calls past this wall time (setup included); the rows say how many ran")
    parser.add_argument("--name", default="soak")
    parser.add_argument("--out", default=None, help="the run's tables and the store go here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.layers < 1 or args.max_batch < 1:
        parser.error("--calls, --layers and --max-batch must be >= 1")
    if min(args.lengths) < 2:
        parser.error("--lengths must be >= 2 (one token is a decode step)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device
    tiny = not device.startswith("cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = build_model(tiny, device, dtype, num_layers=args.layers)
    if tiny:  # blocks small enough for prompts of a few hundred tokens; the PyTorch stages
        options = dict(min_seq_len=32, kernel="reference", planner="reference",
                       pbs={"block_size": 32, "segment_size": 64}, sparge={"block_size_q": 32, "block_size_kv": 32},
                       bfla={"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32},
                       s2o={"segment_size": 64, "block_size_q": 32, "block_size_kv": 32},
                       sampled={"block_size": 32}, antidiag={"block_size": 32}, peak={"block_size": 32})
    else:
        options = {"min_seq_len": min(16384, *args.lengths)}
    compiled = torch.compile(model, backend=functools.partial(sparse_compile.sparse_prefill, options=options),
                             dynamic=True)
    vocab = model.config.vocab_size
    from torch._dynamo.utils import counters

    regions = contenders()

    def call(batch: int, length: int, region: dict) -> tuple[float, float, float]:
        """(seconds, seconds between events queued at its start and end on the GPU, seconds until the host had
        queued it) of one call."""
        ids = torch.randint(0, vocab, (batch, length), device=device)
        if not tiny:
            torch.cuda.synchronize()
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        started = time.perf_counter()
        with torch.no_grad(), sparse_compile.sparsity(**region):
            compiled(ids, logits_to_keep=1)
        queued_s = time.perf_counter() - started
        gpu_s = 0.0
        if not tiny:
            events[1].record()
            torch.cuda.synchronize()
            gpu_s = events[0].elapsed_time(events[1]) / 1e3
        return time.perf_counter() - started, gpu_s, queued_s

    workloads = [(length, batch, name) for length in args.lengths for batch in range(1, args.max_batch + 1)
                 for name in regions]
    started = run_started = time.perf_counter()
    precompile_s = None
    if not tiny:  # what a server runs at start (README): every method's kernels for every length bucket
        methods = tuple(sparse_compile.registry.registered_methods())
        precompile_s = sparse_compile.precompile(max(args.lengths), methods=methods)
    for length, batch, name in workloads:  # every workload once: compiles, Triton's kernels, break-even probes
        call(batch, length, regions[name])
    warmup_s = time.perf_counter() - started
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    sparse_compile.reset_runtime_stats()
    if not tiny:
        torch.cuda.reset_peak_memory_stats()

    compiles = TritonCompiles()
    collections = {"gen2": 0}  # Python's full garbage collections, a host pause that a call can fall into

    def count_collections(phase, info):
        collections["gen2"] += phase == "start" and info.get("generation") == 2

    gc.callbacks.append(count_collections)
    times: dict = {}
    log: list = []  # a CallRecord per call
    at_mark: dict = {}
    calls_made = 0
    for i in range(args.calls):
        if time.perf_counter() - run_started > 60 * args.max_minutes:
            break
        calls_made += 1
        workload = rng.choice(workloads)
        before, compiled_before, collected_before = path_counts(), compiles.count, collections["gen2"]
        grown_before = allocator_events(tiny)
        seconds, gpu_s, queued_s = call(workload[1], workload[0], regions[workload[2]])
        after = path_counts()
        times.setdefault(workload, []).append(seconds)
        log.append(CallRecord(i, *workload, seconds, gpu_s, queued_s, after[0] - before[0], after[1] - before[1],
                              compiles.count - compiled_before, after[2][:200], collections["gen2"] - collected_before,
                              *(a - b for a, b in zip(allocator_events(tiny), grown_before))))
        if i + 1 == MARK or (i + 1 == args.calls and not at_mark):
            at_mark = {"rss_mib": rss_mib(), **gpu_memory(device)}
    compiles.close()
    gc.callbacks.remove(count_collections)
    sparse_calls, dense_calls, _ = path_counts()
    layers = model.config.num_hidden_layers
    streams_match = None if tiny else two_streams(compiled, vocab, device, regions, args.lengths, args.stream_calls,
                                                 rng)
    meta = {
        "device": torch.cuda.get_device_name() if not tiny else "cpu", "dtype": str(dtype), "layers": layers,
        "calls": args.calls, "calls_made": calls_made, "wall_s": time.perf_counter() - run_started,
        "max_batch": args.max_batch, "seed": args.seed, "options": options,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "lengths": args.lengths,
        "contenders": sorted(regions), "workloads": len(workloads), "warmup_s": warmup_s, "precompile_s": precompile_s,
        "recompiles_after_warmup": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "attention_calls_made": calls_made * layers, "sparse_calls": sparse_calls, "dense_calls": dense_calls,
        "history_entries": len(sparse_compile.breakeven.HISTORY), "two_streams_match": streams_match,
        "triton_compiles_after_warmup": sum(entry.triton_compiles for entry in log),
        # calls over 1.2 x their workload's median (the p99 / p50 bound): CallRecord's fields, then the workload's
        # median seconds and the previous call's workload (length, batch, contender)
        "slow_calls": [(*entry, median, log[entry.call - 1].workload() if entry.call else None) for entry in log
                       for median in [percentile(times[entry.workload()], 0.5)] if entry.seconds > 1.2 * median][:64],
        f"at_call_{min(MARK, calls_made)}": at_mark, "at_end": {"rss_mib": rss_mib(), **gpu_memory(device)},
    }
    rows = []
    for length in args.lengths:
        mine = {w: ts for w, ts in times.items() if w[0] == length}
        ratios = {w: percentile(ts, 0.99) / percentile(ts, 0.5) for w, ts in mine.items()}
        worst = max(ratios, key=ratios.get) if ratios else None
        rows.append({"bucket": length, "calls": sum(len(ts) for ts in mine.values()), "workloads": len(mine),
                     "median_p50_s": percentile([percentile(ts, 0.5) for ts in mine.values()], 0.5) if mine else None,
                     "max_p99_over_p50": ratios.get(worst), "worst_workload": f"{worst[2]} b{worst[1]}" if worst else "",
                     "worst_calls": len(mine[worst]) if worst else 0, "layers": layers, "device": meta["device"]})
    summary = {k: v for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    summary.update({f"{when}.{k}": v for when in (f"at_call_{min(MARK, calls_made)}", "at_end")
                    for k, v in meta[when].items()})
    rows.append({"bucket": "all", "device": meta["device"], **summary})
    table = write_results(args.name, rows, meta=meta, out_dir=args.out, store="bench_soak",
                          params=("bucket", "layers", "calls", "max_batch", "seed"))
    print(table)
    print({k: meta[k] for k in ("calls_made", "wall_s", "recompiles_after_warmup", "attention_calls_made",
                                "sparse_calls", "dense_calls")})
    return {"meta": meta, "rows": rows}


def two_streams(compiled, vocab: int, device: str, regions: dict, lengths: list, calls: int, rng) -> bool:
    """Two threads, each on its own CUDA stream and in its own regions, serve ``calls`` calls at once; True when
    every output equals the same call run alone (the plans are deterministic for the same inputs)."""
    names = [n for n in sorted(regions) if n != "dense"]
    jobs = [[(torch.randint(0, vocab, (1, rng.choice(lengths)), device=device), regions[rng.choice(names)])
             for _ in range(calls)] for _ in range(2)]
    alone = []
    with torch.no_grad():
        for job in jobs:
            alone.append([])
            for ids, region in job:
                with sparse_compile.sparsity(**region):
                    alone[-1].append(compiled(ids, logits_to_keep=1).logits.clone())
    together = [[None] * calls for _ in jobs]
    errors = []

    def serve(j: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for c, (ids, region) in enumerate(jobs[j]):
                    with sparse_compile.sparsity(**region):
                        together[j][c] = compiled(ids, logits_to_keep=1).logits.clone()
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported in the result
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(j,)) for j in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return all(torch.equal(a, b) for ja, jb in zip(alone, together) for a, b in zip(ja, jb))


if __name__ == "__main__":
    main()
