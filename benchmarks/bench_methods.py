"""The four methods end to end on one GPU: selection + permutation time, sparse attention time, density, error.

Setup: bf16, B=1, Hq=32, Hkv=8, D=128, causal self-attention prefill, N in 8K..128K, each method's
paper defaults (``SparseConfig(method=...)``). Per (N, method):

* ``sel_fast_ms``: ``build_plan(..., implementation="fast")`` (reorder + select on the GPU), and
  ``sel_ref_ms``: the PyTorch reference (N <= 32K; it is slow and memory-hungry beyond);
* ``attn_ms``: ``sparse_compile.plan.execute_plan`` on that plan (the Triton kernel, the K/V permutation
  included);
* ``density``: tiles computed / causal tiles (kernel visited counts: S2O stops early at run time), and
  ``listed``: tiles in the plan / causal tiles;
* ``rel_l1`` and ``mse`` of the output against dense attention (cuDNN SDPA) on the same inputs;
* ``sel_pct``: selection time as % of dense SDPA, and ``speedup``: SDPA / (selection + attention);
* ``sel_queued_ms`` / ``sel_queued_pct``: the selection timed behind a GPU sleep, alternating with dense SDPA (so the
  host's launches are hidden as inside a model, where the QKV projections are queued ahead): its device time.
Times are medians of ``benchmarks.harness.time_ms`` (do_bench: events, L2 flushed between runs).

Inputs (``structured_inputs``): random Q/K give every block the same mass, so no method has anything to select.
Per KV head we build Q and K from orthonormal directions plus Gaussian noise:

* local windows ("RoPE-like"): F = 8 coordinate pairs rotate with the position at periods 32..8192 (log-spaced),
  the same rotation for q and k, so q_t.k_s holds (L/F) sum_f cos(w_f (t - s)): L logits for nearby tokens;
* attention sinks: the first 4 keys carry a direction u_sink that every query shares (S logits);
* vertical lines: 0.5% of the key positions (scattered at random, per KV head) carry a direction u_vert that the
  queries share (V logits);
* per-query-head strengths L in 4..12, S in 4..12, V in 2..8 (uniform), so heads differ as in real models, and a
  random part of std 0.5 logits (``NOISE``...``VERT`` below);
* attention-neutral offsets: like the large shared components of real queries and keys, each head gets an offset
  (squared norm 0..4x the rows' mean, uniform per head) along a direction the other side has no component on, so
  no q.k changes; they make blocks of tokens more or less self-similar, which SpargeAttn's judge looks at.
V is N(0, 1). The generator is deterministic (``--seed``).

    python benchmarks/bench_methods.py                       # the sweep; rows to benchmarks/results/bench_methods.jsonl
    python benchmarks/bench_methods.py --profile --n 131072   # torch.profiler per-op CUDA time of the fast path
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RUNS_DIR, alternating_ms, guarded, time_ms, write_results  # noqa: E402
from sparse_compile.config import SparseConfig  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.plan import execute_plan  # noqa: E402
from sparse_compile.report import density_from_visits  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
DTYPE = torch.bfloat16
METHODS = ("pbs", "sparge", "bfla", "s2o")
REF_MAX_N = 32768
#: the GPU sleep ahead of each queued sample (~2 ms on the H100): longer than any selection's host time
QUEUE_CYCLES = 4_000_000
# generator defaults (logit units): random part std, and per-head (low, high) strengths
NOISE, LOCAL, SINK, VERT, OFFSET = 0.5, (4.0, 12.0), (4.0, 12.0), (2.0, 8.0), 4.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def structured_inputs(n: int, *, seed: int = 0, device="cuda", batch: int = B, hq: int = HQ, hkv: int = HKV,
                      dim: int = D, dtype=DTYPE, noise: float = NOISE, local=LOCAL, sink=SINK, vert=VERT,
                      offset: float = OFFSET):
    """(q, k, v) with sinks, local windows and vertical lines (module docstring). Built per KV head in float32.

    ``noise``: std of the random part of a logit q.k * scale; ``local``/``sink``/``vert``: (low, high) logit
    strengths, drawn per query head; ``offset``: the largest squared norm of the attention-neutral offset, in
    units of the rows' mean squared norm (drawn uniformly per head).
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    m = hq // hkv
    scale = 1.0 / math.sqrt(dim)
    nf = 8
    periods = torch.logspace(math.log10(32), math.log10(8192), nf, device=device)
    omega = 2 * math.pi / periods
    pos = torch.arange(n, device=device, dtype=torch.float32)
    sigma = math.sqrt(noise / (scale * math.sqrt(dim)))  # per coordinate, q and k alike
    a_sink = math.sqrt(sink[1] / scale)  # key-side amplitudes; query sides set each head's logit
    a_vert = math.sqrt(vert[1] / scale)
    a_loc = math.sqrt(local[1] / (scale * nf))
    q = torch.empty(batch, hq, n, dim, dtype=dtype, device=device)
    k = torch.empty(batch, hkv, n, dim, dtype=dtype, device=device)
    for b in range(batch):
        for h in range(hkv):
            basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, device=device))
            rot = basis[:, : 2 * nf]  # F rotating coordinate pairs
            u_sink, u_vert = basis[:, 2 * nf], basis[:, 2 * nf + 1]
            ang = pos[:, None] * omega[None, :]
            trig = torch.stack([torch.cos(ang), torch.sin(ang)], -1).flatten(1) @ rot.T  # (n, dim)
            u_qoff, u_koff = basis[:, 2 * nf + 2], basis[:, 2 * nf + 3]
            kk = sigma * torch.randn(n, dim, generator=g, device=device) + a_loc * trig
            kk[:4] += a_sink * u_sink
            kk[torch.rand(n, generator=g, device=device) < 0.005] += a_vert * u_vert
            # attention-neutral offsets (the large shared components of real Q/K): keys get mu_k u_koff and no
            # component along u_qoff, queries get mu_q u_qoff and none along u_koff, so every q.k is unchanged
            # while blocks become more or less self-similar (SpargeAttn's judge) from head to head
            kk -= (kk @ u_qoff)[:, None] * u_qoff
            kk += math.sqrt(offset * float(torch.rand((), generator=g, device=device)) * kk.pow(2).sum(1).mean()) * u_koff
            k[b, h] = kk.to(dtype)
            for j in range(m):
                s = torch.rand(3, generator=g, device=device).tolist()
                lo_l, lo_s, lo_v = (r[0] + (r[1] - r[0]) * x for r, x in zip((local, sink, vert), s))
                qq = sigma * torch.randn(n, dim, generator=g, device=device)
                qq += lo_l / (scale * nf * a_loc) * trig  # q_t.k_s = lo_l/nf * sum_f cos(w_f (t - s)) / scale
                qq += lo_s / (scale * a_sink) * u_sink
                qq += lo_v / (scale * a_vert) * u_vert
                qq -= (qq @ u_koff)[:, None] * u_koff
                qq += math.sqrt(offset * float(torch.rand((), generator=g, device=device)) * qq.pow(2).sum(1).mean()) * u_qoff
                q[b, h * m + j] = qq.to(dtype)
    v = torch.randn(batch, hkv, n, dim, generator=g, device=device).to(dtype)
    return q, k, v


