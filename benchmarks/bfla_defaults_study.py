r"""BFLA's block-softmax scale alpha and mass threshold gamma, against PBS at matched density, on the CPU.

    python benchmarks/bfla_defaults_study.py            # 8K: 4 instances (6 end to end), random 8K; ~12 min, 2 cores
    python benchmarks/bfla_defaults_study.py --lengths 16384 --instances 2 --e2e 0 --random-length 0   # ~13 min
    python benchmarks/bfla_defaults_study.py --lengths 16384 --instances 0 --e2e 6 --random-length 0 \
        --e2e-contenders "bfla α=paper γ=0.99" "bfla (defaults)" "pbs (defaults)" --e2e-pbs 0.7 0.95   # ~8 min
    python benchmarks/bfla_defaults_study.py --smoke    # tiny untrained model, seconds

The study behind BFLA's default ``score_scale`` (``BFLAParams`` docstring; ``results/bfla_defaults_cpu.md``).
Model: ``checkpoints/retrieval_lm.pt`` in float32 (byte level, 4 layers, 4 query heads / 1 KV head, head dim 128).
Instances: ``retrieval_tasks`` on this machine's held-out code (``passkey`` and ``multikey``, ``vkey`` style; this
machine's corpus is not the GPU machine's). Every attention call of a dense forward is captured through
``sparse_compile.ops.capturing`` (the model's SDPA is routed through ``sparse_compile.sparse_attention`` with sparsity
off). Contenders, each built with ``build_plan`` (reference planner) and run with the reference executor:

* ``bfla α=<a> γ=<g>``: alpha = 1/sqrt(C) (``paper``), 1/(sqrt(g) sqrt(C)) (``sqrt-g``), 1/(g sqrt(C)) (``1/g``);
* ``bfla (defaults)``, ``pbs (defaults)``: ``SparseConfig()`` as it stands;
* ``pbs thr=<t>``: PBS's density knob (``threshold``) on a grid; its metrics are interpolated (linearly in density)
  at each BFLA row's density: the ``pbs @ρ`` columns.

Per contender, averaged over layers and instances: the plan density (fraction of causal tiles listed), the
relative L1 error of the attention output against dense float32 (sum|O - O'| / sum|O|, per layer), and two
needle measures over the rows that predict a value's bytes: ``needle listed``, the share of (layer, head, row)
whose plan lists a key tile holding a byte of the needle line (the first ``NEEDLE_BYTES`` bytes, as in
``bench_retrieval``), and ``needle mass``, the share of dense attention mass on the needle line that the plan keeps
(sum over layers, heads and rows: the heads that read the needle dominate it). With ``--e2e N`` the model is then
run end to end with the chosen contenders' plans on N instances (exact retrieval, teacher-forced). A random
Gaussian problem (q, k, v ~ N(0, 1), the model's head layout) at ``--random-length`` is the worst case.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
import retrieval_tasks as rt  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.plan import execute_plan  # noqa: E402
from bench_retrieval import NEEDLE_BYTES, listed_keys  # noqa: E402
ALPHAS = {"paper": lambda g, c: 1 / math.sqrt(c), "sqrt-g": lambda g, c: 1 / math.sqrt(g * c),
          "1/g": lambda g, c: 1 / (g * math.sqrt(c))}
GAMMAS = (0.5, 0.8, 0.9, 0.95, 0.99)
PBS_GRID = (0.3, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 0.995)


def base_config(smoke: bool) -> sparse_compile.SparseConfig:
    if not smoke:
        return sparse_compile.SparseConfig()
    return sparse_compile.SparseConfig(
        pbs={"block_size": 32, "segment_size": 64},
        bfla={"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32})


def contenders(base: sparse_compile.SparseConfig, head_dim: int, alphas, gammas,
               pbs_grid) -> list[tuple[str, sparse_compile.SparseConfig]]:
    g = base.bfla.group_size
    out = [("bfla (defaults)", base.replace(method="bfla")), ("pbs (defaults)", base.replace(method="pbs"))]
    for name in alphas:
        for gamma in gammas:
            out.append((f"bfla α={name} γ={gamma}", base.with_overrides(
                "bfla", {"score_scale": ALPHAS[name](g, head_dim), "mass_threshold": gamma})))
    for t in pbs_grid:
        out.append((f"pbs thr={t}", base.with_overrides("pbs", {"threshold": t})))
    return out


def block_softmax_table(calls: list, base: sparse_compile.SparseConfig, head_dim: int, alphas) -> str:
    """Per layer and alpha, over the second half of the coarse query blocks: the mean top block's softmax mass,
    the share of rows whose top block is their own (diagonal) block, and the blocks gamma = 0.9 / 0.99 keep."""
    from sparse_compile.methods.bfla import bfla_block_scores

    b, g = base.bfla.coarse_block_size, base.bfla.group_size
    lines = ["| layer | α | top block mass | top block = own block | blocks at γ 0.9 / 0.99 | visible blocks |",
             "|---|---|---|---|---|---|"]
    for layer, (q, k, _, _) in enumerate(calls):
        score = bfla_block_scores(q, k, b, g)[0].float()  # (Hq, lq, lk), keys in order, Nq == Nk
        lq = score.shape[1]
        rows = torch.arange(lq // 2, lq)
        visible = torch.arange(lq)[:, None] >= torch.arange(lq)[None, :]
        for name in alphas:
            a = torch.softmax((score * ALPHAS[name](g, head_dim)).masked_fill(~visible, float("-inf")), -1)[:, rows]
            top = a.max(-1)
            cum = a.sort(-1, descending=True).values.cumsum(-1)
            need = [float(((cum < t).sum(-1) + 1).float().mean()) for t in (0.9, 0.99)]
            lines.append(f"| {layer} | {name} | {float(top.values.mean()):.3f} | "
                         f"{float((top.indices == rows).float().mean()):.2f} | {need[0]:.1f} / {need[1]:.1f} | "
                         f"{float(rows.float().mean() + 1):.0f} |")
    return "\n".join(lines)


def kept_keys(plan, row: int, head: int, num_heads: int, num_keys: int) -> torch.Tensor:
    """Bool (num_keys,): the physical keys the plan lists for query ``row`` of query head ``head``."""
    keys = listed_keys(plan, head * plan.tile_offsets.shape[1] // num_heads, row)
    out = torch.zeros(num_keys, dtype=torch.bool)
    out[keys[keys < num_keys]] = True
    return out


def needle_rows(instance) -> list[tuple[list[int], slice]]:
    """Per answer: the rows predicting its bytes and its needle line's key span."""
    return [(list(range(a.start - 1, a.end - 1)), slice(a.needle_start, a.needle_start + NEEDLE_BYTES))
            for a in instance.answers]


