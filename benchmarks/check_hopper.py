"""Check and time the Gluon Hopper block-sparse attention kernel (kernels/hopper.py) on an H100.

    python benchmarks/check_hopper.py --out $OUT/hopper.json          # from the repo root, ~2-3 minutes warm
    python benchmarks/check_hopper.py --all-variants --out ...        # 2 and 3 stages (longer)

(a) correctness of the Hopper kernel (its shipped shape, 3 stages) against
``sparse_compile.plan.reference_attention`` (and against cuDNN/flash SDPA for full causal plans), B=2, Hq/Hkv=32/8,
D 128 and 64, N 1000 and 4096, full causal and random block-sparse plans (diagonal tile masked, first tile, random
earlier tiles), model layout (B, N, H, D) viewed as (B, H, N, D); plus tables with Hkv heads, block_n=64, fp16,
2 stages, the P.V skip, permuted keys (``key_index``, 256-key segments as PBS), and the auto-dispatched
``execute_plan``. One failure does not stop the others.
(b) timing, B=1, Hq/Hkv=32/8, D=128, bf16, N 16K/32K/64K: contiguous keys at rho 1 / ~0.3 / ~0.1, and keys
permuted inside 256-key segments (plans over logical keys) at rho 1 / ~0.3. Contenders, run alternately (every one
once per round, rounds in shuffled orders: ``harness.alternating_rounds``), medians of ``--reps`` CUDA-event
timings: cuDNN SDPA (causal, dense), the Triton kernel (``backend="triton"``), the Hopper kernel, and
``execute_plan`` as users call it (``auto``: the automatic dispatch, including the permuted K/V copy for permuted
keys). Reports ms, ratio to cuDNN, efficiency rho * t_cudnn / t (rho: listed tiles over the identity causal tile count) and TFLOP/s over the plan's visible
(query, key) pairs, and the SM clock / temperature / power (nvidia-smi) right after each row's timing loop.
Writes JSON to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness import alternating_ms  # noqa: E402
from sparse_compile.kernels import block_sparse_attention  # noqa: E402
from sparse_compile.kernels.validate import expand_heads  # noqa: E402
from sparse_compile.plan import (  # noqa: E402
    VISIBLE_NONE,
    block_visibility,
    causal_plan,
    causal_tile_count,
    execute_plan,
    plan_from_block_mask,
    reference_attention,
)

HQ, HKV = 32, 8
BLOCK = 128
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 1500 else text[:700] + " ... " + text[-700:]


try:
    from sparse_compile.kernels import hopper as H

    HOPPER_IMPORT = None
except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
    H = None
    HOPPER_IMPORT = short_error(exc) + "\n" + traceback.format_exc()[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# inputs and plans
# ---------------------------------------------------------------------------------------------------------------


def model_layout(B, H, N, D, dtype, gen):
    """(B, N, H, D) memory viewed as (B, H, N, D), as the model passes it."""
    return torch.randn(B, N, H, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)


def random_keep(vis: torch.Tensor, rho: float, gen: torch.Generator) -> torch.Tensor:
    """Per (head, query block) keep ceil(rho * causal tiles), at least 2: diagonal, first tile, random others."""
    causal = vis != VISIBLE_NONE
    count = causal.sum(-1)
    want = torch.clamp(torch.ceil(rho * count.double()).long(), min=torch.clamp(count, max=2))
    n = vis.shape[-1]
    tile = torch.arange(n, device=vis.device)
    noise = torch.rand(vis.shape, generator=gen, device=vis.device)
    last = (count - 1).clamp(min=0)[..., None]
    priority = torch.where(tile == last, 3.0, torch.where(tile == 0, 2.0, noise))
    priority = torch.where(causal, priority, -1.0)
    order = torch.argsort(priority, dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, tile.expand_as(order).contiguous())
    return causal & (rank < want[..., None])


def segment_permutation(B: int, heads: int, n: int, gen, seg: int = 256) -> torch.Tensor:
    """Random order inside consecutive ``seg``-key segments (as PBS-Attn permutes keys), int32 (B, heads, n)."""
    nseg = -(-n // seg)
    r = torch.rand(B, heads, nseg, seg, device="cuda", generator=gen)
    r[..., -1, n - (nseg - 1) * seg:] = 2.0  # positions past n sort last in the last segment, then are cut
    idx = torch.argsort(r, -1) + torch.arange(nseg, device="cuda")[:, None] * seg
    return idx.flatten(2)[..., :n].to(torch.int32).contiguous()


def make_plan(kind: str, B: int, heads: int, N: int, block_n: int, rho: float, gen, key_index=None,
              pv_skip=None):
    """Full causal ("causal") or random block-sparse ("sparse") plan of ``heads`` heads; with ``key_index`` the
    plan is over logical (permuted) keys (tiles with any visible key, rho of them kept)."""
    if kind == "causal" and key_index is None:
        plan = causal_plan(B, heads, N, N, BLOCK, block_n, device="cuda")
    else:
        vis = block_visibility(N, N, BLOCK, block_n, batch=B, heads=heads, device="cuda", key_index=key_index)
        vis = expand_heads(vis, heads)
        keep = (vis != VISIBLE_NONE) if kind == "causal" else random_keep(vis, rho, gen)
        plan = plan_from_block_mask(keep, vis, BLOCK, block_n, key_index=key_index)
    return plan.with_options(pv_skip=pv_skip) if pv_skip is not None else plan


def plan_pairs(plan, N: int) -> tuple[int, float]:
    """(approximate visible (query, key) pairs over all heads, listed tiles over the identity causal tile count
    (``plan_density``: a permuted plan's diagonal segments are full squares, so its rho=1 exceeds 1))."""
    listed = int(plan.tile_counts.sum())
    causal = causal_tile_count(N, N, plan.block_m, plan.block_n) * plan.tile_counts.shape[0] * \
        plan.tile_counts.shape[1]
    n_masked = int(plan.masked_counts.sum())
    bm, bn = plan.block_m, plan.block_n
    pairs = (listed - n_masked) * bm * bn + n_masked * bm * (bn + 1) // 2  # masked tiles ~ half visible
    return pairs, listed / max(causal, 1)


def sm_clocks() -> dict:
    """SM clock (MHz, current and max), temperature (C) and power (W) of the GPU now, from nvidia-smi."""
    fields = "clocks.sm,clocks.max.sm,temperature.gpu,power.draw"
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                              "-i", str(torch.cuda.current_device())], capture_output=True, text=True, timeout=10)
        vals = [v.strip() for v in res.stdout.strip().splitlines()[0].split(",")]
        return dict(zip(("sm_mhz", "sm_max_mhz", "temp_c", "power_w"), vals))
    except Exception as exc:  # noqa: BLE001
        return dict(clock_error=short_error(exc))


