"""Attention maps of the trained small LM with each method's selected blocks drawn over them.

    PYTHONPATH=. python benchmarks/attention_map.py                    # GPU: 8K-byte held-out input
    python benchmarks/attention_map.py --smoke --checkpoint /tmp/lm/small_lm.pt --out-dir /tmp/maps   # CPU

Two pictures, as in the papers:

* ``attention_map_pbs.png`` (PBS-Attn Fig. 2): the same MeanPooling block selector (threshold tau) without the
  key permutation (a) and with PBS's segmented query-aware key permutation (b). The overlay marks the selected
  blocks; "coverage" is the attention mass the selected blocks hold (mean over query rows), "density" the
  fraction of causal blocks selected.
* ``attention_map_s2o.png`` (S2O Fig. 2): (a) original order, (b) PBS's permutation with its selection, (c) S2O's
  order: queries sorted inside segments, and for each segment its own keys followed by its causal prefix ranked
  by importance; the overlay marks the tiles S2O actually visited before early stopping (from the kernel's
  visit counts). In (c) the x axis is the position in the segment's key list, not a key position.

Maps are block-averaged attention probabilities on a log scale: for each query block the softmax rows are
computed for that block only (block_m x N) and summed into key tiles, so nothing N x N is ever built.
The layer and head are chosen by a stated rule unless given: the head with the most attention mass far from the
diagonal and away from the first (sink) tile, averaged over the second half of the query blocks, i.e. the head
where the choice of blocks matters most.
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
import lm_corpus  # noqa: E402
import quality_data  # noqa: E402
from quality_eval import SMOKE_OPTIONS  # noqa: E402
import train_small_lm as tsl  # noqa: E402

from sparse_compile import SparseConfig  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.kernels.validate import expand_heads  # noqa: E402
from sparse_compile.plan import execute_plan  # noqa: E402
from sparse_compile.report import density_from_visits  # noqa: E402


def block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, bm: int, bn: int, *,
               query_index: Optional[torch.Tensor] = None, key_index: Optional[torch.Tensor] = None,
               spans: Optional[list[tuple[int, int]]] = None) -> torch.Tensor:
    """Attention mass of one head per (logical query block, logical key tile), averaged over the block's rows.

    q (N, D) and k (N, D) of one query head and its KV head, causal, queries at positions 0..N-1.
    ``query_index`` (N,) / ``key_index`` (L,) map logical to physical rows (key -1 = padding); ``spans[i]`` is the
    logical key range [lo, hi) that query block i may see (S2O: its segment's part of the key list; default the
    whole list). Returns float32 (n_query_blocks, max span tiles), column t = logical tile lo // bn + t, NaN
    outside the span. Each row sums to 1 over its span when the span holds every key once.
    Memory: one (bm x L) block of probabilities at a time.
    """
    N, D = q.shape
    L = key_index.shape[0] if key_index is not None else N
    nqb = -(-N // bm)
    if spans is None:
        spans = [(0, L)] * nqb
    width = max(-(-(hi - lo) // bn) for lo, hi in spans)
    out = torch.full((nqb, width), float("nan"), dtype=torch.float32)
    qf, kf = q.float(), k.float()
    pos = torch.arange(N, device=q.device)
    for i in range(nqb):
        rows = torch.arange(i * bm, min((i + 1) * bm, N), device=q.device)
        phys = rows if query_index is None else query_index[rows].long()
        s = (qf[phys] @ kf.T) * scale
        s = s.masked_fill(pos[None, :] > phys[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)  # (rows, N) over physical keys
        lo, hi = spans[i]
        if key_index is None:
            pl = p[:, lo:hi]
        else:
            ki = key_index[lo:hi].long()
            pl = torch.where(ki[None, :] >= 0, p[:, ki.clamp_min(0)], torch.zeros((), device=p.device))
        n_t = -(-(hi - lo) // bn)
        pl = torch.nn.functional.pad(pl, (0, n_t * bn - (hi - lo)))
        out[i, :n_t] = pl.view(len(rows), n_t, bn).sum(-1).mean(0).cpu()
    return out


def selected_tiles(plan, visited: torch.Tensor, head: int, spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    """bool (n_query_blocks, width): the tiles the kernel computed for ``head``, in the map's columns."""
    nqb = plan.tile_offsets.shape[2]
    offs = expand_heads(plan.tile_offsets, visited.shape[1])[0, head].cpu()
    vis = visited[0, head].cpu()
    selected = torch.zeros(nqb, width, dtype=torch.bool)
    for i in range(nqb):
        n = int(vis[i])
        cols = offs[i, :n].long() // plan.block_n - spans[i][0] // plan.block_n
        selected[i, cols[(cols >= 0) & (cols < width)]] = True
    return selected


