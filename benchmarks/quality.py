"""Quality of the four sparse methods on real attention patterns: the small LM of ``train_small_lm.py``.

    PYTHONPATH=. python benchmarks/quality.py                        # GPU: checkpoint in benchmarks/checkpoints
    python benchmarks/quality.py --smoke --checkpoint /tmp/lm/small_lm.pt --out-dir /tmp/q   # CPU, seconds

(a) Language modelling: bits per byte of held-out long documents (8K, 16K, 32K-byte prompts, never trained on)
    with dense attention and with each method at its defaults and along a sweep of the parameter that controls
    its density (pbs ``threshold``, sparge ``cdf_threshold``, bfla ``mass_threshold``, s2o ``early_stop``). It runs
    what a user runs: ``torch.compile(model, backend="sparse_prefill", options=...)`` once, then
    ``sparse_compile.sparsity(method=..., **params)`` per setting (no recompile); the achieved density is the
    backend's own record (``record_density``, ``runtime_stats()``): the fraction of causal tiles each site computed.
(b) Operator level (the comparison of the S2O paper's Fig. 5a): Q/K/V of every layer are captured on long held-out
    inputs (a wrapper around SDPA), each method's threshold is swept through ``sparse_compile.sparse_attention``
    and its output compared with float32 dense attention: relative L1 (sum|O - O'| / sum|O|) and MSE against
    density; the error at matched densities 0.1 / 0.2 / 0.3 is interpolated along each curve (log error, linear in
    density; "-" where a method's curve does not reach that density).

Writes ``quality.json`` (everything, per layer too), ``quality.md`` (the tables) and ``quality.png`` (if matplotlib
is installed) under ``--out-dir`` (default ``benchmarks/results``). A global ``--time-budget`` bounds the run: a
setting that would start after its section's deadline is skipped and listed as such.

The held-out documents are the long held-out files listed in the checkpoint's manifest, re-read from the local disk
and checked against their recorded sha1: run this on the machine image the model was trained on.

This file is the command line and the report (tables, plot); ``quality_data.py`` reads the documents and captures
attention inputs, ``quality_eval.py`` defines the curves and runs (a) and (b).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from quality_data import ckpt_manifest, load_documents  # noqa: E402
from quality_eval import (  # noqa: E402
    BFLA_BLOCK_SCALE,
    METHODS,
    OP_CURVES,
    OP_SWEEP,
    PARAM,
    PPL_CURVES,
    PPL_SWEEP,
    SMOKE_OPTIONS,
    SMOKE_SWEEP,
    Deadline,
    run_operator,
    run_ppl,
)

__all__ = ["main", "tables", "plot", "at_density", "METHODS", "BFLA_BLOCK_SCALE", "OP_CURVES", "PPL_CURVES",
           "MATCHED_DENSITIES"]

MATCHED_DENSITIES = (0.1, 0.2, 0.3)


def at_density(points: list, target: float, key: str) -> Optional[float]:
    """``key`` interpolated at ``target`` density along the curve (log-linear; linear if a value is 0)."""
    pts = sorted((p["density"], p[key]) for p in points
                 if p.get("density") is not None and p.get(key) is not None and math.isfinite(p[key]))
    for (d0, e0), (d1, e1) in zip(pts, pts[1:]):
        if d0 <= target <= d1:
            if d1 == d0:
                return min(e0, e1)
            w = (target - d0) / (d1 - d0)
            if e0 > 0 and e1 > 0:
                return math.exp((1 - w) * math.log(e0) + w * math.log(e1))
            return (1 - w) * e0 + w * e1
    if pts and len(pts) == 1 and math.isclose(pts[0][0], target):
        return pts[0][1]
    return None


# --- reporting ----------------------------------------------------------------------------------------------------
def tables(result: dict) -> str:
    parts = []
    ppl = result.get("ppl")
    if ppl:
        rows = [{"L": r["length"], "method": r["method"], "param": f"{r['param']}={r['value']:g}" if r["value"] is not None
                 else "-", "default": "*" if r["default"] else "", "density": r["density"], "bpb": r["bpb"],
                 "Δbpb": r["delta_bpb"], "Δbpb 2nd half": r["delta_2nd_half"],
                 "sparse sites": f"{r['sparse_sites']}/{r['sites']}"} for r in ppl["rows"]]
        parts.append(f"### (a) bits per byte on held-out documents ({ppl['mode']} backend; * = method default)\n\n"
                     + harness.format_table(rows, digits=4))
        matched = []
        lengths = sorted({r["length"] for r in ppl["rows"]})
        for length in lengths:
            for m in dict.fromkeys(r["method"] for r in ppl["rows"] if r["method"] != "dense"):
                pts = [r for r in ppl["rows"] if r["length"] == length and r["method"] == m]
                row = {"L": length, "method": m}
                for t in MATCHED_DENSITIES:
                    row[f"Δbpb @ {t}"] = at_density(pts, t, "delta_bpb_pos")
                matched.append(row)
        parts.append("### (a') Δbpb interpolated at matched density\n\n" + harness.format_table(matched, digits=4))
    op = result.get("operator")
    if op:
        for length, res in sorted(op.items(), key=lambda kv: int(kv[0])):
            rows = []
            for label, method, _ in OP_CURVES:
                if label not in res["curves"]:
                    continue
                pts = res["curves"][label]
                row = {"curve": label, "swept": PARAM[method]}
                for t in MATCHED_DENSITIES:
                    row[f"rel L1 @ {t}"] = at_density(pts, t, "rel_l1")
                for t in MATCHED_DENSITIES:
                    row[f"MSE @ {t}"] = at_density(pts, t, "mse")
                dens = [p["density"] for p in pts if p["density"] is not None]
                row["density range"] = f"{min(dens):.3f}-{max(dens):.3f}" if dens else "-"
                d = next((p for p in pts if p["default"]), None)
                row["default: density / rel L1"] = (f"{d['density']:.3f} / {d['rel_l1']:.4f}"
                                                    if d and d["density"] is not None else "-")
                rows.append(row)
            parts.append(f"### (b) operator error at matched density, L={length}, {res['layers']} layers "
                         f"(dense bf16 floor: rel L1 {res['floor']['rel_l1']:.2e}, MSE {res['floor']['mse']:.2e})\n\n"
                         + harness.format_table(rows, digits=4))
    return "\n\n".join(parts)


def plot(result: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    colors = {"pbs": "tab:red", "sparge": "tab:blue", "bfla": "tab:green", "s2o": "tab:purple",
              "pbs w/o perm": "salmon", "sparge θ=0": "lightskyblue", BFLA_BLOCK_SCALE: "darkseagreen"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    op = result.get("operator") or {}
    styles = ["-", "--", ":", "-."]
    for li, (length, res) in enumerate(sorted(op.items(), key=lambda kv: -int(kv[0]))):
        for m in res["curves"]:
            pts = sorted((p for p in res["curves"].get(m, []) if p["density"] is not None), key=lambda p: p["density"])
            if not pts:
                continue
            for ax, key in ((axes[0], "rel_l1"), (axes[1], "mse")):
                ax.plot([p["density"] for p in pts], [max(p[key], 1e-12) for p in pts], styles[li % 4], marker="o",
                        ms=3, color=colors.get(m, "grey"), label=f"{m} L={length}")
                dflt = [p for p in pts if p["default"]]
                if dflt:
                    ax.plot([dflt[0]["density"]], [max(dflt[0][key], 1e-12)], "*", ms=11, color=colors.get(m, "grey"))
    for ax, name in ((axes[0], "relative L1  Σ|O−O'|/Σ|O|"), (axes[1], "MSE")):
        ax.set_yscale("log")
        ax.set_xlabel("density (fraction of causal tiles computed)")
        ax.set_ylabel(name)
        ax.set_title(f"operator error vs density, all layers (★ = default)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    ppl = result.get("ppl")
    if ppl:
        lengths = sorted({r["length"] for r in ppl["rows"]})
        for li, length in enumerate(lengths):
            for m in dict.fromkeys(r["method"] for r in ppl["rows"] if r["method"] != "dense"):
                pts = sorted((r for r in ppl["rows"] if r["length"] == length and r["method"] == m
                              and r["density"] is not None), key=lambda r: r["density"])
                if pts:
                    axes[2].plot([r["density"] for r in pts], [r["delta_bpb"] for r in pts],
                                 styles[li % 4], marker="o", ms=3, color=colors.get(m, "grey"), label=f"{m} L={length}")
        axes[2].set_yscale("symlog", linthresh=1e-3)  # deltas can be slightly negative; small ones stay visible
        axes[2].set_xlabel("density (backend record)")
        axes[2].set_ylabel("Δ bits per byte vs dense")
        axes[2].set_title(f"held-out bits per byte ({ppl['mode']} path)", fontsize=9)
        axes[2].grid(alpha=0.3, which="both")
        if axes[2].get_legend_handles_labels()[0]:
            axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=tsl.DEFAULT_CHECKPOINT)
    parser.add_argument("--out-dir", type=Path, default=harness.RUNS_DIR,
                        help="this run's JSON, table and plot (default benchmarks/results/runs); the rows are "
                             "appended to benchmarks/results/quality.jsonl, or to quality.jsonl here if given")
    parser.add_argument("--name", default="quality")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: short prompts, small blocks, two values")
    parser.add_argument("--device", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths for (a)")
    parser.add_argument("--docs", type=int, nargs="+", default=None, help="documents per length for (a)")
    parser.add_argument("--op-lengths", type=int, nargs="+", default=None, help="input lengths for (b)")
    parser.add_argument("--sections", default="ppl,operator")
    parser.add_argument("--curves", default=None,
                        help="comma-separated curve labels to run (default all: " +
                             ", ".join(dict.fromkeys(c[0] for c in OP_CURVES + PPL_CURVES)) + ")")
    parser.add_argument("--attention", choices=("compiled", "hook"), default="compiled",
                        help="(a) through torch.compile(backend='sparse_prefill') or an SDPA hook (eager)")
    parser.add_argument("--kernel", choices=("auto", "triton", "reference"), default="auto")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds for (a) and (b) together")
    parser.add_argument("--ppl-share", type=float, default=0.5, help="share of the budget (a) may use")
    parser.add_argument("--no-verify", action="store_true", help="skip missing/changed held-out files")
    parser.add_argument("--local-heldout", action="store_true",
                        help="use the local held-out split (CPU trials of a checkpoint trained elsewhere)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    smoke = args.smoke
    lengths = args.lengths or ([512] if smoke else [8192, 16384, 32768])
    counts = args.docs or ([2] if smoke else [4, 2, 2])
    if len(counts) == 1:
        counts = counts * len(lengths)
    op_lengths = args.op_lengths or ([512] if smoke else [16384, 32768])
    sweeps_ppl = SMOKE_SWEEP if smoke else PPL_SWEEP
    sweeps_op = SMOKE_SWEEP if smoke else OP_SWEEP
    base = {"min_seq_len": 256 if smoke else 1024}
    if smoke:
        base.update({m: dict(v) for m, v in SMOKE_OPTIONS.items()})
    sections = set(args.sections.split(","))
    wanted = None if args.curves is None else {c.strip() for c in args.curves.split(",")}
    known = {c[0] for c in OP_CURVES + PPL_CURVES}
    if wanted is not None and wanted - known:
        parser.error(f"--curves: unknown {sorted(wanted - known)}; known: {sorted(known)}")
    ppl_curves = tuple(c for c in PPL_CURVES if wanted is None or c[0] in wanted)
    op_curves = tuple(c for c in OP_CURVES if wanted is None or c[0] in wanted)
    deadline = Deadline(args.time_budget)
    notes: list[str] = []

    def log(msg):
        print(msg, flush=True)

    model, ckpt = tsl.load_checkpoint(args.checkpoint, device, dtype)
    manifest = tsl.build_corpus(0).manifest if args.local_heldout else ckpt_manifest(args.checkpoint)
    if args.local_heldout:
        notes.append("held-out documents from the local split (--local-heldout), not the recorded manifest")
    # per method, as the package resolves it per call ("auto": the Triton kernel on CUDA, the reference otherwise)
    kernels = {m: args.kernel for m in METHODS}
    for n in notes:
        log(n)
    result = {"checkpoint": str(args.checkpoint.name), "model_args": ckpt["model_args"], "device": str(device),
              "dtype": str(dtype), "env": harness.env_info(), "base_options": base, "kernels": kernels,
              "notes": notes, "param": PARAM, "matched_densities": MATCHED_DENSITIES}
    torch.manual_seed(0)

    if "ppl" in sections:
        docs = load_documents(manifest, lengths, counts, verify=not args.no_verify)
        result["ppl_documents"] = {str(L): d["paths"] for L, d in docs.items()}
        log(f"(a) bits per byte: lengths {lengths}, documents {counts}, {args.attention} path")
        result["ppl"] = run_ppl(model, docs, base, kernels, sweeps_ppl, args.attention,
                                deadline.at(args.ppl_share), device, log, notes, curves=ppl_curves,
                                head_dim=ckpt["model_args"]["dim"] // ckpt["model_args"]["n_heads"])
        for r in result["ppl"]["rows"]:  # for interpolation on a log scale: gains (negative deltas) count as 0
            r["delta_bpb_pos"] = max(r["delta_bpb"], 0.0)
    if "operator" in sections:
        op_docs = load_documents(manifest, op_lengths, [1] * len(op_lengths), verify=not args.no_verify)
        log(f"(b) operator level: lengths {op_lengths}")
        op = run_operator(model, op_docs, base, kernels, sweeps_op, deadline.end, device, log, curves_to_run=op_curves)
        result["operator"] = {str(k): v for k, v in op.items()}
    result["seconds"] = round(time.time() - deadline.t0, 1)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = tables(result)
    note = plot(result, args.out_dir / f"{args.name}.png")
    if note:
        notes.append(note)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    header = (f"# Sparse attention quality on a trained byte-level LM ({ckpt['model_args']})\n\n"
              f"device {result['env'].get('gpu', 'cpu')}, {dtype}; kernels {kernels}; {result['seconds']} s\n\n"
              + "".join(f"- {n}\n" for n in notes))
    (args.out_dir / f"{args.name}.md").write_text(header + "\n" + text + "\n")
    store_rows = [{"section": "ppl", **{k: v for k, v in r.items() if k != "per_doc_bpb"}}
                  for r in result.get("ppl", {}).get("rows", [])]
    store_rows += [{"section": "operator", "length": int(length), "curve": label,
                    **{k: v for k, v in p.items() if k != "layers"}}
                   for length, op in result.get("operator", {}).items() for label, points in op["curves"].items()
                   for p in points]
    if args.out_dir != harness.RUNS_DIR or not args.smoke:  # a smoke run leaves the store alone
        harness.append_store("quality", store_rows, params=("length", "value"), extra={"name": args.name},
                             out_dir=None if args.out_dir == harness.RUNS_DIR else args.out_dir)
    print(text)
    return result


if __name__ == "__main__":
    main()
