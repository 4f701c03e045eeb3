"""The project's shared benchmark harness: timing, FLOP counts, results as JSON plus a readable table.

Every benchmark in ``benchmarks/`` uses these pieces so that numbers are comparable:

* ``time_ms`` times a callable with ``triton.testing.do_bench`` and returns the **median** in ms. ``do_bench``
  synchronises, warms up, times each run with CUDA events and flushes L2 between runs;
  ``Rotating`` additionally cycles through several input sets so that no run sees the previous run's inputs.
* ``causal_pairs`` / ``attention_flops`` / ``tile_pairs`` count the work of causal attention, dense or per
  computed tile, and ``tflops`` turns FLOPs and ms into TFLOP/s (4 FLOPs per visible (query, key) pair per
  head-dim element: QK^T and PV).
* ``guarded`` runs a contender and turns out-of-memory (and optionally any other failure) into a cell marker.
* ``write_results`` writes one run's ``<name>.json`` (rows, metadata, environment) and ``.md`` table under
  ``--out`` (default ``benchmarks/results/runs/``, not tracked) and returns the table as text (``tabulate``).
  Given ``store=``, it also appends the rows to that benchmark's store (``append_store``).
* ``append_store`` appends long-format rows to ``<out or benchmarks/results>/<bench>.jsonl``, the one tracked
  record of each maintained benchmark: one row per (parameters, metric) with ``metric`` and ``value``, the
  benchmark's parameters, and where it ran (``device``, ``torch``, ``triton``, ``cuda``, ``commit``, ``date``,
  ``command``). ``read_store`` reads it back.

Run-time and size choices (warmup/rep) are the caller's: long runs should use modest ``rep``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

__all__ = [
    "RESULTS_DIR",
    "Rotating",
    "time_ms",
    "causal_pairs",
    "tile_pairs",
    "attention_flops",
    "tflops",
    "guarded",
    "OOM",
    "env_info",
    "format_table",
    "write_results",
    "append_store",
    "read_store",
    "RUNS_DIR",
    "rotation_count",
    "alternating_ms",
    "alternating_samples",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RUNS_DIR = RESULTS_DIR / "runs"  # one run's readable tables; git ignores it (the stores are the record)
OOM = "OOM"


class Rotating:
    """Call ``fn(*inputs[i])`` for i = 0, 1, 2, ... cyclically: each run reads a different input set."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[tuple]):
        if not inputs:
            raise ValueError("Rotating: need at least one input set")
        self.fn, self.inputs, self.i = fn, list(inputs), 0

    def __call__(self):
        args = self.inputs[self.i % len(self.inputs)]
        self.i += 1
        return self.fn(*args)


def alternating_rounds(contenders: Sequence, rounds: int) -> Iterable[list]:
    """The order of each timing round: every contender once per round, in the given order first and then in a fresh
    seeded shuffle per round, so none always runs right after the same one (on the H100 the call after a long one,
    a dense kernel at 64K-128K, ran about 10% slower: a lower clock)."""
    order, shuffler = list(contenders), random.Random(0)
    for r in range(rounds):
        if r:
            shuffler.shuffle(order)
        yield list(order)


def alternating_samples(contenders: dict, reps: int, *, warmup: int = 2, calls: int = 1,
                        queue_ahead: Union[bool, int] = False) -> dict:
    """Milliseconds per call of each callable, timed in turn, each round in the order ``alternating_rounds`` gives:
    clock drift under sustained load then moves every contender alike. Returns {name: [one value per round]}.

    ``warmup`` untimed rounds first (JIT, histories that must land). ``calls`` back-to-back calls per sample
    (divided out). ``queue_ahead``: each sample starts behind a short GPU sleep, so the host is ahead of the GPU as
    inside a model's forward pass (a call's host time then shows only where it exceeds its GPU time, or the sleep:
    an int sets the sleep in GPU cycles, True is 2M, about 1 ms on the H100); otherwise the
    GPU idles while the first call of a sample is prepared. On the GPU CUDA events time each sample; off it (smoke
    runs) wall time does.
    """
    import time

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
        if cuda:
            torch.cuda.synchronize()
    times = {name: [] for name in contenders}
    for order in alternating_rounds(contenders, reps):
        for name in order:
            fn = contenders[name]
            if not cuda:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / calls)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queue_ahead:
                torch.cuda._sleep(2_000_000 if queue_ahead is True else int(queue_ahead))
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return times


