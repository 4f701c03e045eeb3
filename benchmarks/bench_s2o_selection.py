"""S2O's selection piece by piece on the GPU: each piece of ``reorder_s2o_fast`` / ``select_s2o_fast`` timed behind a
GPU sleep (device time, as inside a forward pass), alternating with cuDNN SDPA in one loop; medians.

Also times the query pass (``block_pool`` with the fused in-segment sort) at other launch shapes (warps, rows per
load), so that the shipped shape is a measured choice.

    python benchmarks/bench_s2o_selection.py --n 16384 32768 65536     # H100, ~1 min
    python benchmarks/bench_s2o_selection.py --smoke                   # CPU, interpreter-sized
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import alternating_ms, sm_clock_mhz, write_results  # noqa: E402

from sparse_compile import S2OParams, SparseConfig  # noqa: E402
from sparse_compile.kernels import pooling  # noqa: E402
from sparse_compile.kernels import s2o as s2o_kernels  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.methods._common import finite_row_mean  # noqa: E402
from sparse_compile.methods.s2o import _s2o_width  # noqa: E402

QUEUE_CYCLES = 4_000_000


def pool_launch(x, segment, *, warps: int, chunk: int, guide=None):
    """``block_pool(x, segment, guide=guide, sort_guide=guide is not None, finite_rows_mean=True)`` at a chosen
    launch shape (warps, rows per load)."""
    B, H, N, D = x.shape
    nb = -(-N // segment)
    dev = x.device
    mean = torch.empty(B, H, nb, D, dtype=torch.float32, device=dev)
    gdot = torch.empty(B, H, N, dtype=torch.float32, device=dev)
    order = torch.empty(B, H, N, dtype=torch.int32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    idx = torch.empty(1, 1, 1, dtype=torch.int32, device=dev)
    g = guide.float().contiguous() if guide is not None else torch.empty(1, 1, 1, dtype=torch.float32, device=dev)

    def run():
        pooling._pool_kernel[(nb, B * H)](
            x, *x.stride(), idx, *idx.stride(), g, g.stride(0), g.stride(1),
            mean, dummy, dummy, dummy, dummy, gdot, order, H, N, N, nb, max(1, H // g.shape[1]),
            BLOCK=segment, BLOCKS_PER_PROGRAM=1, CHUNK=chunk, D=D, D_PAD=max(16, D), HAS_INDEX=False,
            WANT_MEAN=True, WANT_SIM=False, WANT_POS=False, WANT_GUIDE=guide is not None,
            SORT_GUIDE=guide is not None, FINITE_ROWS_MEAN=True, ROW_SLOTS=chunk if chunk < segment else 1,
            num_warps=warps)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pool-shapes", default="4x64,8x64,8x128,4x32,4x128,16x128",
                    help="query-pass launch shapes to time, warps x rows per load")
    ap.add_argument("--guide-shapes", default="4x64,8x64,8x128,16x128,16x64",
                    help="the guide key as one pooling launch, at these shapes")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="s2o_selection_parts")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    B, HQ, HKV, D, S = (1, 32, 8, 128, 2048) if cuda else (1, 4, 2, 16, 64)
    lengths = args.n if cuda else [256]
    dtype = torch.bfloat16 if cuda else torch.float16
    cfg = (SparseConfig(method="s2o", planner="fast") if cuda else
           SparseConfig(method="s2o", planner="fast", min_seq_len=64,
                        s2o=S2OParams(segment_size=S, block_size_q=16, block_size_kv=16)))
    rows = []
    for n in lengths:
        gen = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(B, HQ, n, D, device=dev, dtype=dtype, generator=gen)
        k = torch.randn(B, HKV, n, D, device=dev, dtype=dtype, generator=gen)
        v = torch.randn(B, HKV, n, D, device=dev, dtype=dtype, generator=gen)
        scale = 1 / math.sqrt(D)
        params = cfg.params_of("s2o")
        layout, _ = _s2o_width(n, S, params.block_size_kv)
        g = len(layout.seg_len)
        guide = finite_row_mean(k[:, :, :S], dim=2)
        pool = pooling.block_pool(q, S, guide=guide, sort_guide=True, finite_rows_mean=True)
        q_mean = pool.mean.view(B, HKV, HQ // HKV, g, D).mean(2)
        ranking = s2o_kernels.s2o_rank_keys(k, q_mean, S)
        total = S * g * (g - 1) // 2
        keys32 = torch.randint(-2**31, 2**31 - 1, (B * HKV * total,), device=dev, dtype=torch.int32)
        keys64 = keys32.long() << 20
        seg16 = torch.randint(0, B * HKV * g, (B * HKV * total,), device=dev, dtype=torch.int16)
        contenders = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True),
            "build_plan": lambda: build_plan(q, k, scale, cfg, implementation="fast"),
            "guide": lambda: finite_row_mean(k[:, :, :S], dim=2),
            "query_pass": lambda: pooling.block_pool(q, S, guide=guide, sort_guide=True, finite_rows_mean=True),
            "group_mean": lambda: pool.mean.view(B, HKV, HQ // HKV, g, D).mean(2),
            "ranking": lambda: s2o_kernels.s2o_rank_keys(k, q_mean, S),
            "assemble": lambda: s2o_kernels.s2o_assemble(ranking, B, HKV, n, S, params.block_size_kv, layout.length),
            "sort_int32": lambda: torch.sort(keys32, stable=True),
            "sort_int16": lambda: torch.sort(seg16, stable=True),
            "sort_int64_packed": lambda: torch.sort(keys64),
        }
        if cuda:
            for shape in args.pool_shapes.split(","):
                warps, chunk = (int(x) for x in shape.split("x"))
                contenders[f"query_pass_{shape}"] = pool_launch(q, S, warps=warps, chunk=chunk, guide=guide)
            k_first = k[:, :, :S]
            for shape in args.guide_shapes.split(","):
                warps, chunk = (int(x) for x in shape.split("x"))
                contenders[f"guide_pool_{shape}"] = pool_launch(k_first, S, warps=warps, chunk=chunk)
        clock0 = sm_clock_mhz()
        ms = alternating_ms(contenders, args.reps if cuda else 1, warmup=2 if cuda else 1,
                            queue_ahead=QUEUE_CYCLES if cuda else False)
        clock1 = sm_clock_mhz()
        for name, t in ms.items():
            rows.append({"N": n, "piece": name, "ms": t, "pct_of_sdpa": 100 * t / ms["sdpa"],
                         "list_entries": B * HKV * total, "sm_clock_mhz": f"{clock0}-{clock1}"})
        print("\n".join(f"{n:6d} {r['piece']:22s} {r['ms']:.4f} ms {r['pct_of_sdpa']:6.2f}%"
                        for r in rows if r["N"] == n), flush=True)
    if cuda:
        write_results(args.name, rows, meta={"reps": args.reps, "queue_cycles": QUEUE_CYCLES,
                                             "shape": dict(B=B, HQ=HQ, HKV=HKV, D=D, S=S)}, out_dir=args.out)


if __name__ == "__main__":
    main()
