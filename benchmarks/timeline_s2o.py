"""Where a CTA's cycles go (issue 11, item 2): every CTA of our dense kernel, S2O's window pass and its walk
stamps its SM's clock64 at its phases (``kernels.hopper.TIMELINE_BUFFER``), and this script sums them.

    python benchmarks/timeline_s2o.py --lengths 16384 32768

Per CTA and compute warpgroup: start, Q ready, first S = Q K^T landed, last P V landed, end; the load partition's
start and end; the SM. Reported per kernel (means over CTAs, cycles): the launch gap (from the previous CTA's last
warpgroup's end to this CTA's first stamp on the same SM), Q's wait, the first tile's S, the loop per further tile,
the epilogue, and the share of the SMs' span that each takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_breakeven import _with_module_value  # noqa: E402
from profile_s2o import _s2o_walk_setup  # noqa: E402
from sparse_compile.plan import execute_plan  # noqa: E402
from sparse_compile.kernels import hopper  # noqa: E402  (the module the kernels run from)
from harness import write_results  # noqa: E402


def stamped(run, grid: int, constants: dict) -> torch.Tensor:
    """``run`` once with ``kernels.hopper``'s ``constants`` and a fresh timeline buffer set; the buffer."""
    buf = torch.zeros(grid, 16, dtype=torch.int64, device="cuda")
    for name, value in {"TIMELINE_BUFFER": buf, **constants}.items():
        run = _with_module_value(hopper, name, value, run)
    run()
    torch.cuda.synchronize()
    return buf.cpu()


def summarise(name: str, n: int, t: torch.Tensor) -> dict:
    t = t.double()
    sm, ntile = t[:, 0], t[:, 14]
    start = torch.stack([t[:, 1], t[:, 6], t[:, 11]], 1).min(1).values
    end = torch.maximum(t[:, 5], t[:, 10])
    row = {"kernel": name, "N": n, "ctas": int(t.shape[0]), "tiles_listed": float(ntile.sum())}
    gaps, spans = [], []
    for s in sm.unique():
        idx = (sm == s).nonzero().flatten()
        order = idx[start[idx].argsort()]
        st, en = start[order], end[order]
        gaps.append(st[1:] - en[:-1])
        spans.append(float(en.max() - st.min()))
    gap = torch.cat(gaps)
    row["gap_mean"] = float(gap.clamp(min=0).mean())
    row["gap_negative_share"] = float((gap < 0).double().mean())  # two CTAs resident at once would show here
    for wg, base in (("wg0", 1), ("wg1", 6)):
        s0, q, f, last, e = (t[:, base + i] for i in range(5))
        has_last = (last > 0) & (ntile >= 2)
        row[f"{wg}_q_wait"] = float((q - s0).mean())
        row[f"{wg}_first_s"] = float((f - q)[ntile > 0].mean())
        row[f"{wg}_loop_per_tile"] = float(((last - f)[has_last] / (ntile[has_last] - 1)).mean()) \
            if has_last.any() else None
        row[f"{wg}_epilogue"] = float((e - last)[last > 0].mean()) if (last > 0).any() else None
        row[f"{wg}_total"] = float((e - s0).mean())
    row["producer_total"] = float((t[:, 13] - t[:, 11]).mean())
    row["start_skew_wg1_minus_wg0"] = float((t[:, 6] - t[:, 1]).mean())
    busy = float((end - start).sum())
    row["sm_span_busy_share"] = busy / sum(spans)
    row["cycles_per_listed_tile"] = sum(spans) / max(float(ntile.sum()), 1.0)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="*", type=int, default=[16384, 32768])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    with torch.no_grad():
        for n in args.lengths:
            q, k, v, scale, plan, window, lse, passes, walked, dense = _s2o_walk_setup(n)
            grid = q.shape[0] * q.shape[1] * dense.tile_counts.shape[-1]
            runs = {
                "dense": lambda: execute_plan(q, k, v, dense, scale, kernel="triton"),
                "window": lambda: execute_plan(q, k, v, window, scale, kernel="triton", lse=lse),
                "walk": lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode="gather", **passes),
            }
            variants = {"dense": {"": {}, "_persistent": {"PERSISTENT": True}},
                        "window": {"": {}, "_one_cta_per_block": {"PERSISTENT": False}}, "walk": {"": {}}}
            for name, run in runs.items():
                for suffix, constants in variants[name].items():
                    stamped(run, grid, constants)  # compile and warm
                    rows.append(summarise(name + suffix, n, stamped(run, grid, constants)))
    print(write_results("timeline_s2o", rows, out_dir=args.out))


if __name__ == "__main__":
    main()