def alternating_ms(contenders: dict, reps: int, **options) -> dict:
    """Median milliseconds of each callable under ``alternating_samples`` (same options)."""
    import statistics

    return {name: statistics.median(t) for name, t in alternating_samples(contenders, reps, **options).items()}


def rotation_count(bytes_per_set: int, *, cache_bytes: Optional[int] = None, cap: int = 4) -> int:
    """How many input sets to rotate so that together they overflow the last-level cache (at least 2)."""
    if cache_bytes is None:
        cache_bytes = 64 << 20
        if torch.cuda.is_available():
            cache_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", cache_bytes)
    need = math.ceil(4 * cache_bytes / max(bytes_per_set, 1))
    return int(min(cap, max(2, need)))


def time_ms(fn: Callable[[], Any], *, warmup: float = 25, rep: float = 100) -> float:
    """Median time of ``fn()`` in milliseconds (``triton.testing.do_bench``; warmup/rep in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def causal_pairs(num_queries: int, num_keys: int) -> int:
    """Visible (query, key) pairs of causal attention with the queries at the last positions."""
    off = num_keys - num_queries
    return num_queries * off + num_queries * (num_queries + 1) // 2


def tile_pairs(full_tiles: int, diagonal_tiles: int, block_m: int, block_n: int) -> int:
    """Visible pairs in computed tiles: full tiles count block_m*block_n, square diagonal tiles their lower half."""
    if diagonal_tiles and block_m != block_n:
        raise ValueError("tile_pairs: diagonal tiles need block_m == block_n")
    return full_tiles * block_m * block_n + diagonal_tiles * block_m * (block_m + 1) // 2


def attention_flops(pairs: int, batch: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs: two matmuls (QK^T and PV), 2 FLOPs per multiply-add, per visible pair and head."""
    return 4.0 * pairs * batch * heads * head_dim


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or not isinstance(ms, (int, float)) or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def guarded(fn: Callable[[], Any], *, catch_all: bool = False):
    """``fn()``, or ``OOM`` when it runs out of device memory (or ``'error: ...'`` with ``catch_all``)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return OOM
    except RuntimeError as exc:  # some allocators report OOM as a plain RuntimeError
        if "out of memory" in str(exc).lower():
            torch.cuda.empty_cache()
            return OOM
        if catch_all:
            return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the table when asked
        if catch_all:
            return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        raise


def sm_clock_mhz() -> Optional[int]:
    """The GPU's current SM clock (nvidia-smi; None without one): recorded next to timed runs, since the clock
    drifts under sustained load."""
    if not torch.cuda.is_available():
        return None
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def env_info() -> dict:
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, cuda=torch.version.cuda,
                    memory_gib=round(p.total_memory / 2**30, 1))
    return info


def _cell(x: Any, digits: int) -> Any:
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}f}"
    return "-" if x is None else x


def format_table(rows: Iterable[dict], columns: Optional[Sequence[str]] = None, *, digits: int = 3) -> str:
    from tabulate import tabulate

    rows = list(rows)
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(c for c in r if c not in columns)
    body = [[_cell(r.get(c), digits) for c in columns] for r in rows]
    return tabulate(body, headers=list(columns), tablefmt="github", disable_numparse=True)


def write_results(name: str, rows: list, *, meta: Optional[dict] = None, columns: Optional[Sequence[str]] = None,
                  out_dir: Optional[os.PathLike] = None, digits: int = 3, store: Optional[str] = None,
                  params: Sequence[str] = (), extra: Optional[dict] = None) -> str:
    """Write ``<out_dir or benchmarks/results/runs>/<name>.json`` and ``.md``; return the table text. With ``store``
    (the benchmark's name), the rows are also appended to its store (``append_store``, same ``out_dir``)."""
    out = Path(out_dir) if out_dir is not None else RUNS_DIR
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows, columns, digits=digits)
    doc = {"name": name, "meta": meta or {}, "env": env_info(), "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / f"{name}.md").write_text(f"# {name}\n\n{json.dumps(meta or {}, default=str)}\n\n{table}\n")
    if store:
        append_store(store, rows, params=params, extra=extra, out_dir=out_dir)
    return table


def _commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files); ``unknown`` outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(command: Optional[Sequence[str]] = None) -> dict:
    """Where and how a result was measured: device, versions, commit, date (UTC) and the command line."""
    import shlex
    import sys

    info = env_info()
    out = {"device": info.get("gpu", "cpu"), "torch": info["torch"], "triton": info.get("triton"),
           "cuda": info.get("cuda"), "python": info["python"]}
    if "transformers" in sys.modules:  # only when the benchmark used it (importing it costs seconds)
        out["transformers"] = getattr(sys.modules["transformers"], "__version__", None)
    if command is None:
        argv0 = Path(sys.argv[0])
        try:
            argv0 = argv0.resolve().relative_to(Path(__file__).resolve().parents[1])
        except ValueError:
            pass
        command = [str(argv0), *sys.argv[1:]]
    out.update(commit=_commit(), date=info["date"], command=shlex.join(["python", *map(str, command)]))
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def long_rows(rows: Iterable[dict], *, params: Sequence[str] = (), extra: Optional[dict] = None,
              prov: Optional[dict] = None) -> list:
    """Wide rows -> long rows: every numeric field not named in ``params`` becomes a (metric, value) row carrying
    the row's other fields (its parameters: the strings, booleans and ``params``); a dict of numbers becomes the
    metrics ``field.key``; other dicts and lists become JSON text parameters. None values are dropped. A field
    named like a column of the long format (``metric``, ``value``, the provenance's) is kept as ``param_<field>``."""
    reserved = {"metric", "value", *(prov or {})}
    out = []
    for row in rows:
        fixed, metrics = dict(extra or {}), {}
        for key, value in row.items():
            if key in reserved:
                key = f"param_{key}"
            if key in params or key.removeprefix("param_") in params or (
                    not _is_number(value) and not isinstance(value, dict)):
                if isinstance(value, (dict, list, tuple)):
                    value = json.dumps(value, sort_keys=True, default=str)
                if value is not None:
                    fixed[key] = value
            elif isinstance(value, dict):
                if all(_is_number(v) or v is None for v in value.values()):
                    metrics.update({f"{key}.{k}": v for k, v in value.items()})
                else:
                    fixed[key] = json.dumps(value, sort_keys=True, default=str)
            else:
                metrics[key] = value
        for metric, value in metrics.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                out.append({"metric": metric, "value": value, **fixed, **(prov or {})})
    return out


