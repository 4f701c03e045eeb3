"""Block-sparse attention core vs cuDNN SDPA (dense) and FlexAttention (same blocks), on one GPU.

Setup: bf16, B=1, Hq=32, Hkv=8, D=128, causal self-attention prefill, N in 8K..128K, 128x128 blocks.
Block lists at density rho of the causal blocks: per (head, query block) the diagonal block, the first block and
random others; the SAME lists for every sparse contender. Contenders:

* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, the default backend (cuDNN on the
  H100 with torch 2.11); dense, so the same time for every rho;
* ``flex``: FlexAttention (compiled) with a ``BlockMask.from_kv_blocks`` of the same blocks, diagonal blocks
  partial (causal ``mask_mod``), the rest full;
* ``bsa``: this project's kernel as ``sparse_compile.plan.execute_plan(kernel="triton")`` dispatches it (the Gluon
  Hopper kernel on an H100, the Triton kernel elsewhere) on contiguous keys; ``bsa_triton``: the Triton kernel;
* ``bsa_kidx_gather`` / ``bsa_kidx_copy``: the kernel reading keys through ``key_index`` (a random permutation
  inside segments of 256 keys), gathering rows in the loop / permuting K/V once per call into a contiguous copy.
  The permutation makes both tiles of a query block's own segment partial; the list gets the one extra partial
  tile it needs to stay exact (one tile per odd query block: negligible work).

Reported per cell: ms (median of alternating rounds: cuDNN and every contender timed in turn in one loop,
``benchmarks.harness.alternating_ms``, with the SM clock read before each cell), TFLOP/s on the computed blocks (visible pairs of
the kept tiles), and efficiency = rho * t_sdpa / t (1.0 = perfectly proportional to the dense time).

    python benchmarks/bench_kernel.py                     # the sweep; rows appended to results/bench_kernel.jsonl
    python benchmarks/bench_kernel.py --mode tune --n 32768   # launch-config sweep of the kernel
    ncu ... python benchmarks/bench_kernel.py --mode once --n 32768 --rho 1 0.1 --configs 128,128,8,3  # profile

The kernel ships one path: the v1 launch order and tile-offset schedules ("heads" order, "inloop" and
"causal_walk" offsets) that the ablations compared are no longer in it; their measurements are summarised in
docs/kernels.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    OOM,
    Rotating,
    alternating_ms,
    attention_flops,
    causal_pairs,
    guarded,
    rotation_count,
    sm_clock_mhz,
    tflops,
    time_ms,
    write_results,
)
from sparse_compile.kernels import KernelConfig  # noqa: E402
from sparse_compile.kernels.validate import expand_heads  # noqa: E402
from sparse_compile.plan import (  # noqa: E402
    VISIBLE_FULL,
    VISIBLE_NONE,
    VISIBLE_PARTIAL,
    block_visibility,
    execute_plan,
    plan_from_block_mask,
)

B, HQ, HKV, D = 1, 32, 8, 128
BLOCK = 128
SEGMENT = 256
DTYPE = torch.bfloat16  # --dtype float16 for CPU dry runs: bf16 tl.dot is wrong in Triton's interpreter


def parse_config(spec: str) -> KernelConfig:
    """``bm,bn,warps,stages[,masked_stages=S][,use_tma=0|1]`` -> KernelConfig, e.g. ``128,128,8,3,use_tma=0``."""
    parts = spec.split(",")
    bm, bn, w, st = (int(x) for x in parts[:4])
    extra = {}
    for item in parts[4:]:
        key, val = item.split("=", 1)
        if key == "masked_stages":
            extra[key] = int(val)
        elif key == "use_tma":
            extra[key] = val.lower() in ("1", "true", "on")
        else:
            raise ValueError(f"unknown launch option {key!r} in {spec!r}: masked_stages, use_tma")
    return KernelConfig(bm, bn, num_warps=w, num_stages=st, **extra)


def config_name(cfg: KernelConfig) -> str:
    s = f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"
    for key in ("masked_stages", "use_tma"):
        val = getattr(cfg, key)
        if val is not None:
            s += f",{key}={val}"
    return s


def run_kernel(q, k, v, plan, cfg=None, key_mode="auto"):
    """The kernel on ``plan`` through the package's adapter: on an H100 the Hopper kernel where it serves the plan
    (as users get it), the Triton kernel when ``cfg`` is given."""
    return execute_plan(q, k, v, plan, kernel="triton", config=cfg, key_mode=key_mode)


def triton_config(device) -> KernelConfig:
    """The Triton kernel's own default launch config (passing it selects the Triton kernel on any GPU)."""
    from sparse_compile.kernels.attention import default_config

    return default_config(BLOCK, BLOCK, head_dim_pad=D, dtype=DTYPE, device=torch.device(device), exact=False)