def dense_needle_mass(q, k, scale, rows, span) -> torch.Tensor:
    """(Hq, len(rows), N) dense attention probabilities of ``rows`` (causal), float32."""
    Hq, Hkv = q.shape[1], k.shape[1]
    kk = k[0].repeat_interleave(Hq // Hkv, 0).float()
    s = q[0, :, rows].float() @ kk.transpose(-1, -2) * scale
    future = torch.arange(k.shape[2])[None, :] > torch.tensor(rows)[:, None]
    return torch.softmax(s.masked_fill(future, float("-inf")), -1)


def measure(calls: list, instances_rows: list, configs, log) -> dict:
    """name -> {density, rel_l1, listed, mass} over the captured calls (one list per instance)."""
    acc = {name: {"density": [], "rel_l1": [], "listed": [0, 0], "mass": [0.0, 0.0]} for name, _ in configs}
    for calls_i, answers in zip(calls, instances_rows):
        for q, k, v, scale in calls_i:
            Nq, Nk, Hq = q.shape[2], k.shape[2], q.shape[1]
            dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                                   enable_gqa=True)
            probs = [(rows, span, dense_needle_mass(q, k, scale, rows, span)) for rows, span in answers]
            for name, config in configs:
                plan = build_plan(q, k, scale, config, implementation="reference")
                out = execute_plan(q, k, v, plan, scale, kernel="reference").float()
                a = acc[name]
                a["density"].append(float(plan.density(Nq, Nk, Hq).mean()))
                a["rel_l1"].append(float((out - dense).abs().sum() / dense.abs().sum()))
                for rows, span, p in probs:
                    for h in range(Hq):
                        for r_i, row in enumerate(rows):
                            keep = kept_keys(plan, row, h, Hq, Nk)
                            a["listed"][0] += bool(keep[span].any())
                            a["listed"][1] += 1
                            a["mass"][0] += float(p[h, r_i, span][keep[span]].sum())
                            a["mass"][1] += float(p[h, r_i, span].sum())
        log(f"  instance done ({len(calls_i)} calls)")
    return {name: {"density": sum(a["density"]) / len(a["density"]),
                   "rel_l1": sum(a["rel_l1"]) / len(a["rel_l1"]),
                   "listed": a["listed"][0] / a["listed"][1] if a["listed"][1] else None,
                   "mass": a["mass"][0] / a["mass"][1] if a["mass"][1] else None} for name, a in acc.items()}


