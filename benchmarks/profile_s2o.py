"""Hardware counters of S2O's kernels against our dense kernel (issue 11, item 2), for Nsight Compute.

    ncu --profile-from-start off --clock-control none --set full -k regex:_hopper_fwd -o OUT/s2o \
        python benchmarks/profile_s2o.py --length 65536

Builds S2O's plan at its defaults on structured inputs, runs its window pass once (the walks resume from its
state), warms every contender up, then runs each once inside ``cudaProfilerStart`` / ``Stop`` and an NVTX range
named after it, in this order:

* ``dense``: our dense kernel, every causal tile (TMA);
* ``walk_gather``: the resumed ranked walk with early stop, keys gathered in place (what 64K-128K run);
* ``walk_copy``: the same reading a permuted copy of the whole list by TMA (the copy is not profiled);
* ``static_gather`` / ``static_copy``: the tiles the walk visited as a static plan (no vote), both key modes;
* ``window``: the intra-segment window pass.

The walks' visited tiles are printed, so that per-tile rates can be set against the counters.

``--time V [V ...]`` (no profiler): sets ``--constant`` (a ``kernels.hopper`` module constant, default
``GATHER_ROWS_PER_COPY``) to each value in turn and times our dense kernel, the window pass and the gathered walk
under each, all alternately in one loop (queued, medians), for each ``--lengths`` entry. Each one's efficiency per
visited tile is against the dense kernel under the first value; S2O's is window + walk. Every value's outputs are
checked bit for bit against the first value's (for constants that change a schedule, not the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_breakeven import HQ, _static_plan, _with_module_value, alternate, in_model_layout  # noqa: E402
from bench_methods import structured_inputs  # noqa: E402
from sparse_compile import SparseConfig  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.methods.s2o import _window_plan  # noqa: E402
from sparse_compile.plan import causal_plan, execute_plan  # noqa: E402
from harness import sm_clock_mhz, write_results  # noqa: E402
from sparse_compile.kernels import hopper  # noqa: E402  (the module the kernels run from)

CONTENDERS = ("dense", "walk_gather", "walk_copy", "static_gather", "static_copy", "window")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--only", nargs="*", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--time", nargs="*", type=int, default=None, metavar="V")
    parser.add_argument("--constant", default="GATHER_ROWS_PER_COPY")
    parser.add_argument("--lengths", nargs="*", type=int, default=[32768, 65536])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.time is not None:
        rows = [time_sweep(n, args.constant, args.time, args.reps) for n in args.lengths]
        print(write_results(args.constant.lower(), rows, out_dir=args.out))
        return
    n = args.length
    with torch.no_grad():
        q, k, v, scale, plan, window, lse, passes, walked, dense = _s2o_walk_setup(n)
        static = _static_plan(plan, walked + torch.minimum(plan.masked_counts, plan.tile_counts))
        contenders = {
            "dense": lambda: execute_plan(q, k, v, dense, scale, kernel="triton"),
            "walk_gather": lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode="gather", **passes),
            "walk_copy": lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode="copy", **passes),
            "static_gather": lambda: execute_plan(q, k, v, static, scale, kernel="triton", key_mode="gather",
                                                  **passes),
            "static_copy": lambda: execute_plan(q, k, v, static, scale, kernel="triton", key_mode="copy", **passes),
            "window": lambda: execute_plan(q, k, v, window, scale, kernel="triton", lse=lse),
        }
        for name in args.only:
            contenders[name]()
        torch.cuda.synchronize()
        print(json.dumps({"N": n, "walk_tiles": int(walked.sum()), "window_tiles": int(window.tile_counts.sum()),
                          "dense_tiles": int(dense.tile_counts.sum()), "order": args.only}), flush=True)
        for name in args.only:
            torch.cuda.nvtx.range_push(name)
            torch.cuda.profiler.start()
            contenders[name]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()


def _s2o_walk_setup(n: int):
    """S2O at its defaults on structured inputs of length ``n``: (q, k, v, scale, plan, window plan, lse, the
    resumed walk's pass arguments, the tiles the walk visits, the dense causal plan). The window pass has run once;
    the walks resume from its state in place (repeated calls change the values, not the work)."""
    q, k, v = in_model_layout(*structured_inputs(n, device="cuda"))
    scale = 1.0 / math.sqrt(q.shape[-1])
    config = SparseConfig(method="s2o")
    plan = build_plan(q, k, scale, config)
    window = _window_plan(q, config.params_of("s2o").segment_size, plan.block_m, plan.block_n)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    state = execute_plan(q, k, v, window, scale, kernel="triton", lse=lse)
    passes = {"out": state, "lse": lse, "resume": True, "skip_masked": True}
    _, walked = execute_plan(q, k, v, plan, scale, kernel="triton", return_visited=True, key_mode="gather", **passes)
    dense = causal_plan(1, HQ, n, n, 128, 128, device="cuda")
    return q, k, v, scale, plan, window, lse, passes, walked, dense


def time_sweep(n: int, constant: str, values, reps: int) -> dict:
    with torch.no_grad():
        q, k, v, scale, plan, window, lse, passes, walked, dense = _s2o_walk_setup(n)
        state, first = passes["out"].clone(), None
        runs = {
            "dense": lambda: execute_plan(q, k, v, dense, scale, kernel="triton"),
            "window": lambda: execute_plan(q, k, v, window, scale, kernel="triton", lse=lse),
            "walk": lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode="gather", **passes),
        }
        contenders = {}
        for value in values:
            outputs = []
            for name, run in runs.items():
                timed = _with_module_value(hopper, constant, value, run)
                contenders[f"{name}_{value}"] = timed
                if name == "walk":
                    passes["out"].copy_(state)  # the walk resumes in place: from the same state for every value
                outputs.append(timed().clone())
                if name == "window":
                    outputs.append(lse.clone())
            if first is None:
                first = outputs
            elif not all(torch.equal(a, b) for a, b in zip(first, outputs)):
                raise AssertionError(f"{constant}={value} changed an output against {constant}={values[0]}")
        ms = alternate(contenders, reps, queue_ahead=10_000_000)
    ms = {name: ms[name] for name in contenders}  # medians (``alternate`` also gives means)
    dense_tiles = float(dense.tile_counts.sum())
    shares = {"window": float(window.tile_counts.sum()) / dense_tiles,
              "walk": float(walked.sum()) / dense_tiles}
    base = ms[f"dense_{values[0]}"]
    row = {"N": n, "constant": constant, "window_density": shares["window"], "walk_density": shares["walk"],
           "sm_clock_mhz": sm_clock_mhz()}
    for value in values:
        for name in runs:
            t = ms[f"{name}_{value}"]
            row[f"{name}_{value}_ms"] = t
            row[f"{name}_{value}_efficiency"] = shares.get(name, 1.0) * base / t
        s2o = ms[f"window_{value}"] + ms[f"walk_{value}"]
        row[f"s2o_{value}_ms"] = s2o
        row[f"s2o_{value}_efficiency"] = (shares["window"] + shares["walk"]) * base / s2o
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