def timing_reps(n: int, scale: float) -> int:
    """Alternating rounds per cell: ~30 at 8K down to 5 at 128K (one 128K call is ~0.25 s)."""
    return max(3, round({8192: 30, 16384: 20, 32768: 12, 65536: 7}.get(n, 5) * scale))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_keep(vis: torch.Tensor, rho: float, gen: torch.Generator) -> torch.Tensor:
    """Per (head, query block): diagonal + first block + random others, ceil(rho * causal) blocks in all."""
    causal = vis != VISIBLE_NONE
    count = causal.sum(-1)
    want = torch.clamp(torch.ceil(rho * count.double()).long(), min=torch.clamp(count, max=2))
    n = vis.shape[-1]
    scores = torch.rand(vis.shape, generator=gen, device=vis.device)
    tile = torch.arange(n, device=vis.device)
    diag = tile == (count - 1).clamp(min=0)[..., None]
    scores = torch.where(diag, 3.0, torch.where(tile == 0, 2.0, scores))
    scores = torch.where(causal, scores, -1.0)
    order = torch.argsort(scores, dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, tile.expand_as(order))
    return causal & (rank < want[..., None])


def segment_permutation(length: int, gen: torch.Generator, device) -> torch.Tensor:
    """int32 (B, HKV, length): keys shuffled at random inside each segment of SEGMENT keys."""
    nseg = -(-length // SEGMENT)
    r = torch.rand(B, HKV, nseg, SEGMENT, generator=gen, device=device)
    idx = torch.arange(nseg * SEGMENT, device=device).view(nseg, SEGMENT)
    pad = idx >= length
    r = torch.where(pad, 2.0, r)  # padding sorts last in its segment, then is cut
    perm = torch.argsort(r, dim=-1) + torch.arange(nseg, device=device)[:, None] * SEGMENT
    return perm.flatten(2)[..., :length].to(torch.int32).contiguous()


def qkv_sets(n: int, count: int, gen: torch.Generator, device) -> list:
    """``count`` (q, k, v) input sets at length n, for ``Rotating`` to cycle through."""
    return [tuple(torch.randn(B, h, n, D, device=device, dtype=DTYPE, generator=gen) for h in (HQ, HKV, HKV))
            for _ in range(count)]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def visibilities(n: int, gen: torch.Generator, device) -> tuple:
    """(vis, kidx, vis_p, causal_tiles): the causal tile visibility in sequence order, a segment permutation of
    the keys and the visibility under it (per query head), and the count of causal tiles rho is a share of."""
    vis = block_visibility(n, n, BLOCK, BLOCK, batch=B, heads=HQ, device=device)
    kidx = segment_permutation(n, gen, device)
    vis_p = expand_heads(block_visibility(n, n, BLOCK, BLOCK, key_index=kidx), HQ)
    return vis, kidx, vis_p, int((vis != VISIBLE_NONE).sum())


def _causal_mask_mod(b, h, q_idx, kv_idx):
    # one module-level function: a new closure per call would make Dynamo recompile flex for every cell
    return q_idx >= kv_idx


def flex_block_mask(keep: torch.Tensor, vis: torch.Tensor, n: int):
    from torch.nn.attention.flex_attention import BlockMask

    def lists(m):
        cnt = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cnt.contiguous(), idx.contiguous()

    pc, pi = lists(keep & (vis == VISIBLE_PARTIAL))
    fc, fi = lists(keep & (vis == VISIBLE_FULL))
    kwargs = dict(BLOCK_SIZE=BLOCK, mask_mod=_causal_mask_mod, seq_lengths=(n, n))
    try:
        return BlockMask.from_kv_blocks(pc, pi, fc, fi, compute_q_blocks=False, **kwargs)
    except TypeError:  # older torch: no compute_q_blocks
        return BlockMask.from_kv_blocks(pc, pi, fc, fi, **kwargs)


def bench_params(n: int, scale: float):
    """do_bench warmup/rep in ms: ~300 timed calls at 8K, a handful (>= 3) at 128K where one call is ~0.3 s."""
    if n <= 32768:
        return 50 * scale, 300 * scale
    return 100 * scale, 1000 * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm())