def poison_allocator(q) -> None:
    """Leave a NaN-filled block of the output's size on top of the caching allocator's free list, so that an output
    the kernel fails to write reads NaN instead of whatever the previous kernel left there."""
    junk = torch.full((q.shape[0], q.shape[2], q.shape[1], q.shape[3]), float("nan"), dtype=q.dtype, device=q.device)
    del junk


def run_hopper(q, k, v, plan, variant, stages=3):
    """The Hopper kernel (its one shipped shape; ``variant`` only labels the rows)."""
    return H.hopper_block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts,
                                           block_n=plan.block_n, num_stages=stages,
                                           key_index=plan.key_index, pv_skip=plan.pv_skip)


def run_triton(q, k, v, plan):
    """The Triton kernel, whatever the automatic dispatch would pick."""
    return block_sparse_attention(q, k, v, plan.tile_offsets, plan.tile_counts, plan.masked_counts,
                                  block_m=plan.block_m, block_n=plan.block_n, key_index=plan.key_index,
                                  query_index=plan.query_index, early_stop=plan.early_stop, pv_skip=plan.pv_skip,
                                  backend="triton")


def run_auto(q, k, v, plan):
    """``execute_plan`` as users call it (the automatic backend choice)."""
    return execute_plan(q, k, v, plan)


def auto_backend() -> str:
    from sparse_compile.kernels import attention

    return attention.last_backend


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