def interpolate(points: list[tuple[float, float]], x: float):
    """Linear interpolation of (x, y) points at x; None outside their range."""
    points = sorted(p for p in points if p[1] is not None)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def add_matched(results: dict) -> None:
    """``pbs @ρ`` metrics at each non-PBS row's density, from the PBS threshold grid."""
    grid = [r for name, r in results.items() if name.startswith("pbs thr=")]
    for name, r in results.items():
        if name.startswith("pbs"):
            continue
        for key in ("rel_l1", "listed", "mass"):
            r[f"pbs_{key}"] = interpolate([(g["density"], g[key]) for g in grid], r["density"])
        thresholds = [(g["density"], float(n.split("=")[1])) for n, g in results.items() if n.startswith("pbs thr=")]
        r["pbs_threshold"] = interpolate(thresholds, r["density"])


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict, needles: bool) -> str:
    head = ["contender", "density", "rel L1", "pbs rel L1 @ρ"]
    if needles:
        head += ["needle listed", "pbs @ρ", "needle mass", "pbs @ρ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        cells = [name, fmt(r["density"]), fmt(r["rel_l1"]), fmt(r.get("pbs_rel_l1"))]
        if needles:
            cells += [fmt(r["listed"], 2), fmt(r.get("pbs_listed"), 2), fmt(r["mass"], 2), fmt(r.get("pbs_mass"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class _RoutedFunctional:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced (the model module's ``F``)."""

    def __init__(self, router):
        self.scaled_dot_product_attention = router

    def __getattr__(self, name):
        return getattr(F, name)


class Router:
    """Routes the model's SDPA: ``dense`` (through ``sparse_attention``, sparsity off, inside ``capturing``) or a
    plan of ``config`` run by the reference executor."""

    def __init__(self):
        self.config = None
        self.calls: list = []

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal and attn_mask is None
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        if self.config is None:
            return sparse_compile.sparse_attention(q, k, v, scale=scale,
                                                   config=sparse_compile.SparseConfig(enabled=False))
        plan = build_plan(q, k, scale, self.config, implementation="reference")
        return execute_plan(q, k, v, plan, scale, kernel="reference")

    def capture(self, model, tokens):
        calls = []

        def keep(site, q, k, v, scale, chunked):
            calls.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), scale))

        self.config = None
        with torch.no_grad(), sparse_compile.ops.capturing(keep):
            logits = model(tokens)[0]
        return calls, logits


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--instances", type=int, default=4,
                        help="instances per length at the operator level (passkey/multikey alternate)")
    parser.add_argument("--e2e", type=int, default=6, help="instances run end to end per contender (0: none)")
    parser.add_argument("--e2e-contenders", nargs="+",
                        default=["bfla α=paper γ=0.99", "bfla α=1/g γ=0.95", "bfla α=1/g γ=0.99",
                                 "pbs (defaults)"],
                        help="names from the operator table; PBS is added at each one's matched density")
    parser.add_argument("--e2e-pbs", type=float, nargs="*", default=[],
                        help="PBS thresholds also run end to end (e.g. matched densities from an earlier run)")
    parser.add_argument("--alphas", nargs="+", default=list(ALPHAS), choices=list(ALPHAS))
    parser.add_argument("--gammas", type=float, nargs="+", default=list(GAMMAS))
    parser.add_argument("--pbs-grid", type=float, nargs="+", default=list(PBS_GRID))
    parser.add_argument("--random-length", type=int, default=8192, help="random Gaussian problem (0: none)")
    parser.add_argument("--checkpoint",
                        default=str(Path(__file__).resolve().parent / "checkpoints" / "retrieval_lm.pt"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every row")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    if args.smoke:
        mod = tsl.load_model_module()
        torch.manual_seed(0)
        model = mod.Transformer(mod.ModelArgs(**tsl.RETRIEVAL_SMOKE_MODEL, max_seq_len=4096)).eval()
        args.lengths, args.instances, args.random_length = [512], 1, 256
        args.e2e = min(args.e2e, 1)
    else:
        model, _ = tsl.load_checkpoint(args.checkpoint)
    corpus = tsl.build_corpus(1 << 20, log=lambda *a: None)
    head_dim = model.args.head_dim if hasattr(model.args, "head_dim") else model.args.dim // model.args.n_heads
    base = base_config(args.smoke)
    configs = contenders(base, head_dim, args.alphas, args.gammas, args.pbs_grid)
    by_name = dict(configs)
    router = Router()
    model_module = sys.modules[type(model).__module__]
    model_module.F = _RoutedFunctional(router)  # only the model's own SDPA calls (sparse_compile's stay plain)
    report = {"meta": {"checkpoint": None if args.smoke else args.checkpoint, "head_dim": head_dim,
                       "bfla_defaults": str(base.bfla), "pbs_defaults": str(base.pbs)}}
    try:
        for length in args.lengths:
            rng = random.Random(7_777_777 + length)
            count = max(args.instances, args.e2e)
            tasks = [("passkey", "multikey")[i % 2] for i in range(count)]
            instances = rt.make_batch(tasks, corpus.heldout, length, rng, "vkey")
            calls, rows, dense_exact, results = [], [], [], {}
            for inst in instances[:args.instances]:
                c, logits = router.capture(model, inst.tokens[None].long())
                calls.append(c)
                rows.append(needle_rows(inst))
                dense_exact += [r["exact"] for r in rt.score(logits.float(), inst)]
            if calls:
                log(f"N={length}: captured {sum(len(c) for c in calls)} calls; dense exact {dense_exact}")
                print(f"\n### block softmax of BFLA, N={length}, first instance (second half of the query blocks)\n")
                print(block_softmax_table(calls[0], base, head_dim, args.alphas), flush=True)
                results = measure(calls, rows, configs, log)
                add_matched(results)
                depths = [round(a.depth, 2) for inst in instances[:args.instances] for a in inst.answers]
                print(f"\n### retrieval model, N={length}, {args.instances} instances (operator level, all layers; "
                      f"needle depths {depths})\n")
                print(table(results, needles=True), flush=True)
            e2e = {}
            if args.e2e:
                chosen = []
                for name in args.e2e_contenders:
                    chosen.append((name, by_name[name]))
                    t = results.get(name, {}).get("pbs_threshold")
                    if t is not None and not name.startswith("pbs"):
                        chosen.append((f"pbs @ρ={results[name]['density']:.2f} (thr={t:.3f})",
                                       base.with_overrides("pbs", {"threshold": t})))
                chosen += [(f"pbs thr={t}", base.with_overrides("pbs", {"threshold": t})) for t in args.e2e_pbs]
                subset = instances[:args.e2e]
                for name, config in [("dense", None)] + chosen:
                    router.config = config
                    exact = []
                    with torch.no_grad():
                        for inst in subset:
                            logits = model(inst.tokens[None].long())[0]
                            exact += [r["exact"] for r in rt.score(logits.float(), inst)]
                    e2e[name] = sum(exact) / len(exact)
                    log(f"  e2e {name}: {e2e[name]:.2f}")
                router.config = None
                depths = [round(a.depth, 2) for inst in subset for a in inst.answers]
                print(f"\n### end to end, N={length}, {len(subset)} instances ({len(exact)} values, needle depths "
                      f"{depths}): exact retrieval\n")
                print("| contender | exact |\n|---|---|")
                for name, value in e2e.items():
                    print(f"| {name} | {value:.2f} |")
            report[f"retrieval_{length}"] = {"dense_exact": dense_exact, "operator": results, "e2e": e2e}
        if args.random_length:
            n = args.random_length
            gen = torch.Generator().manual_seed(0)
            Hq, Hkv = model.args.n_heads, model.args.n_kv_heads
            q = torch.randn(1, Hq, n, head_dim, generator=gen)
            k, v = (torch.randn(1, Hkv, n, head_dim, generator=gen) for _ in range(2))
            results = measure([[(q, k, v, 1 / math.sqrt(head_dim))]], [[]], configs, log)
            add_matched(results)
            print(f"\n### random Gaussian q, k, v, N={n} ({Hq} query heads / {Hkv} KV head, head dim {head_dim})\n")
            print(table(results, needles=False), flush=True)
            report[f"random_{n}"] = results
    finally:
        model_module.F = F
    log(f"{time.perf_counter() - started:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
