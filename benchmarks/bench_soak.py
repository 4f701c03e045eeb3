"""A day in a server: one compiled model serving many prefill calls of random lengths, methods and densities.

    python benchmarks/bench_soak.py                              # H100: 1,000 calls, 16K-128K, 2 layers (< 9 min)
    python benchmarks/bench_soak.py --device cpu --calls 40 --lengths 64 96 160   # tiny, about a minute

The Llama-3.1-8B-shaped model of ``bench_e2e.py`` with ``--layers`` decoder layers (random bf16 weights; on the
CPU its tiny smoke shape in float32), compiled once as users do (``torch.compile(model, backend="sparse_prefill",
dynamic=True)``), serves ``--calls`` prefill calls: batch 1 or 2, the length drawn log-uniformly from
``--min-length``..``--max-length`` (or from ``--lengths``), and each call in its own ``sparse_compile.sparsity(...)``
region: a random method with its density knob drawn from its range, or sparsity off (one call in ten). Calls stop
being issued past ``--max-minutes`` (8.5: setup, Triton's first compiles and the calls within 9 minutes);
``calls_made`` says how many ran.

Recorded: the graphs Dynamo compiled after the warm-up (one call of each batch size; must be 0), the GPU memory
high-water (allocated and reserved) at call 100 and at the end, the host's resident memory at both, the time per
call (p50, p99) per length bucket (powers of two), and the attention calls that ran sparse and dense according to
``runtime_stats()`` against the calls made (layers x calls), with the break-even history's size. Writes the run's
``soak.json``/``.md`` under ``--out`` (default ``benchmarks/results/runs/``) and appends its rows to the store
``benchmarks/results/bench_soak.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import sys
import time
from pathlib import Path

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


def gpu_memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    return {"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def draw_region(rng: random.Random) -> dict:
    """A call's region: sparsity off one time in ten, else a method with its density knob drawn from its range."""
    if rng.random() < 0.1:
        return {"enabled": False}
    methods = sparse_compile.registry.registered_methods()
    name = rng.choice(sorted(methods))
    knob = methods[name].density
    if knob is None:
        return {"method": name}
    value = knob.low + rng.random() * (knob.high - knob.low)
    return {"method": name, knob.name: value}


def draw_length(rng: random.Random, args) -> int:
    if args.lengths:
        return rng.choice(args.lengths)
    n = math.exp(rng.uniform(math.log(args.min_length), math.log(args.max_length)))
    return max(args.min_length, min(args.max_length, int(n) // 128 * 128))


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B shape (default 2)")
    parser.add_argument("--min-length", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=131072)
    parser.add_argument("--lengths", type=int, nargs="*", help="draw from these lengths instead of the range")
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=8.5,
                        help="stop issuing calls past this wall time (setup included); the rows say how many ran")
    parser.add_argument("--name", default="soak")
    parser.add_argument("--out", default=None, help="the run's tables and the store go here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.layers < 1 or args.max_batch < 1:
        parser.error("--calls, --layers and --max-batch must be >= 1")
    if not args.lengths and not 1 < args.min_length <= args.max_length:
        parser.error("--min-length must be > 1 and <= --max-length")
    if args.lengths and min(args.lengths) < 2:
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
        options = {"min_seq_len": min(16384, args.min_length, *(args.lengths or [16384]))}
    compiled = torch.compile(model, backend=functools.partial(sparse_compile.sparse_prefill, options=options),
                             dynamic=True)
    vocab = model.config.vocab_size
    from torch._dynamo.utils import counters

    def call(batch: int, length: int, region: dict) -> float:
        ids = torch.randint(0, vocab, (batch, length), device=device)
        if not tiny:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad(), sparse_compile.sparsity(**region):
            compiled(ids, logits_to_keep=1)
        if not tiny:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    warm_lengths = args.lengths or [args.min_length]
    started = run_started = time.perf_counter()
    for batch in range(1, args.max_batch + 1):  # each batch-size bucket compiled once
        call(batch, min(warm_lengths), {})
    warmup_s = time.perf_counter() - started
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    sparse_compile.reset_runtime_stats()
    if not tiny:
        torch.cuda.reset_peak_memory_stats()

    times: dict = {}
    at_mark: dict = {}
    calls_made = 0
    for i in range(args.calls):
        if time.perf_counter() - run_started > 60 * args.max_minutes:
            break
        calls_made += 1
        batch, length = rng.randint(1, args.max_batch), draw_length(rng, args)
        seconds = call(batch, length, draw_region(rng))
        times.setdefault(1 << int(math.log2(length)), []).append(seconds)
        if i + 1 == MARK or (i + 1 == args.calls and not at_mark):
            at_mark = {"rss_mib": rss_mib(), **gpu_memory(device)}
    stats = sparse_compile.runtime_stats()
    paths = {"sparse": 0, "dense": 0}
    for entry in stats.values():
        for (path, _), n in entry.calls.items():
            paths[path] = paths.get(path, 0) + n
    layers = model.config.num_hidden_layers
    meta = {
        "device": torch.cuda.get_device_name() if not tiny else "cpu", "dtype": str(dtype), "layers": layers,
        "calls": args.calls, "calls_made": calls_made, "wall_s": time.perf_counter() - run_started,
        "max_batch": args.max_batch, "seed": args.seed, "options": options,
        "lengths": args.lengths or [args.min_length, args.max_length], "warmup_s": warmup_s,
        "recompiles_after_warmup": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "attention_calls_made": calls_made * layers, "sparse_calls": paths["sparse"], "dense_calls": paths["dense"],
        "history_entries": len(sparse_compile.breakeven.HISTORY),
        f"at_call_{min(MARK, calls_made)}": at_mark, "at_end": {"rss_mib": rss_mib(), **gpu_memory(device)},
    }
    rows = [{"bucket": bucket, "calls": len(ts), "p50_s": percentile(ts, 0.5), "p99_s": percentile(ts, 0.99),
             "layers": layers, "device": meta["device"]} for bucket, ts in sorted(times.items())]
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


if __name__ == "__main__":
    main()
