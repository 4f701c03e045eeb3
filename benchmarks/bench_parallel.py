"""Time to first token on one or several GPUs: Ulysses sequence parallelism, dense against sparse.

    torchrun --nproc-per-node 4 benchmarks/bench_parallel.py --lengths 524288 1048576 \
        --settings pbs@0.1 pbs@0.05 sampled dense --out results/
    python benchmarks/bench_parallel.py --lengths 131072 --settings dense pbs@0.1      # one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --smoke                  # CPU, gloo: tests the script

The Llama-3.1-8B-shaped model of ``bench_e2e.py`` (random bf16 weights), compiled whole with
``backend="sparse_prefill"`` (``dynamic=True``), batch 1, logits of the last position. With several processes
each rank calls the model on its chunk of the prompt inside ``sparse_compile.sequence_parallel()``; attention runs
whole sequences for ``H/P`` heads between two all-to-alls. Settings, each timed on the same prompt:

* ``dense``: the same compiled model with sparsity off (cuDNN attention, Ulysses all-to-alls included);
* ``<method>``: a method at its defaults (the break-even dispatch may send its calls to cuDNN);
* ``<method>@<density>``: the method's density knob calibrated on this length's layer-1 queries and keys
  (rank 0's heads) so that its plan keeps about that share of the causal tiles;
* ``floor`` (always measured, first): attention doing nothing, the all-to-alls kept: everything but attention;
* ``ring`` (several GPUs, ``--parallel sequence``): dense attention through PyTorch's own ring attention
  (``torch.distributed.tensor.experimental.context_parallel``, load-balanced causal shards) on the same model run
  eagerly (the context manager intercepts eager SDPA calls, not a compiled graph's): the dense a user of PyTorch's
  context parallelism gets.

``--parallel tensor`` times tensor parallelism instead: the model parallelised with ``parallelize_module`` (q/k/v and
gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``: each rank runs ``H/P`` heads of every layer on the whole
prompt, one all-reduce after each attention and MLP block), compiled as above, no ``sequence_parallel``.

Per setting and length: the first call (compile of the graph reported apart: Dynamo's and Inductor's time from
``torch._dynamo.utils.compilation_time_metrics``), ``--reps`` timed calls (TTFT: the slowest rank), sparse
attention calls per rank in every timed call, peak memory per rank, and with ``--balance`` each rank's time inside
attention. Rows are appended in long format to ``<out>/bench_parallel.jsonl`` (``harness.append_store``: one row
per metric, with device, versions, commit, date and command); ``--report`` writes the table and the plot from it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from density_calibration import calibrate  # noqa: E402
from e2e_model import build_model  # noqa: E402
from harness import append_store, sm_clock_mhz  # noqa: E402

CAPTURE_LAYER = 1


def _compile_seconds() -> float:
    """Dynamo's and Inductor's compile time so far (seconds), from torch's own compile metrics."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    total = 0.0
    for name, values in metrics.items():
        if "entire_frame_compile" in name or name.endswith("compile_inner"):
            total += sum(values)
            break
    return total