def _timer(args):
    if not args.dry_run:
        return time_ms

    def once(fn, **_):  # a smoke test of the script's logic, not a measurement
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


def sweep(args) -> None:
    dev = torch.device(args.device)
    time_ms = _timer(args)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    from torch.nn.attention.flex_attention import flex_attention

    # one compile per N (static shapes); the block masks are inputs, so rho does not recompile
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    flex = flex_attention if args.flex_eager else torch.compile(flex_attention, dynamic=False)
    rows = []
    for n in args.n:
        set_bytes = (HQ + 2 * HKV) * n * D * 2
        nrot = rotation_count(set_bytes, cap=2)
        sets = qkv_sets(n, nrot, gen, dev)
        pairs_dense = causal_pairs(n, n)
        flops_dense = attention_flops(pairs_dense, B, HQ, D)
        ref_out = sdpa(*sets[0])
        vis, kidx, vis_p, causal_tiles = visibilities(n, gen, dev)
        for rho in args.rho:
            keep = make_keep(vis, rho, gen)
            kept = int(keep.sum())
            n_diag = int((keep & (vis == VISIBLE_PARTIAL)).sum())
            pairs = (kept - n_diag) * BLOCK * BLOCK + n_diag * BLOCK * (BLOCK + 1) // 2
            flops = attention_flops(pairs, 1, 1, D)
            rho_real = kept / causal_tiles
            plan = plan_from_block_mask(keep, vis, BLOCK, BLOCK)
            keep_p = keep | ((vis_p == VISIBLE_PARTIAL) & (vis == VISIBLE_NONE))
            plan_p = plan_from_block_mask(keep_p, vis_p, BLOCK, BLOCK, key_index=kidx)
            row = {"N": n, "rho": round(rho_real, 4)}
            cfg = parse_config(args.config) if args.config else None
            tcfg = cfg or triton_config(args.device)
            contenders = {
                "bsa": lambda q, k, v: run_kernel(q, k, v, plan, cfg),
                "bsa_triton": lambda q, k, v: run_kernel(q, k, v, plan, tcfg),
                "bsa_kidx_gather": lambda q, k, v: run_kernel(q, k, v, plan_p, cfg, key_mode="gather"),
                "bsa_kidx_copy": lambda q, k, v: run_kernel(q, k, v, plan_p, cfg, key_mode="copy"),
            }
            if not args.no_flex:
                def flex_fn(q, k, v, _bm=[None]):
                    return flex(q, k, v, block_mask=_bm[0], enable_gqa=True)

                def build_flex():
                    flex_fn.__defaults__[0][0] = flex_block_mask(keep, vis, n)
                    return True

                ok = guarded(build_flex, catch_all=True)
                if ok is True:
                    contenders = {"flex": flex_fn, **contenders}
                else:
                    row["flex_ms"] = ok if ok == OOM else "error"
                    log(f"  flex mask: {ok}")
            flex_out = None
            timed = {"sdpa": Rotating(sdpa, sets)}
            for name, fn in contenders.items():
                if name.startswith("bsa_kidx") and args.no_kidx:
                    continue
                log(f"N={n} rho={rho}: {name}")
                # correctness on the way: dense at rho=1; same blocks -> same function (bsa vs flex) below it
                out = guarded(lambda: fn(*sets[0]), catch_all=True)
                if isinstance(out, torch.Tensor):
                    if rho >= 1.0:
                        row[f"{name}_err_vs_sdpa"] = rel(out, ref_out)
                    elif name == "flex":
                        flex_out = out
                    elif name == "bsa" and flex_out is not None:
                        row["bsa_err_vs_flex"] = rel(out, flex_out)
                    del out
                    timed[name] = Rotating(fn, sets)
                else:
                    row[f"{name}_ms"] = out
            flex_out = None
            # every contender and cuDNN timed in turn in one loop (the clock drifts under sustained load)
            row["sm_clock_mhz"] = sm_clock_mhz()
            reps, warm = (1, 0) if args.dry_run else (timing_reps(n, args.time_scale), 2)
            times = guarded(lambda: alternating_ms(timed, reps, warmup=warm), catch_all=True)
            if isinstance(times, str):
                row["sdpa_ms"] = times
                times = {}
            t_sdpa = times.get("sdpa")
            for name, t in times.items():
                row[f"{name}_ms"] = t
                if name == "sdpa":
                    row["sdpa_tflops"] = tflops(flops_dense, t)
                    continue
                row[f"{name}_tflops"] = tflops(flops, t)
                if t_sdpa:
                    row[f"{name}_eff"] = rho_real * t_sdpa / t
            rows.append(row)
            log("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        del sets, ref_out
        torch.cuda.empty_cache()
    cols = ["N", "rho", "sdpa_ms", "sdpa_tflops"]
    for name in ("flex", "bsa", "bsa_triton", "bsa_kidx_gather", "bsa_kidx_copy"):
        cols += [f"{name}_ms", f"{name}_tflops", f"{name}_eff"]
    cols.append("sm_clock_mhz")
    meta = dict(B=B, Hq=HQ, Hkv=HKV, D=D, dtype=str(DTYPE), block=BLOCK, segment=SEGMENT, seed=args.seed,
                config=args.config or "default_config", time_scale=args.time_scale,
                note="efficiency = rho * t_sdpa / t; TFLOP/s over visible pairs of computed tiles")
    table = write_results(args.name, rows, meta=meta, columns=cols, out_dir=args.out, store="bench_kernel",
                          params=("N",), extra={"mode": "kernel", **{k: v for k, v in meta.items() if k != "note"}})
    errs = sorted({c for r in rows for c in r if "_err_" in c})
    print(table)
    if errs:
        from harness import format_table

        print(format_table(rows, ["N", "rho"] + errs, digits=4))


def tune(args) -> None:
    """Time launch configs of the kernel (contiguous and key_index paths) at each N for each rho."""
    dev = torch.device(args.device)
    time_ms = _timer(args)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    rows = []
    configs = [parse_config(c) for c in args.configs]
    for n in args.n:
        warmup, rep = bench_params(n, args.time_scale)
        sets = qkv_sets(n, 2, gen, dev)
        ref = sdpa(*sets[0])
        t_sdpa = time_ms(Rotating(sdpa, sets), warmup=warmup, rep=rep)
        log(f"N={n} sdpa {t_sdpa:.3f} ms")
        vis, kidx, vis_p, causal_tiles = visibilities(n, gen, dev)
        for rho in args.rho:
            keep = make_keep(vis, rho, gen)
            rho_real = int(keep.sum()) / causal_tiles
            plan = plan_from_block_mask(keep, vis, BLOCK, BLOCK)
            keep_p = keep | ((vis_p == VISIBLE_PARTIAL) & (vis == VISIBLE_NONE))
            plan_p = plan_from_block_mask(keep_p, vis_p, BLOCK, BLOCK, key_index=kidx)
            variants = [("bsa", cfg, None, plan) for cfg in configs]
            for mode in args.kidx_modes:
                for cfg in configs[: args.kidx_configs]:
                    variants.append((f"kidx_{mode}", cfg, mode, plan_p))
            for tma in args.tma_off_for:
                cfg = configs[tma]
                variants.append(("bsa_notma", dataclasses.replace(cfg, use_tma=False), None, plan))
            for name, cfg, mode, pl in variants:
                def fn(q, k, v, _pl=pl, _cfg=cfg, _mode=mode):
                    return run_kernel(q, k, v, _pl, _cfg, key_mode=_mode or "auto")

                t0 = time.time()
                out = guarded(lambda: fn(*sets[0]), catch_all=True)
                compile_s = time.time() - t0
                if not isinstance(out, torch.Tensor):
                    rows.append({"N": n, "rho": rho_real, "variant": name, "config": config_name(cfg), "ms": out})
                    log(f"  {name} {cfg}: {out}")
                    continue
                err = rel(out, ref) if rho >= 1.0 else None
                del out
                t = time_ms(Rotating(fn, sets), warmup=warmup, rep=rep)
                r = {"N": n, "rho": round(rho_real, 4), "variant": name,
                     "config": config_name(cfg),
                     "ms": t, "vs_sdpa": t_sdpa / t, "eff": rho_real * t_sdpa / t, "err_vs_sdpa": err,
                     "compile_s": round(compile_s, 1)}
                rows.append(r)
                log("  " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        del sets, ref
        torch.cuda.empty_cache()
    table = write_results(args.name, rows, meta={"mode": "tune"}, out_dir=args.out, digits=4, store="bench_kernel",
                          params=("N",), extra={"mode": "tune"})
    print(table)


def once(args) -> None:
    """One launch of the kernel per config and rho (contiguous keys), for a profiler: ``ncu -k
    regex:_block_sparse_attn_fwd ... python bench_kernel.py --mode once --n 32768 --configs ...``."""
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    n = args.n[0]
    q, k, v = (torch.randn(B, h, n, D, device=dev, dtype=DTYPE, generator=gen) for h in (HQ, HKV, HKV))
    vis = block_visibility(n, n, BLOCK, BLOCK, batch=B, heads=HQ, device=dev)
    configs = [parse_config(c) for c in args.configs]
    for rho in args.rho:
        plan = plan_from_block_mask(make_keep(vis, rho, gen), vis, BLOCK, BLOCK)
        for cfg in configs:
            run_kernel(q, k, v, plan, cfg)
            log(f"launched N={n} rho={rho} {config_name(cfg)}")
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sweep", "tune", "once"), default="sweep")
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--rho", type=float, nargs="+", default=[1.0, 0.5, 0.3, 0.1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies do_bench warmup/rep")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--flex-eager", action="store_true", help="FlexAttention without torch.compile (smoke tests)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="one untimed call per cell: checks the script, not speed")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--no-kidx", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="results folder (default benchmarks/results)")
    p.add_argument("--configs", nargs="+", default=["128,128,8,3"],
                   help="tune: bm,bn,warps,stages[,masked_stages=S][,use_tma=0|1] ...")
    p.add_argument("--config", default=None, help="sweep: launch config of every bsa contender (default: the "
                                                   "kernel's default_config), same syntax as --configs")
    p.add_argument("--kidx-modes", nargs="*", default=["gather", "copy"])
    p.add_argument("--kidx-configs", type=int, default=1, help="tune: how many configs to try on key_index paths")
    p.add_argument("--tma-off-for", type=int, nargs="*", default=[], help="tune: config indices to rerun without TMA")
    args = p.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    if args.name is None:
        args.name = "bench_kernel_h100" if args.mode == "sweep" else "tune_kernel_h100"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_kernel.py needs a CUDA GPU (or --device cpu --dry-run with TRITON_INTERPRET=1)")
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if args.device == 'cuda' else args.device}")
    {"sweep": sweep, "tune": tune, "once": once}[args.mode](args)


if __name__ == "__main__":
    main()