# ---------------------------------------------------------------------------------------------------------------
# (a) correctness
# ---------------------------------------------------------------------------------------------------------------


def case_error(out, ref, pv_skip) -> float:
    """Max |out - ref|; with the P.V skip, over all rows but the worst 0.01%: a row whose tile maximum sits within
    float32 rounding of the threshold may decide the skip differently from the reference (a legitimate flip that
    moves that row by the tile's share), which is expected a few times among millions of decisions."""
    row_err = (out.float() - ref).abs().amax(-1).flatten()
    if not bool(torch.isfinite(row_err).all()):  # an unwritten (NaN-poisoned) or non-finite output never passes
        return float("inf")
    if pv_skip is None:
        return row_err.max().item()
    keep = max(1, math.ceil(row_err.numel() * 0.9999))
    return row_err.kthvalue(keep).values.item()


def check(args, results) -> None:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    variants = args.variants
    cases = []
    base = dict(rho=0.3, plan_heads="hq", block_n=128, stages=3, dtype="bfloat16", keys="contiguous", pv_skip=None)
    for N in (1000, 4096):
        for D in (128, 64):
            for kind in ("causal", "sparse"):
                cases.append(dict(base, N=N, D=D, kind=kind))
    cases += [
        dict(base, N=1000, D=128, kind="sparse", rho=0.5, plan_heads="hkv"),
        dict(base, N=1000, D=128, kind="sparse", rho=0.5, block_n=64),
        dict(base, N=4096, D=128, kind="causal", rho=1.0, stages=2),
        dict(base, N=4096, D=64, kind="causal", rho=1.0, stages=4),  # 4 stages where shared memory allows
        dict(base, N=2000, D=64, kind="sparse", stages=4, keys="segments", pv_skip=-1.0),
        dict(base, N=2000, D=128, kind="sparse", block_n=64, stages=4),
        dict(base, N=1000, D=128, kind="causal", rho=1.0, dtype="float16"),
        dict(base, N=77, D=64, kind="causal", rho=1.0, plan_heads="hkv"),
        # plan features of the methods: P.V skip (Sparge), permuted keys (PBS), both
        dict(base, N=4096, D=128, kind="sparse", pv_skip=-1.0),
        dict(base, N=4096, D=128, kind="sparse", keys="segments"),
        dict(base, N=4096 + 50, D=128, kind="causal", rho=1.0, keys="segments", plan_heads="hkv"),
        dict(base, N=2000, D=64, kind="sparse", block_n=64, keys="segments", pv_skip=-1.0, plan_heads="hkv"),
    ]
    B = 2
    for case in cases:
        N, D = case["N"], case["D"]
        dtype = getattr(torch, case["dtype"])
        tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
        try:
            q = model_layout(B, HQ, N, D, dtype, gen)
            k = model_layout(B, HKV, N, D, dtype, gen)
            v = model_layout(B, HKV, N, D, dtype, gen)
            heads = HQ if case["plan_heads"] == "hq" else HKV
            ki = segment_permutation(B, HKV, N, gen) if case["keys"] == "segments" else None
            plan = make_plan(case["kind"], B, heads, N, case["block_n"], case["rho"], gen, key_index=ki,
                             pv_skip=case["pv_skip"])
            ref = reference_attention(q, k, v, plan).float()
            base = dict(case)
            try:  # the automatic dispatch, as execute_plan's callers get it
                poison_allocator(q)
                auto = run_auto(q, k, v, plan)
                base["auto_backend"] = auto_backend()
                base["auto_err"] = case_error(auto, ref, case["pv_skip"])
                del auto
            except Exception as exc:  # noqa: BLE001
                base["auto_err"] = short_error(exc)
            try:
                base["triton_err"] = case_error(run_triton(q, k, v, plan), ref, case["pv_skip"])
            except Exception as exc:  # noqa: BLE001
                base["triton_err"] = short_error(exc)
            if case["kind"] == "causal" and ki is None:
                base["ref_vs_sdpa"] = (sdpa_causal(q, k, v).float() - ref).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            log(f"case {case}: setup failed: {short_error(exc)}")
            results.append(dict(case, status="SETUP-FAIL", error=short_error(exc)))
            continue
        for variant in variants:
            row = dict(base, variant=variant)
            try:
                poison_allocator(q)
                out = run_hopper(q, k, v, plan, variant, case["stages"])
                torch.cuda.synchronize()
                err = case_error(out, ref, case["pv_skip"])
                row["err"] = err
                row["err_all_rows"] = (out.float() - ref).abs().max().item()
                row["layout_ok"] = tuple(out.shape) == (B, HQ, N, D) and out.transpose(1, 2).is_contiguous()
                if case["kind"] == "causal" and ki is None:
                    row["err_vs_sdpa"] = (out.float() - sdpa_causal(q, k, v).float()).abs().max().item()
                auto_ok = isinstance(row.get("auto_err"), float) and row["auto_err"] <= tol
                row["status"] = "PASS" if (err <= tol and math.isfinite(err) and row["layout_ok"] and auto_ok) \
                    else "FAIL"
            except Exception as exc:  # noqa: BLE001
                row["status"] = "ERROR"
                row["error"] = short_error(exc)
                if not args.quiet_errors:
                    traceback.print_exc()
            results.append(row)
            desc = (f"N={N:5d} D={D:3d} {case['kind']:6s} plan={case['plan_heads']:3s} bn={case['block_n']:3d} "
                    f"st={case['stages']} {case['dtype']:8s} keys={case['keys']:10s} pv_skip={case['pv_skip']} "
                    f"{variant:7s}")
            if "err" in row:
                tri, aut = row["triton_err"], row["auto_err"]
                tri = f"{tri:.2e}" if isinstance(tri, float) else "error"
                aut = f"{aut:.2e}" if isinstance(aut, float) else "error"
                log(f"{row['status']:5s} {desc} max|err|={row['err']:.2e} (triton {tri}, auto {aut} via "
                    f"{row.get('auto_backend')})")
            else:
                log(f"{row['status']:5s} {desc} {row.get('error', '')[:300]}")
        del q, k, v
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# (b) timing
# ---------------------------------------------------------------------------------------------------------------