def append_store(bench: str, rows: Iterable[dict], *, params: Sequence[str] = (), extra: Optional[dict] = None,
                 out_dir: Optional[os.PathLike] = None, command: Optional[Sequence[str]] = None) -> Path:
    """Append ``rows`` in long format (``long_rows``) with their provenance to ``<out_dir or
    benchmarks/results>/<bench>.jsonl``; return the path. A run on another machine with ``--out $OUT`` writes
    its own store there; append it to the repository's:
    ``cat $OUT/<bench>.jsonl >> benchmarks/results/<bench>.jsonl``."""
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bench}.jsonl"
    lines = [json.dumps(r, default=str) for r in long_rows(rows, params=params, extra=extra,
                                                             prov=provenance(command))]
    with path.open("a") as f:
        f.writelines(line + "\n" for line in lines)
    return path


def _measures(row: dict, metric: str, contender: str, where: dict) -> bool:
    return row["metric"] == metric and row["contender"] == contender and all(row.get(k) == v for k, v in where.items())


def latest_row(rows: list, metric: str, contender: str, **where) -> Optional[dict]:
    """The latest ``metric`` row of ``contender`` among rows whose fields equal ``where`` (of rows with the same date,
    the last stored); None if there is none."""
    mine = sorted((r for r in rows if _measures(r, metric, contender, where)), key=lambda r: r["date"])
    return mine[-1] if mine else None


def latest_with_baseline(rows: list, metric: str, contender: str, baseline: str,
                         **where) -> Optional[tuple[dict, dict]]:
    """(row, baseline row): ``latest_row`` of ``contender`` and ``baseline``'s row from the same run (same date and
    command), so that a ratio compares two numbers measured in one process; None where either is missing."""
    last = latest_row(rows, metric, contender, **where)
    if last is None:
        return None
    base = [r for r in rows if _measures(r, metric, baseline, where) and r["date"] == last["date"]
            and r["command"] == last["command"]]
    return (last, base[-1]) if base else None


def read_store(bench: str, *, out_dir: Optional[os.PathLike] = None, **where) -> list:
    """The rows of a store, optionally only those whose fields equal ``where`` (e.g. ``metric="speedup"``)."""
    path = (Path(out_dir) if out_dir is not None else RESULTS_DIR) / f"{bench}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]
