"""The README's picture: whole-model time to first token against prompt length, the dense compiled model against
methods at their defaults, from the end-to-end store (``benchmarks/results/bench_e2e.jsonl``).

    python benchmarks/plot_ttft.py                                  # docs/ttft.png: dense, sampled, peak, pbs
    python benchmarks/plot_ttft.py --methods sampled s2o --out /tmp/ttft.png

For each length it takes each method's most recent measurement at its defaults and the dense compiled model's
(``inductor``) from the same run, so each speedup compares two numbers timed in one loop. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import latest_with_baseline, read_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def latest_pairs(rows: list, method: str) -> dict:
    """{N: (dense ms, method ms, date, device)} from the latest run that timed ``method`` at its defaults at N."""
    out = {}
    for n in sorted({r["N"] for r in rows if r["metric"] == "ttft_ms"}):
        found = latest_with_baseline(rows, "ttft_ms", method, "inductor", N=n)
        if found is not None:
            last, dense = found
            out[n] = (dense["value"], last["value"], last["date"][:10], last["device"])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["sampled", "peak", "pbs"])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ttft.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_store("bench_e2e")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dense_done, dates, devices = False, set(), set()
    for index, method in enumerate(args.methods):
        pairs = latest_pairs(rows, method)
        if not pairs:
            raise SystemExit(f"no defaults rows for {method!r} in bench_e2e.jsonl")
        ns = sorted(pairs)
        if not dense_done:
            ax.plot(ns, [pairs[n][0] / 1e3 for n in ns], "k-o", label="dense (torch.compile, cuDNN attention)")
            dense_done = True
        ax.plot(ns, [pairs[n][1] / 1e3 for n in ns], "-o", label=f"{method} at its defaults")
        for n in ns:
            dense, sparse, date, device = pairs[n]
            dates.add(date)
            devices.add(device)
            if dense / sparse >= 1.05:
                # labels of neighbouring curves apart: the first above its point, the others below
                ax.annotate(f"{dense / sparse:.2f}x", (n, sparse / 1e3), textcoords="offset points",
                            xytext=(-34, 5) if index == 0 else (4, -12), fontsize=8, color=f"C{index}")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (s)")
    ax.set_xticks(ns, [f"{n // 1024}K" for n in ns])
    ax.set_title(f"Llama-3.1-8B shape, bf16, batch 1, {', '.join(sorted(devices))}\n"
                 f"measured {min(dates)} to {max(dates)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
