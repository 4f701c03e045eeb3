"""Retrieval kept against time to first token: every method at density 0.1, from the stores.

    python benchmarks/research/plot_frontier.py            # results/frontier.png and results/frontier.json

x: whole-model TTFT speedup over the dense compiled Llama-3.1-8B shape at 128K on one GPU (``bench_e2e.py``, the
latest ``<method>@0.1`` row); y: values retrieved exactly on the held-out format families, relative to dense, mean
over 16K / 32K / 64K (``bench_retrieval.py --families``, the latest ``<method>@0.1`` rows of the format-family
model); each point labelled with its selection time as a share of cuDNN's dense attention at 128K
(``bench_methods.py``, the latest row). A second panel: the same y against TTFT at 512K on 2 GPUs (Ulysses,
``bench_parallel.py``; dense there is fitted as in its report) for the methods measured there. No measurement is
made here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_parallel, harness
from bench_parallel import dense_seconds, latest_runs  # noqa: E402
from harness import RESULTS_DIR, read_store  # noqa: E402

N_TTFT = 131072
N_PARALLEL, GPUS_PARALLEL = 524288, 2
RETRIEVAL_LENGTHS = (16384, 32768, 65536)
DENSITY = 0.1


def latest(rows: list, key) -> dict:
    """The latest row's value per ``key(row)``."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["date"]):
        out[key(r)] = r
    return out


def frontier() -> list:
    suffix = f"@{DENSITY}"
    ttft = latest([r for r in read_store("bench_e2e", metric="speedup", N=N_TTFT)
                   if r["contender"].endswith(suffix)], lambda r: r["contender"][: -len(suffix)])
    families = [r for r in read_store("bench_retrieval", metric="family_heldout")
                if "retrieval_families_lm" in r.get("command", "")]
    held = latest(families, lambda r: (r["N"], r["contender"]))
    selection = latest(read_store("bench_methods", metric="sel_pct", N=N_TTFT), lambda r: r["method"])
    parallel = latest_runs(RESULTS_DIR / "bench_parallel.jsonl")
    cell = ((GPUS_PARALLEL, "sequence"), N_PARALLEL)
    dense_parallel = dense_seconds(parallel).get(cell, (None, False))[0]
    points = []
    for method, row in sorted(ttft.items()):
        kept = [held[(n, method + suffix)]["value"] / held[(n, "dense")]["value"] for n in RETRIEVAL_LENGTHS
                if (n, method + suffix) in held and (n, "dense") in held]
        if len(kept) != len(RETRIEVAL_LENGTHS):
            continue
        sel = selection.get(method)
        points.append({"method": method, "density": DENSITY, "ttft_speedup_128k": row["value"],
                       "ttft_device": row["device"], "ttft_commit": row["commit"],
                       "heldout_kept": sum(kept) / len(kept), "heldout_kept_per_length": kept,
                       "selection_pct_of_dense_128k": None if sel is None else sel["value"],
                       "selection_device": None if sel is None else sel["device"]})
        far = parallel.get((*cell, method + suffix))
        if far is not None and dense_parallel:
            points[-1].update(ttft_speedup_512k_2gpu=dense_parallel / far["ttft_s"], ttft_512k_device=far["device"],
                              ttft_512k_seconds=far["ttft_s"], dense_512k_seconds_fit=dense_parallel)
    return points


def main() -> None:
    points = frontier()
    (RESULTS_DIR / "frontier.json").write_text(json.dumps(points, indent=1) + "\n")
    for p in points:
        print(p)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    panels = [("ttft_speedup_128k", 2.7, f"TTFT speedup over dense compiled, 8B shape, {N_TTFT // 1024}K, 1 GPU"),
              ("ttft_speedup_512k_2gpu", 5.5, f"same, {N_PARALLEL // 1024}K on {GPUS_PARALLEL} GPUs (dense fitted)")]
    colors = {p["method"]: f"C{i}" for i, p in enumerate(points)}  # one colour per method in both panels
    for ax, (key, target, xlabel) in zip(axes, panels):
        for p in points:
            if p.get(key) is None:
                continue
            ax.scatter(p[key], p["heldout_kept"], s=30, color=colors[p["method"]])
            sel = p["selection_pct_of_dense_128k"]
            label = p["method"] + ("" if sel is None else f" (plan {sel:.1f}%)")
            ax.annotate(label, (p[key], p["heldout_kept"]), textcoords="offset points", xytext=(5, 3), fontsize=8)
        ax.axhline(0.95, color="k", ls=":", lw=1)
        ax.axvline(target, color="k", ls=":", lw=1)
        ax.set_xlabel(f"{xlabel}, density {DENSITY}", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out retrieval kept (16K-64K mean)")
    axes[0].set_ylim(0, 1.1)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "frontier.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