def bench(args, results) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda")
    gen.manual_seed(99)
    D, B, dtype = args.head_dim, 1, torch.bfloat16
    for N in args.lengths:
        try:
            q = model_layout(B, HQ, N, D, dtype, gen)
            k = model_layout(B, HKV, N, D, dtype, gen)
            v = model_layout(B, HKV, N, D, dtype, gen)
        except Exception as exc:  # noqa: BLE001
            results.append(dict(N=N, error=short_error(exc)))
            continue

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa_causal(q, k, v)

        dense_pairs = HQ * B * N * (N + 1) // 2
        rows = [("contiguous", rho) for rho in args.rhos] + [("segments", rho) for rho in args.perm_rhos]
        for keys, rho in rows:
            row = dict(N=N, keys=keys, rho_target=rho, B=B, Hq=HQ, Hkv=HKV, D=D)
            try:
                ki = segment_permutation(B, HKV, N, gen) if keys == "segments" else None
                plan = make_plan("causal" if rho >= 1 else "sparse", B, HQ, N, BLOCK, rho, gen, key_index=ki)
                pairs, density = plan_pairs(plan, N)
            except Exception as exc:  # noqa: BLE001
                row["error"] = short_error(exc)
                results.append(row)
                continue
            row["rho"] = round(density, 4)
            contenders = {"cudnn": cudnn, "triton": lambda plan=plan: run_triton(q, k, v, plan),
                          "auto": lambda plan=plan: run_auto(q, k, v, plan)}
            for variant in args.variants:
                for st in args.stages:
                    contenders[f"{variant}/s{st}"] = (lambda plan=plan, variant=variant, st=st:
                                                      run_hopper(q, k, v, plan, variant, st))
            ok = {}
            for name, fn in contenders.items():  # warm-up (compiles) and one correctness check vs the Triton kernel
                try:
                    poison_allocator(q)
                    out = fn()
                    torch.cuda.synchronize()
                    ok[name] = fn
                    if name == "auto":
                        row["auto_backend"] = auto_backend()
                    if name not in ("cudnn", "triton"):
                        ref = run_triton(q, k, v, plan)
                        row[f"{name}_diff_vs_triton"] = (out.float() - ref.float()).abs().max().item()
                        del ref
                    del out
                except Exception as exc:  # noqa: BLE001
                    row[f"{name}_error"] = short_error(exc)
                    log(f"N={N} {keys} rho={rho}: {name} failed: {short_error(exc)[:300]}")
            try:
                # contenders already ran once above (correctness): no warm-up rounds
                times = alternating_ms(ok, args.reps, warmup=0, calls=args.calls, queue_ahead=args.queue_ahead)
                row["clocks"] = sm_clocks()  # right after the loop: the clock the timings ran at
            except Exception as exc:  # noqa: BLE001
                row["timing_error"] = short_error(exc)
                results.append(row)
                continue
            t_cudnn = times.get("cudnn")
            for name, t in times.items():
                row[f"{name}_ms"] = t
                flops = 4 * D * (dense_pairs if name == "cudnn" else pairs)
                row[f"{name}_tflops"] = flops / (t * 1e-3) / 1e12
                if t_cudnn is not None and name != "cudnn":
                    row[f"{name}_ratio"] = t / t_cudnn
                    row[f"{name}_eff"] = density * t_cudnn / t
            results.append(row)
            log(f"N={N} {keys} rho={density:.3f} (auto: {row.get('auto_backend')}, SM "
                f"{row['clocks'].get('sm_mhz')} MHz): " + ", ".join(f"{n}={t:.3f}ms" for n, t in times.items()))
            del plan
        del q, k, v
        torch.cuda.empty_cache()


