"""Where the time of one sparse attention layer goes inside the end-to-end model, against the isolated parts.

    python benchmarks/profile_layer.py --lengths 32768 65536          # H100
    python benchmarks/profile_layer.py --smoke                        # CPU: tiny model, checks the script

``bench_e2e.py`` gives whole-model TTFT; when a method's per-layer cost there disagrees with what
``bench_kernel.py`` and ``bench_methods.py`` predict, this script finds the gap. On the Llama-3.1-8B shape with
``--layers`` decoder layers (default 2), per length:

* **isolated**, on the Q/K/V the model hands to attention (its strides kept, and as contiguous copies): dense SDPA,
  then per method ``build_plan``, the kernel on the plan, and the registered op (plan + kernel + dispatch);
* **in situ**: each method's sparse call inside the compiled model, timed with a synchronisation around it (one
  untimed-by-TTFT pass), with the strides the op received;
* **model**: TTFT of the regionally compiled model per contender, and the per-layer cost
  ``(TTFT - TTFT_floor) / layers`` beside the isolated prediction;
* a ``torch.profiler`` table of one forward per method (``<name>_<method>_<N>.txt``).

Writes ``<name>.json``/``.md`` (rows: N, part, method, ms, density, detail) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from density_calibration import METHODS  # noqa: E402
from e2e_model import build_model, capture_qkv, compile_contenders, sync, ttft  # noqa: E402
from harness import RUNS_DIR, time_ms, write_results  # noqa: E402


def profile_table(fn, ids) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        fn(ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for key in ("self_cuda_time_total", "self_device_time_total", "self_cpu_time_total"):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return "profiler table unavailable"


class InSituTimer:
    """Wraps ``sparse_compile.pipeline.run_method`` for one pass: its synchronised wall time and the strides it saw.

    Diagnostic only, restored on exit (the library itself never patches anything).
    """

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from sparse_compile import pipeline

        self._pipeline, self._original = pipeline, pipeline.run_method

        def timed(q, k, v, *args, **kwargs):  # whatever else run_method takes passes through
            sync()
            start = time.perf_counter()
            result = self._original(q, k, v, *args, **kwargs)
            sync()
            self.calls.append({"ms": (time.perf_counter() - start) * 1e3, "q_stride": tuple(q.stride()),
                               "k_stride": tuple(k.stride()), "v_stride": tuple(v.stride())})
            return result

        pipeline.run_method = timed
        return self

    def __exit__(self, *exc):
        self._pipeline.run_method = self._original
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="profile_layer")
    args = parser.parse_args()

    from sparse_compile.methods import build_plan
    from sparse_compile.site import SiteSpec
    from sparse_compile.plan import execute_plan as execute  # the Triton kernel on CUDA, the reference otherwise
    from sparse_compile.report import density_from_visits

    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        timer = time_ms
    else:
        def timer(fn):
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    if args.smoke:
        args.lengths = [256]
        base = sparse_compile.SparseConfig(
            min_seq_len=128, pbs={"block_size": 32, "segment_size": 64},
            sparge={"block_size_q": 32, "block_size_kv": 32},
            bfla={"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32},
            s2o={"segment_size": 64, "block_size_q": 32, "block_size_kv": 32})
    else:
        base = sparse_compile.SparseConfig(min_seq_len=4096)
    options = {"min_seq_len": base.min_seq_len, **{m: base.params_of(m) for m in ("pbs", "sparge", "bfla", "s2o")}}
    out_dir = Path(args.out) if args.out else RUNS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"{args.name}.jsonl"
    partial.write_text("")
    rows = []

    def emit(**row):
        row.setdefault("detail", "")
        rows.append(row)
        with partial.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    torch.manual_seed(0)
    model = build_model(args.smoke, device, dtype, num_layers=args.layers)
    compiled, _, compiled_floor = compile_contenders(
        model, options, types.SimpleNamespace(regional=True, inductor=False))
    run = lambda ids: compiled(ids, logits_to_keep=1)  # noqa: E731

    def floor(ids):
        return compiled_floor(ids, logits_to_keep=1)

    for n in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        q, k, v = capture_qkv(model, ids, layer=0)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # eager transformers hands over q in (B, N, H, D) storage and the cache's k/v contiguous; inside the compiled
        # region Inductor may lay all three out as (B, N, H, D)
        layouts = {"as passed": (q, k, v), "contiguous": tuple(t.contiguous() for t in (q, k, v)),
                   "BNHD storage": tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))}
        emit(N=n, part="layout", method="-", ms=None, density=None,
             detail=f"q {tuple(q.shape)} stride {q.stride()}, k stride {k.stride()}, v stride {v.stride()}")
        dense = {}
        for name, (qq, kk, vv) in layouts.items():
            with torch.no_grad():
                dense[name] = timer(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=True, enable_gqa=True))
            emit(N=n, part=f"isolated dense SDPA ({name})", method="dense", ms=dense[name], density=1.0)
        for method in args.methods:
            config = base.with_overrides(method)
            with torch.no_grad():
                t_plan = timer(lambda: build_plan(q, k, scale, config))
                plan = build_plan(q, k, scale, config)
                listed = float(plan.density(n, n, q.shape[1]).mean())
                _, visited = execute(q, k, v, plan, scale, return_visited=True)
                visits = density_from_visits(visited, plan, n, n, q.shape[1])
                rho = sum(visits) / len(visits)
                detail = f"{plan!r}, listed {listed:.3f}"
                emit(N=n, part="isolated build_plan", method=method, ms=t_plan, density=rho, detail=detail)
                for name, (qq, kk, vv) in layouts.items():
                    t_kernel = timer(lambda: execute(qq, kk, vv, plan, scale))
                    emit(N=n, part=f"isolated kernel ({name})", method=method, ms=t_kernel, density=rho,
                         detail=f"efficiency vs dense {(rho * dense[name]) / t_kernel:.2f}")
                spec = SiteSpec("profile", config, enable_gqa=True).to_json()
                with sparse_compile.sparsity(method=method):
                    t_op = timer(lambda: torch.ops.sparse_compile.causal_attention(q, k, v, None, spec))
                emit(N=n, part="isolated op (plan+kernel+dispatch)", method=method, ms=t_op, density=rho)
            del plan, visited

        t_floor = ttft(floor, ids, args.reps)
        emit(N=n, part="model TTFT", method="floor", ms=t_floor * 1e3, density=None)
        with sparse_compile.sparsity(enabled=False):
            t_dense = ttft(run, ids, args.reps)
        emit(N=n, part="model TTFT", method="dense (compiled)", ms=t_dense * 1e3, density=1.0,
             detail=f"per layer {(t_dense - t_floor) * 1e3 / args.layers:.2f} ms")
        for method in args.methods:
            with sparse_compile.sparsity(method=method):
                t = ttft(run, ids, args.reps)
                with torch.no_grad(), InSituTimer() as situ:
                    run(ids)
            per_layer = (t - t_floor) * 1e3 / args.layers
            calls = situ.calls
            emit(N=n, part="model TTFT", method=method, ms=t * 1e3, density=None,
                 detail=f"per layer {per_layer:.2f} ms")
            if calls:
                emit(N=n, part="in situ run_sparse (synced)", method=method,
                     ms=sum(c["ms"] for c in calls) / len(calls), density=None,
                     detail=f"{len(calls)} calls; q stride {calls[0]['q_stride']}, k stride {calls[0]['k_stride']}")
            if not args.no_profile:
                with sparse_compile.sparsity(method=method):
                    table = profile_table(run, ids)
                (out_dir / f"{args.name}_{method}_{n}.txt").write_text(table)
        if not args.no_profile:
            with sparse_compile.sparsity(enabled=False):
                (out_dir / f"{args.name}_dense_{n}.txt").write_text(profile_table(run, ids))
        del q, k, v, layouts
        if cuda:
            torch.cuda.empty_cache()

    table = write_results(args.name, rows, meta={"model": f"Llama-3.1-8B shape, {args.layers} layers",
                                                 "dtype": str(dtype), "device": device},
                          columns=["N", "part", "method", "ms", "density", "detail"], out_dir=args.out,
                          store=None if args.smoke and not args.out else "bench_profile_layer", params=("N",))
    print(table)


if __name__ == "__main__":
    main()