class Runner:
    """One rank's model, its chunk of each prompt, and the timing of one call across ranks."""

    def __init__(self, args):
        self.args = args
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        cuda = torch.cuda.is_available() and not args.smoke
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.manual_seed(0)  # the same weights on every rank
        self.model = build_model(args.smoke, self.device, dtype, num_layers=args.layers)
        self.layers = self.model.config.num_hidden_layers
        self.tensor_parallel = args.parallel == "tensor" and self.world > 1
        if self.tensor_parallel:
            parallelize_heads(self.model, self.mesh())
        if args.smoke:
            self.base = sparse_compile.SparseConfig(min_seq_len=64, pbs={"block_size": 32, "segment_size": 64},
                                                    sampled={"block_size": 32})
        else:
            self.base = sparse_compile.SparseConfig(min_seq_len=16384)
        backend = functools.partial(sparse_compile.sparse_prefill, options=self.base.to_dict())
        self.compiled = torch.compile(self.model, backend=backend, dynamic=True)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def whole_prompt(self, n: int):
        """The length-``n`` prompt (the same on every rank and run) and its positions, on this rank's device."""
        generator = torch.Generator().manual_seed(n)
        ids = torch.randint(0, self.model.config.vocab_size, (1, n), generator=generator)
        return ids.to(self.device), torch.arange(n, device=self.device)[None]

    def prompt(self, n: int):
        """What this rank feeds the model: its chunk of the prompt under sequence parallelism, else all of it."""
        ids, positions = self.whole_prompt(n)
        if self.world > 1 and not self.tensor_parallel:
            ids = ids.tensor_split(self.world, dim=1)[self.rank].contiguous()
            positions = positions.tensor_split(self.world, dim=1)[self.rank].contiguous()
        return ids, positions

    def max_over_ranks(self, value: float) -> list:
        """Every rank's value (a list in rank order)."""
        if self.world == 1:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def call(self, prompt, region: dict):
        ids, positions = prompt
        sequence = self.world > 1 and not self.tensor_parallel
        parallel = sparse_compile.sequence_parallel() if sequence else contextlib.nullcontext()
        with torch.no_grad(), parallel, sparse_compile.sparsity(**region):
            return self.compiled(ids, position_ids=positions, logits_to_keep=1)

    def ring_call(self, n: int):
        """Dense attention through PyTorch's context parallelism (ring attention), the eager model, whole prompt
        given; the context manager shards it (load-balanced for causal attention) and SDPA rings K/V."""
        from torch.distributed.tensor.experimental import context_parallel

        ids, positions = self.whole_prompt(n)
        with torch.no_grad(), context_parallel(self.mesh(), buffers=[ids, positions], buffer_seq_dims=[1, 1],
                                               no_restore_buffers={ids, positions}):
            return self.model(ids, position_ids=positions, logits_to_keep=1, use_cache=False)

    def timed(self, prompt, region: dict, call=None) -> dict:
        """One call on every rank: wall seconds (slowest rank), sparse calls per rank, compile seconds inside."""
        sparse_compile.reset_runtime_stats()
        compiled_before = _compile_seconds()
        if self.world > 1:
            dist.barrier()
        self.sync()
        started = time.perf_counter()
        if call is None:
            self.call(prompt, region)
        else:
            call()
        self.sync()
        seconds = time.perf_counter() - started
        stats = sparse_compile.runtime_stats()
        sparse = sum(n for s in stats.values() for (path, _), n in s.calls.items() if path == "sparse")
        dense_reasons = sorted({reason.split(" (")[0] for s in stats.values()
                                for (path, reason), n in s.calls.items() if path == "dense"})
        per_rank = self.max_over_ranks((seconds, sparse, _compile_seconds() - compiled_before, dense_reasons))
        return dict(seconds=max(r[0] for r in per_rank), seconds_per_rank=[round(r[0], 3) for r in per_rank],
                    sparse_calls_per_rank=[r[1] for r in per_rank],
                    graph_compile_s=max(r[2] for r in per_rank), dense_reasons=per_rank[0][3])