def run_plan(q, k, v, scale, config: SparseConfig, kernel: str):
    """(plan, visited (B, Hq, n_query_blocks)) for ``config`` on one layer's q/k/v."""
    plan = build_plan(q, k, scale, config)
    _, visited = execute_plan(q, k, v, plan, scale, kernel=kernel, return_visited=True)
    return plan, visited


def s2o_spans(config: SparseConfig, n: int, nqb: int, bm: int) -> list[tuple[int, int]]:
    from sparse_compile.methods.s2o import s2o_layout

    lay = s2o_layout(n, config.params_of("s2o").segment_size, config.params_of("s2o").block_size_kv)
    spans = []
    for i in range(nqb):
        seg = i * bm // lay.segment
        spans.append((lay.base[seg], lay.base[seg] + lay.intra_pad[seg] + lay.prefix_len[seg]))
    return spans


def long_range_peak(mass: torch.Tensor) -> float:
    """Concentrated long-range attention: for each query block of the second half, the largest mass on a single
    tile at least two tiles left of the diagonal and not the first (sink) tile; averaged. High for retrieval and
    induction heads (much mass on a few far blocks), low for local heads and for diffuse averaging heads."""
    nqb = mass.shape[0]
    i = torch.arange(nqb)[:, None]
    j = torch.arange(mass.shape[1])[None, :]
    far = (j <= i - 2) & (j >= 1)
    m = torch.nan_to_num(mass) * far
    return float(m[nqb // 2:].amax(-1).mean())


def coverage(mass: torch.Tensor, selected: torch.Tensor) -> float:
    return float((torch.nan_to_num(mass) * selected).sum(-1).mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=tsl.DEFAULT_CHECKPOINT)
    parser.add_argument("--out-dir", type=Path, default=harness.RUNS_DIR)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--length", type=int, default=None, help="input bytes (default 8192; smoke 512)")
    parser.add_argument("--layer", type=int, default=None)
    parser.add_argument("--head", type=int, default=None)
    parser.add_argument("--kernel", choices=("auto", "triton", "reference"), default="auto")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--local-heldout", action="store_true",
                        help="use the local held-out split (CPU trials of a checkpoint trained elsewhere)")
    args = parser.parse_args(argv)

    t0 = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    length = args.length or (512 if args.smoke else 8192)
    base = {"min_seq_len": 2}  # planner "auto": the fast stages on CUDA, the references otherwise
    if args.smoke:
        base.update({m: dict(v) for m, v in SMOKE_OPTIONS.items()})
    kernel = args.kernel  # execute_plan: "auto" is the Triton kernel on CUDA, the reference otherwise

    model, ckpt = tsl.load_checkpoint(args.checkpoint, device, dtype)
    manifest = lm_corpus.build_corpus(0).manifest if args.local_heldout else quality_data.ckpt_manifest(args.checkpoint)
    doc = lm_corpus.heldout_documents(manifest, length, 1, verify=not args.no_verify)[0]
    tokens = torch.frombuffer(bytearray(doc["data"][:length]), dtype=torch.uint8).long()[None].to(device)
    captured: list = []
    with torch.no_grad(), quality_data.capture_attention_inputs(captured):
        model(tokens)
    layers = [c for c in captured if c["causal"] and not c["mask"]]
    hq, hkv = layers[0]["q"].shape[1], layers[0]["k"].shape[1]
    group = hq // hkv
    scale_of = [c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["q"].shape[-1]) for c in layers]

    pbs_cfg = SparseConfig.from_options(dict(base, method="pbs"))
    bm = pbs_cfg.params_of("pbs").block_size
    # choose the head: the most long-range attention in the original order
    scores = []
    for li, c in enumerate(layers):
        for h in range(hq):
            m = block_mass(c["q"][0, h], c["k"][0, h // group], scale_of[li], bm, bm)
            scores.append({"layer": li, "head": h, "long_range_peak": long_range_peak(m)})
    if args.layer is not None and args.head is not None:
        layer, head = args.layer, args.head
        rule = "given on the command line"
    else:
        best = max(scores, key=lambda s: s["long_range_peak"])
        layer, head = best["layer"], best["head"]
        rule = ("most concentrated long-range attention: largest single-tile mass >= 2 tiles left of the diagonal, "
                "not the sink tile, averaged over the second half of the query blocks")
    c = layers[layer]
    q, k, v, scale = c["q"], c["k"], c["v"], scale_of[layer]
    kvh = head // group
    qh, kh = q[0, head], k[0, kvh]
    N = qh.shape[0]
    panels = {}

    def add_panel(name, title, config, reorder_keys: bool, s2o: bool = False, overlay: bool = True):
        b_m = config.params_of("s2o").block_size_q if s2o else config.params_of("pbs").block_size
        b_n = config.params_of("s2o").block_size_kv if s2o else config.params_of("pbs").block_size
        plan, visited = run_plan(q, k, v, scale, config, kernel) if overlay or reorder_keys or s2o else (None, None)
        qi = plan.query_index[0, head] if (plan is not None and plan.query_index is not None) else None
        ki = plan.key_index[0, kvh if plan.key_index.shape[1] == hkv else head] \
            if (plan is not None and plan.key_index is not None and reorder_keys) else None
        nqb = -(-N // b_m)
        spans = s2o_spans(config, N, nqb, b_m) if s2o else None
        mass = block_mass(qh, kh, scale, b_m, b_n, query_index=qi, key_index=ki, spans=spans)
        panel = {"title": title, "mass": mass, "block": [b_m, b_n], "s2o": s2o}
        if overlay:
            sp = spans or [(0, N)] * nqb
            selected = selected_tiles(plan, visited, head, sp, mass.shape[1])
            panel.update(selected=selected, coverage=coverage(mass, selected),
                         density=density_from_visits(visited, plan, N, N, q.shape[1])[head])
        panels[name] = panel

    tau = pbs_cfg.params_of("pbs").threshold
    add_panel("original", "original order", pbs_cfg, reorder_keys=False, overlay=False)
    add_panel("meanpool", f"no permutation, MeanPooling τ={tau}", pbs_cfg.with_overrides(None, {"reorder": "none"}),
              reorder_keys=False)
    add_panel("pbs", f"PBS permutation (S={pbs_cfg.params_of('pbs').segment_size}), MeanPooling τ={tau}", pbs_cfg,
              reorder_keys=True)
    s2o_cfg = SparseConfig.from_options(dict(base, method="s2o"))
    s2o_params = s2o_cfg.params_of("s2o")
    add_panel("s2o", f"S2O order (S={s2o_params.segment_size}), early stop τ={s2o_params.early_stop}", s2o_cfg,
              reorder_keys=True, s2o=True)

    summary = {
        "document": doc["path"], "length": N, "layer": layer, "head": head, "kv_head": kvh, "rule": rule,
        "kernel": kernel, "device": str(device),
        "panels": {n: {k2: v2 for k2, v2 in p.items() if k2 in ("title", "coverage", "density", "block")}
                   for n, p in panels.items()},
        "head_scores": sorted(scores, key=lambda s: -s["long_range_peak"]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    note = draw(panels, summary, args.out_dir)
    if note:
        summary["note"] = note
    summary["seconds"] = round(time.time() - t0, 1)
    (args.out_dir / "attention_map.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"layer {layer} head {head} ({rule}); document {doc['path']}, {N} bytes")
    for n, p in summary["panels"].items():
        extra = f"coverage {p['coverage']:.3f} density {p['density']:.3f}" if "coverage" in p else ""
        print(f"  {n:9s} {p['title']:60s} {extra}")
    return summary


def outline_segments(selected: torch.Tensor) -> list:
    """Line segments (image coordinates) on the border of the True region of a boolean grid."""
    pad = torch.nn.functional.pad(selected, (1, 1, 1, 1))
    segs = []
    rows, cols = selected.shape
    for i in range(rows):
        for j in range(cols):
            if not selected[i, j]:
                continue
            y0, y1, x0, x1 = i - 0.5, i + 0.5, j - 0.5, j + 0.5
            if not pad[i, j + 1]:  # above
                segs.append([(x0, y0), (x1, y0)])
            if not pad[i + 2, j + 1]:  # below
                segs.append([(x0, y1), (x1, y1)])
            if not pad[i + 1, j]:  # left
                segs.append([(x0, y0), (x0, y1)])
            if not pad[i + 1, j + 2]:  # right
                segs.append([(x1, y0), (x1, y1)])
    return segs


def draw(panels: dict, summary: dict, out_dir: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.collections import LineCollection
        from matplotlib.colors import ListedColormap
    except ImportError:
        return "matplotlib not installed: no pictures"
    finite = torch.cat([p["mass"][torch.isfinite(p["mass"]) & (p["mass"] > 0)] for p in panels.values()])
    vmax = float(torch.log10(finite.max()))
    vmin = max(float(torch.log10(finite.min())), vmax - 6)  # six decades are plenty to see the structure
    head = f"layer {summary['layer']}, head {summary['head']}, {summary['length']}-byte held-out input"

    def show(ax, p):
        img = torch.log10(p["mass"].clamp_min(1e-30))
        img[~torch.isfinite(p["mass"]) | (p["mass"] <= 0)] = float("nan")  # causally invisible: blank
        im = ax.imshow(img.numpy(), cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
        if "selected" in p:
            # outline the selected region (edges between a selected and an unselected tile): the map stays legible
            ax.add_collection(LineCollection(outline_segments(p["selected"]), colors="red", linewidths=0.7))
            # and wash out the skipped tiles (visible ones only), so that inside and outside are unambiguous
            skipped = (~p["selected"] & torch.isfinite(img)).float().numpy()
            ax.imshow(skipped, cmap=ListedColormap([(1, 1, 1, 0), (1, 1, 1, 0.6)]), vmin=0, vmax=1,
                      interpolation="nearest")
            title = f"{p['title']}\ncoverage {p['coverage']:.3f}, density {p['density']:.3f}"
        else:
            title = p["title"]
        ax.set_title(title, fontsize=8)
        ax.set_ylabel(f"query block ({p['block'][0]})" + (" (sorted in segments)" if p["s2o"] else ""), fontsize=7)
        ax.set_xlabel("position in the segment's key list (tiles of %d)" % p["block"][1] if p["s2o"]
                      else f"key block ({p['block'][1]})", fontsize=7)
        return im

    for name, keys in (("pbs", ("meanpool", "pbs")), ("s2o", ("original", "pbs", "s2o"))):
        fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 4.6))
        im = None
        for ax, key in zip(axes, keys):
            im = show(ax, panels[key])
        fig.colorbar(im, ax=list(axes), shrink=0.8, label="log10 mean attention mass per block row")
        fig.suptitle(f"{head}; red outline = blocks computed, washed out = skipped", fontsize=9)
        fig.savefig(out_dir / f"attention_map_{name}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
    return None


if __name__ == "__main__":
    main()