def print_table(rows) -> None:
    names = []
    for r in rows:
        for key in r:
            if key.endswith("_ms") and key[:-3] not in names:
                names.append(key[:-3])
    print("\nN       keys       rho    SM MHz " + "".join(f"{n:>26s}" for n in names))
    print(" " * 33 + "".join(f"{'ms  ratio  eff  TF/s':>26s}" for _ in names))
    for r in rows:
        if "rho" not in r:
            continue
        cells = []
        for n in names:
            t = r.get(f"{n}_ms")
            if t is None:
                cells.append(f"{'error' if f'{n}_error' in r else '-':>26s}")
                continue
            ratio = r.get(f"{n}_ratio", 1.0)
            eff = r.get(f"{n}_eff", r["rho"] if n == "cudnn" else float("nan"))
            cells.append(f"{t:9.3f} {ratio:5.2f} {eff:5.2f} {r[f'{n}_tflops']:5.0f}")
        clock = r.get("clocks", {}).get("sm_mhz", "?")
        print(f"{r['N']:<7d} {r.get('keys', 'contiguous'):10s} {r['rho']:.3f} {clock:>6s} "
              + "".join(f"{c:>26s}" for c in cells))


def smoke(variant: str) -> None:
    """One small call of ``variant`` (run in a child process: a hang or a crash there cannot stop the script)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    q = model_layout(1, 4, 300, 128, torch.bfloat16, gen)
    k = model_layout(1, 2, 300, 128, torch.bfloat16, gen)
    v = model_layout(1, 2, 300, 128, torch.bfloat16, gen)
    plan = make_plan("causal", 1, 4, 300, BLOCK, 1.0, gen)
    poison_allocator(q)
    out = run_hopper(q, k, v, plan, variant)
    torch.cuda.synchronize()
    err = (out.float() - reference_attention(q, k, v, plan).float()).abs().max().item()
    print(f"SMOKE {variant} err={err:.3e}")


def screen_variants(variants, timeout: float) -> tuple[list, dict]:
    """Variants whose smoke test finishes in a child process within ``timeout`` s (a deadlocked kernel would
    otherwise hang the whole script); the others with the reason."""
    good, bad = [], {}
    for variant in variants:
        try:
            res = subprocess.run([sys.executable, __file__, "--smoke", variant], capture_output=True, text=True,
                                 timeout=timeout, cwd=str(ROOT))
            if res.returncode == 0 and f"SMOKE {variant}" in res.stdout:
                good.append(variant)
                log(f"smoke {variant}: ok ({res.stdout.strip().splitlines()[-1]})")
            else:
                bad[variant] = f"rc={res.returncode}: {(res.stdout + res.stderr)[-1500:]}"
                log(f"smoke {variant}: FAILED rc={res.returncode} {(res.stdout + res.stderr)[-400:]}")
        except subprocess.TimeoutExpired:
            bad[variant] = f"smoke test did not finish in {timeout:.0f} s (hang?)"
            log(f"smoke {variant}: TIMEOUT after {timeout:.0f} s (hang?) - dropped")
    return good, bad


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the report's JSON (default benchmarks/results/runs/hopper.json); the "
                    "timing rows are appended to benchmarks/results/check_hopper.jsonl, or next to --out if given")
    ap.add_argument("--variants", nargs="+", default=["shipped"], help="row labels (the kernel has one shape)")
    ap.add_argument("--stages", nargs="+", type=int, default=[3])
    ap.add_argument("--all-variants", action="store_true", help="2 and 3 stages")
    ap.add_argument("--lengths", nargs="+", type=int, default=[16384, 32768, 65536])
    ap.add_argument("--rhos", nargs="+", type=float, default=[1.0, 0.3, 0.1])
    ap.add_argument("--perm-rhos", nargs="+", type=float, default=[1.0, 0.3],
                    help="densities of the permuted-key (256-key segments) timing rows")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=1, help="timing: back-to-back calls per sample")
    ap.add_argument("--queue-ahead", action="store_true",
                    help="timing: each sample starts behind a GPU sleep, so host time (validation, descriptors, "
                         "the permuted copy's launches) hides as inside a model's forward; GPU time only")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128, help="timing: head dim (64 or 128)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--quiet-errors", action="store_true", default=True)
    ap.add_argument("--smoke", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke-timeout", type=float, default=90.0)
    ap.add_argument("--no-screen", action="store_true", help="skip the per-variant smoke test in a child process")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args.smoke)
        return

    import triton

    env = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               hopper_import_error=HOPPER_IMPORT,
               gluon_error=getattr(H, "GLUON_IMPORT_ERROR", None) if H is not None else None)
    log(f"env: {env}")
    report = dict(env=env, check=[], bench=[])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness

    out_path = Path(args.out) if args.out else harness.RUNS_DIR / "hopper.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(report, indent=1, default=str))

    def stage(name, fn):
        """Run check or bench into report[name]; an abort is recorded and the script goes on."""
        try:
            fn(args, report[name])
        except Exception as exc:  # noqa: BLE001
            report[f"{name}_error"] = short_error(exc) + traceback.format_exc()[-2000:]
            log(f"{name} aborted: {report[f'{name}_error']}")
        save()

    if H is None:
        log("kernels.hopper failed to import; timing only the baselines")
        args.variants = []
    elif args.all_variants:
        args.stages = [2, 3]
    if args.variants and not args.no_screen:
        args.variants, report["dropped_variants"] = screen_variants(args.variants, args.smoke_timeout)
        save()
    if not args.skip_check and H is not None:
        stage("check", check)
        rows = report["check"]
        n_pass = sum(r.get("status") == "PASS" for r in rows)
        log(f"check: {n_pass}/{len(rows)} PASS")
        for v in args.variants:
            vr = [r for r in rows if r.get("variant") == v]
            log(f"  {v:7s}: {sum(r.get('status') == 'PASS' for r in vr)}/{len(vr)} PASS, max err "
                f"{max((r['err'] for r in vr if 'err' in r), default=float('nan')):.2e}")
    if not args.skip_bench:
        stage("bench", bench)
        print_table(report["bench"])
        harness.append_store("check_hopper", report["bench"], params=("N", "rho_target", "B", "Hq", "Hkv", "D"),
                             extra={"calls": args.calls, "queue_ahead": args.queue_ahead, "reps": args.reps},
                             out_dir=out_path.parent if args.out else None)
    save()
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