def parallelize_heads(model, mesh) -> None:
    """Tensor parallelism as commonly planned: q/k/v and gate/up split by output features (heads), o/down by input
    features; attention sees each rank's local heads as plain tensors."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for layer in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{layer}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{layer}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


@contextlib.contextmanager
def attention_replaced(fn):
    """The op's attention (``pipeline.attend``: after the Ulysses all-to-all, on whole sequences) replaced by
    ``fn``."""
    from sparse_compile import pipeline

    real = pipeline.attend
    pipeline.attend = functools.partial(fn, real)
    try:
        yield
    finally:
        pipeline.attend = real


def floor_and_capture(runner: Runner, prompt, capture: bool = True, reps: int = 1) -> tuple[dict, tuple]:
    """The floor (attention doing nothing) timed, and with ``capture`` layer ``CAPTURE_LAYER``'s whole-sequence q, k
    on this rank (what a calibrated density needs; at 1M tokens 2.5 GiB a rank, so only then)."""
    captured = {}

    def noop(real, q, k, v, scale, config, site, dense, **kwargs):
        if capture and f"layers.{CAPTURE_LAYER}." in site and "qk" not in captured:
            captured["qk"] = (q.detach().clone(), k.detach().clone())
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    with attention_replaced(noop):
        first = runner.timed(prompt, {})  # the first call at this length: Dynamo and Inductor compile here if needed
        row = runner.timed(prompt, {}) if reps > 0 else dict(first)
    row.update(first_seconds=first["seconds"], graph_compile_s=first["graph_compile_s"])
    return row, captured.get("qk")


def attention_seconds(runner: Runner, prompt, region: dict) -> list:
    """Each rank's seconds inside attention in one call (CUDA events around every op call)."""
    events = []

    def timed(real, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(*args, **kwargs)
        end.record()
        events.append((start, end))
        return out

    with attention_replaced(timed):
        runner.call(prompt, region)
    runner.sync()
    return runner.max_over_ranks(sum(s.elapsed_time(e) for s, e in events) / 1e3)


@contextlib.contextmanager
def first_call_probe():
    """Where a first call's extra time goes: host seconds inside the op (synchronised around each call) and the
    Triton kernels compiled or loaded from the disk cache during it (Triton's JIT hook, where this Triton has one)."""
    found = {"op_s": 0.0, "kernels": 0}

    def count(*args, **kwargs):
        found["kernels"] += 1
        return False

    knobs = getattr(__import__("triton"), "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    previous = getattr(runtime, "jit_cache_hook", None) if runtime is not None else None
    if runtime is not None and hasattr(runtime, "jit_cache_hook"):
        runtime.jit_cache_hook = count

    def timed(real, *args, **kwargs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = real(*args, **kwargs)
        torch.cuda.synchronize()
        found["op_s"] += time.perf_counter() - started
        return out

    try:
        with attention_replaced(timed):
            yield found
    finally:
        if runtime is not None and hasattr(runtime, "jit_cache_hook"):
            runtime.jit_cache_hook = previous


def _tokens(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


def _card(device: str) -> str:
    """The card's short name: "NVIDIA H100 80GB HBM3" -> "H100"."""
    words = [w for w in str(device).split() if w not in ("NVIDIA", "Tesla")]
    return words[0] if words else str(device)


def latest_runs(store: Path) -> dict:
    """(GPUs, parallelism, card), N, setting -> the last measurement of that cell, one wide row (lists decoded)."""
    runs: dict = {}  # long rows -> one wide row per measurement (a run's command and date, GPUs, N, setting)
    for line in store.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        parallel = row.get("parallel") or ("sequence" if row["gpus"] > 1 else "none")
        card = _card(row.get("device", ""))
        wide = runs.setdefault((row["date"], row["command"], row["gpus"], parallel, card, row["N"], row["setting"]), {
            key: value for key, value in row.items() if key not in ("metric", "value")})
        wide[row["metric"]] = row["value"]
        wide["parallel"], wide["card"] = parallel, card
    latest: dict = {}
    for wide in sorted(runs.values(), key=lambda w: w["date"]):
        for key, value in wide.items():
            if isinstance(value, str) and value[:1] == "[":
                wide[key] = json.loads(value)
        if "ttft_s" in wide:
            latest[((wide["gpus"], wide["parallel"], wide["card"]), wide["N"], wide["setting"])] = wide
    return latest


def dense_seconds(latest: dict) -> dict:
    """(GPUs, parallelism, card), N -> (dense TTFT seconds, fitted?): measured where dense ran, else the floor
    (measured, linear in N) plus dense attention at the longest timed length on the same GPUs scaled by N^2."""
    dense_at: dict = {}
    for gpus in sorted({g for g, _, _ in latest}):
        timed = sorted((n, r) for (g, n, s), r in latest.items() if g == gpus and s == "dense")
        floors = {n: r["ttft_s"] for (g, n, s), r in latest.items() if g == gpus and s == "floor"}
        for n in sorted({n for g, n, _ in latest if g == gpus}):
            measured = [r for m, r in timed if m == n]
            if measured:
                dense_at[(gpus, n)] = (measured[0]["ttft_s"], False)
            elif timed and n in floors:
                m, r = timed[-1]
                attention = r["ttft_s"] - floors[m]
                dense_at[(gpus, n)] = (floors[n] + attention * (n / m) ** 2, True)
    return dense_at


def report(store: Path, out: Path) -> str:
    """The table (markdown) and the plot (TTFT against length, one line per setting and GPU count) from a store.

    Dense at lengths it was not timed at is extrapolated (``dense_seconds``); such cells are marked "fit"."""
    latest = latest_runs(store)
    lines = ["| GPUs | N | setting | density | TTFT s | vs dense | first call / steady | sparse calls per rank "
             "| peak GiB per GPU | attention spread across ranks | scaling vs 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense_at = dense_seconds(latest)

    def label(gpus) -> str:
        return f"{gpus[0]} {gpus[2]}" + (" (tensor)" if gpus[1] == "tensor" else "")

    for (gpus, n, setting), row in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "dense")):
        if setting == "floor":
            continue
        dense, fitted = dense_at.get((gpus, n), (None, False))
        ratio = f"{dense / row['ttft_s']:.2f}x" + (" (fit)" if fitted else "") if dense else "-"
        first = row.get("first_call_ratio") or (row["first_call_s"] / row["ttft_s"] if row.get("first_call_s") else None)
        calls = row.get("sparse_calls_per_rank") or []
        peak = max(row.get("peak_gib_per_rank") or [0])
        spread = row.get("attention_spread")
        scaling = "-"
        one = (1, "none", gpus[2])
        if gpus != one and (one, n, setting) in latest:
            scaling = f"{latest[(one, n, setting)]['ttft_s'] / (gpus[0] * row['ttft_s']):.0%}"
        density = row.get("density")
        lines.append(f"| {label(gpus)} | {_tokens(n)} | {setting} | {density:.3f} |" if density else
                     f"| {label(gpus)} | {_tokens(n)} | {setting} | - |")
        lines[-1] += (f" {row['ttft_s']:.2f} | {ratio} | {f'{first:.2f}' if first else '-'} | "
                      f"{', '.join(str(c) for c in calls[0]) if calls else '-'} | {peak:.1f} | "
                      f"{f'{spread:.1%}' if spread is not None else '-'} | {scaling} |")
    for (gpus, n), (seconds, fitted) in sorted(dense_at.items()):
        if fitted:
            lines.append(f"| {label(gpus)} | {_tokens(n)} | dense (fit) | - | {seconds:.1f} | 1.00x | - | - | - | - | - |")
    table = "\n".join(lines)
    (out / "bench_parallel.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table
    figure, axis = plt.subplots(figsize=(8.5, 4.5))
    settings = sorted({s for _, _, s in latest if s != "floor"}, key=lambda s: (s != "dense", s))
    colors = {s: f"C{i}" for i, s in enumerate(settings)}
    styles = {1: ":", 2: "--", 4: "-"}
    for gpus in sorted({g for g, _, _ in latest}):
        for setting in settings:
            points = sorted((n, r["ttft_s"]) for (g, n, s), r in latest.items() if g == gpus and s == setting)
            if len(points) > 1:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[setting],
                          linestyle="-." if gpus[1] == "tensor" else styles.get(gpus[0], "-."),
                          label=f"{setting}, {label(gpus)} GPU")
    axis.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (s)",
             title="Llama-3.1-8B shape, Ulysses over 1 / 2 / 4 GPUs")
    axis.minorticks_off()
    axis.set_xticks([1 << 17, 1 << 18, 1 << 19, 1 << 20], ["128K", "256K", "512K", "1M"])
    axis.set_yticks([2, 5, 10, 20, 50, 100], ["2", "5", "10", "20", "50", "100"])
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(out / "bench_parallel.png", dpi=110)
    return table


def region_of(method: str) -> dict:
    """The ``sparsity(...)`` region a setting's calls run in (its density knob, if any, is added after calibration)."""
    return {"enabled": False} if method == "dense" else {"method": method}


def parse_setting(text: str) -> tuple[str, float | None]:
    method, _, density = text.partition("@")
    if method not in ("dense", "ring") and method not in sparse_compile.registry.registered_methods():
        raise SystemExit(f"unknown setting {text!r}: dense, ring, a method "
                         f"({list(sparse_compile.registry.registered_methods())}) or method@density")
    return method, float(density) if density else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--settings", nargs="+", default=["dense", "pbs@0.1", "pbs@0.05", "sampled"])
    parser.add_argument("--reps", type=int, default=1,
                        help="timed calls after each setting's first (0: the first is the time; with --warmup-length "
                             "it runs compiled graphs and kernels, as a dense call of minutes at 1M needs)")
    parser.add_argument("--warmup-length", type=int, default=None,
                        help="call the floor and every setting once at this length first, untimed: the graph "
                             "(dynamic) and the kernels compile there")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 32)")
    parser.add_argument("--parallel", choices=("sequence", "tensor"), default="sequence",
                        help="several GPUs: Ulysses sequence parallelism (default) or tensor parallelism")
    parser.add_argument("--balance", nargs="*", default=[], help="settings whose per-rank attention time is measured")
    parser.add_argument("--dense-max", type=int, default=1 << 30, help="longest length at which dense is timed")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo under torchrun)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="", help="free text stored with every row")
    parser.add_argument("--report", action="store_true",
                        help="only write the table and plot from <out>/bench_parallel.jsonl")
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.out) / "bench_parallel.jsonl", Path(args.out)))
        return
    settings = [parse_setting(s) for s in args.settings]
    if args.parallel == "tensor" and any(method == "ring" for method, _ in settings):
        raise SystemExit("the ring setting is sequence parallelism: not with --parallel tensor")

    if "WORLD_SIZE" in os.environ:
        cuda = torch.cuda.is_available() and not args.smoke
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    if args.smoke:
        args.lengths = [n for n in args.lengths if n <= 512] or [256]
    runner = Runner(args)
    meta = dict(gpus=runner.world, tag=args.tag, layers=runner.layers,
                parallel=args.parallel if runner.world > 1 else "none")
    out = Path(args.out)

    def emit(row: dict) -> None:
        row = dict(meta, **row)
        if runner.rank == 0:
            append_store("bench_parallel", [row], params=("N", "gpus", "layers", "parallel"), out_dir=out)
            brief = {k: row.get(k) for k in ("N", "setting", "ttft_s", "first_call_s", "graph_compile_s",
                                              "first_call_per_rank", "first_call_op_s_per_rank",
                                              "first_call_kernels_per_rank",
                                              "density", "sparse_calls_per_rank", "peak_gib_per_rank",
                                              "attention_s_per_rank", "error")}
            print(json.dumps(brief, default=str), flush=True)

    calibrating = any(density is not None for _, density in settings)
    if args.warmup_length:
        prompt = runner.prompt(args.warmup_length)
        floor_and_capture(runner, prompt, capture=False, reps=0)
        for method, density in settings:
            if method != "ring" and density is None:
                runner.timed(prompt, region_of(method))
        del prompt
    for n in args.lengths:
        prompt = runner.prompt(n)
        if runner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        floor, qk = {"seconds": None}, None
        if any(method != "ring" for method, _ in settings):  # ring alone runs the eager model: no floor to compile
            floor, qk = floor_and_capture(runner, prompt, capture=calibrating, reps=args.reps)
            timed_floor = {} if args.reps == 0 else dict(ttft_s=round(floor["seconds"], 3))  # reps 0: compiles in it
            emit(dict(N=n, setting="floor", **timed_floor,
                      seconds_per_rank=floor["seconds_per_rank"], first_call_s=round(floor["first_seconds"], 3),
                      graph_compile_s=round(floor["graph_compile_s"], 2)))
        for method, density in settings:
            name = method if density is None else f"{method}@{density}"
            if method in ("dense", "ring") and n > args.dense_max:
                continue
            if method == "ring":
                if runner.world == 1:
                    continue
                if runner.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    first = runner.timed(None, {}, call=functools.partial(runner.ring_call, n))
                    steady = min((runner.timed(None, {}, call=functools.partial(runner.ring_call, n))
                                  for _ in range(args.reps)), key=lambda r: r["seconds"])
                except Exception as error:  # PyTorch's context parallelism where it does not run: say so
                    print(f"rank {runner.rank}: ring failed: {type(error).__name__}: {error}", file=sys.stderr)
                    emit(dict(N=n, setting=name, error=f"{type(error).__name__}: {str(error)[:300]}"))
                    continue
                peak = torch.cuda.max_memory_allocated() / 2**30 if runner.device.type == "cuda" else 0.0
                emit(dict(N=n, setting=name, ttft_s=round(steady["seconds"], 3),
                          seconds_per_rank=steady["seconds_per_rank"], first_call_s=round(first["seconds"], 3),
                          sparse_calls_per_rank=[steady["sparse_calls_per_rank"]],
                          peak_gib_per_rank=runner.max_over_ranks(round(peak, 2)), sm_clock_mhz=sm_clock_mhz()))
                continue
            region = region_of(method)
            achieved = None
            if density is not None:
                params, achieved = (calibrate(method, density, [qk], runner.base) if runner.rank == 0 else ({}, None))
                if runner.world > 1:
                    box = [(params, achieved)]
                    dist.broadcast_object_list(box, src=0)
                    params, achieved = box[0]
                region.update(params)
            if runner.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if runner.device.type == "cuda":
                with first_call_probe() as probe:
                    first = runner.timed(prompt, region)
                first["op_s_per_rank"] = runner.max_over_ranks(round(probe["op_s"], 3))
                first["kernels_per_rank"] = runner.max_over_ranks(probe["kernels"])
            else:
                first = runner.timed(prompt, region)
            times = [runner.timed(prompt, region) for _ in range(args.reps)] or [first]
            times.sort(key=lambda r: r["seconds"])
            steady = times[len(times) // 2]
            peak = torch.cuda.max_memory_allocated() / 2**30 if runner.device.type == "cuda" else 0.0
            row = dict(N=n, setting=name, ttft_s=round(steady["seconds"], 3),
                       seconds_per_rank=steady["seconds_per_rank"], first_call_s=round(first["seconds"], 3),
                       graph_compile_s=round(first["graph_compile_s"], 2),
                       first_call_op_overhead=round((first["seconds"] - first["graph_compile_s"]) / steady["seconds"],
                                                    3),
                       first_call_per_rank=first["seconds_per_rank"],
                       first_call_op_s_per_rank=first.get("op_s_per_rank"),
                       first_call_kernels_per_rank=first.get("kernels_per_rank"),
                       density=achieved, params={k: v for k, v in region.items() if k != "method"},
                       sparse_calls_per_rank=[r["sparse_calls_per_rank"] for r in times],
                       dense_reasons=steady["dense_reasons"], floor_s=floor["seconds"] if args.reps else None,
                       peak_gib_per_rank=runner.max_over_ranks(round(peak, 2)), sm_clock_mhz=sm_clock_mhz())
            if name in args.balance and runner.device.type == "cuda":
                per_rank = attention_seconds(runner, prompt, region)
                row["attention_s_per_rank"] = [round(s, 3) for s in per_rank]
                row["attention_spread"] = round((max(per_rank) - min(per_rank)) / (sum(per_rank) / len(per_rank)), 4)
            emit(row)
        del qk
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