def dense(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L1, MSE) in float32, head by head (no full float32 copies)."""
    l1 = ref_l1 = sq = 0.0
    for h in range(out.shape[1]):
        o, r = out[:, h].float(), ref[:, h].float()
        l1 += float((o - r).abs().sum())
        ref_l1 += float(r.abs().sum())
        sq += float(((o - r) ** 2).sum())
    return l1 / max(ref_l1, 1e-30), sq / out.numel()


def method_config(spec: str) -> SparseConfig:
    """``name`` (the method's defaults) or ``name:field=value,...`` (e.g. ``peak:sample_every=8``)."""
    name, _, fields = spec.partition(":")
    params = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        params[key] = json.loads(value.lower() if value in ("True", "False") else value)
    return SparseConfig(method=name, **({name: params} if params else {}))


def bench_params(n: int):
    # warmup/rep in ms: long calls need only a few repetitions for a stable median
    return (25, 100) if n <= 32768 else (50, 200)


def sweep(args) -> list[dict]:
    rows = []
    for n in args.n:
        log(f"N={n}: inputs")
        q, k, v = structured_inputs(n, seed=args.seed)
        scale = 1.0 / math.sqrt(D)
        warm, rep = bench_params(n)
        ref = dense(q, k, v)
        t_sdpa = time_ms(lambda: dense(q, k, v), warmup=warm, rep=max(rep, 300))
        rows.append(dict(N=n, method="sdpa (cuDNN, dense)", attn_ms=t_sdpa, total_ms=t_sdpa, density=1.0,
                         listed=1.0, rel_l1=0.0, mse=0.0, speedup=1.0))
        log(f"N={n}: sdpa {t_sdpa:.2f} ms")
        for method in args.methods:
            cfg = method_config(method)
            row = dict(N=n, method=method)
            plan = build_plan(q, k, scale, cfg, implementation="fast")
            row["sel_fast_ms"] = time_ms(lambda: build_plan(q, k, scale, cfg, implementation="fast"), warmup=warm,
                                         rep=rep)
            # the same with the host ahead of the GPU, as inside a model's forward pass (QKV projections queued
            # before it): device time, alternating with dense SDPA so both see the same clock
            queued = alternating_ms({"select": lambda: build_plan(q, k, scale, cfg, implementation="fast"),
                                     "sdpa": lambda: dense(q, k, v)}, args.queued_reps, queue_ahead=QUEUE_CYCLES)
            row["sel_queued_ms"] = queued["select"]
            row["sel_queued_pct"] = 100 * queued["select"] / queued["sdpa"]
            if n <= REF_MAX_N and not args.no_ref:
                r = guarded(lambda: time_ms(lambda: build_plan(q, k, scale, cfg, implementation="reference"),
                                            warmup=warm, rep=rep))
                row["sel_ref_ms"] = r
            mode = "auto"
            try:
                out, visited = execute_plan(q, k, v, plan, scale, kernel="triton", return_visited=True)
            except RuntimeError as exc:
                # the kernel's permuted-copy launch has a grid limit (S2O's key list at 128K is ~4M entries long):
                # read keys through the index instead, and say so in the table
                log(f"N={n} {method}: key_mode=auto failed ({str(exc).splitlines()[0][:80]}); using gather")
                mode = "gather"
                out, visited = execute_plan(q, k, v, plan, scale, kernel="triton", return_visited=True,
                                            key_mode=mode)
            row["key_mode"] = mode if plan.key_index is not None else "-"
            row["attn_ms"] = time_ms(lambda: execute_plan(q, k, v, plan, scale, kernel="triton", key_mode=mode),
                                     warmup=warm, rep=rep)
            per_head = density_from_visits(visited, plan, n, n, HQ)
            row["density"] = sum(per_head) / len(per_head)
            row["listed"] = float(plan.density(n, n, HQ).mean())
            row["rel_l1"], row["mse"] = errors(out, ref)
            row["sel_pct"] = 100 * row["sel_fast_ms"] / t_sdpa
            row["total_ms"] = row["sel_fast_ms"] + row["attn_ms"]
            row["speedup"] = t_sdpa / row["total_ms"]
            rows.append(row)
            log(f"N={n} {method}: {plan!r}")
            log(f"N={n} {method}: sel {row['sel_fast_ms']:.3f} ms ({row['sel_pct']:.2f}% of sdpa), ref "
                f"{row.get('sel_ref_ms', '-')}, attn {row['attn_ms']:.2f} ms, density {row['density']:.3f}, "
                f"rel_l1 {row['rel_l1']:.4f}")
            del out, visited, plan
        del q, k, v, ref
        torch.cuda.empty_cache()
    return rows


def profile(args) -> dict:
    """Per-op CUDA time of the fast path (torch.profiler), per method: where the selection time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    out = {}
    for n in args.n:
        q, k, v = structured_inputs(n, seed=args.seed)
        scale = 1.0 / math.sqrt(D)
        for method in args.methods:
            cfg = method_config(method)
            for _ in range(3):
                build_plan(q, k, scale, cfg, implementation="fast")
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    build_plan(q, k, scale, cfg, implementation="fast")
                torch.cuda.synchronize()
            ops = []
            for e in prof.key_averages():
                # device-side events only (kernels, memsets, copies): aten ops would count their kernels twice
                if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                    continue
                t = getattr(e, "self_device_time_total", None)
                if t is None:
                    t = getattr(e, "self_cuda_time_total", 0.0)
                if t > 0:
                    ops.append((e.key, t / 5 / 1000.0, e.count / 5))
            ops.sort(key=lambda x: -x[1])
            out[f"{method}@{n}"] = {"total_ms": sum(x[1] for x in ops), "ops": ops}
            log(f"profile {method} N={n}: device total {sum(x[1] for x in ops):.3f} ms: "
                + "; ".join(f"{name[:40]} {ms:.3f} ms x{c:g}" for name, ms, c in ops[:10]))
        del q, k, v
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help="method names, or name:field=value,... for non-default parameters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch references")
    ap.add_argument("--queued-reps", type=int, default=21, help="rounds of the queued selection timing")
    ap.add_argument("--profile", action="store_true", help="profile the fast path instead of the sweep")
    ap.add_argument("--out-dir", default=None, help="where results go (default benchmarks/results)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_methods.py needs a CUDA GPU")
    if args.profile:
        prof = profile(args)
        path = Path(args.out_dir or RUNS_DIR) / "methods_profile.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof, indent=1))
        return
    rows = sweep(args)
    cols = ["N", "method", "sel_fast_ms", "sel_pct", "sel_queued_ms", "sel_queued_pct", "sel_ref_ms", "attn_ms",
            "key_mode", "total_ms", "speedup", "density", "listed", "rel_l1", "mse"]
    meta = dict(batch=B, heads_q=HQ, heads_kv=HKV, head_dim=D, dtype=str(DTYPE), seed=args.seed,
                inputs="structured: sinks + RoPE-like local windows + vertical lines (bench_methods.py docstring)")
    table = write_results("methods", rows, meta=meta, columns=cols, out_dir=args.out_dir, digits=4,
                          store="bench_methods", params=("N",))
    print(table)


if __name__ == "__main__":
    main()
