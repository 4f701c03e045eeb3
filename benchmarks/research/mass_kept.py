"""True attention mass each block plan keeps, and its output error, at matched density, next to an oracle.

Is a method's retrieval loss its selection rule (PBS's pooled block estimate, S2O's ranked prefix with early stop)
or our implementation? This measures, on the real (q, k, v) of the trained retrieval model
(``checkpoints/retrieval_families_lm.pt``, float32 on the CPU), the quantity the methods' selection tries to
maximise: the share of the dense softmax mass that falls inside the tiles a plan computes.

Prompts: held-out-family retrieval instances at ``--length`` (one per family of ``--families``), run densely once,
capturing every layer's (q, k, v). Contenders (default 128 x 128 tiles): ``pbs``, ``pbs-noperm`` (PBS's selector,
``reorder="none"``), ``s2o`` (paper default S = 2048: its per-segment window alone computes ~0.49 of the tiles at
8K, so it cannot reach 0.1 and runs at that floor), ``s2o-S256`` (S = 256, floor ~0.11), ``sampled``, ``peak``. Each
knob is calibrated to ``--density`` on the first prompt's layers (``--calibrate shared``, as ``bench_selectors.py``,
with ``density_calibration.calibrate``, ``--steps`` bisection steps) or on each layer (``per-layer``); S2O's early
stop by the same bisection, its visited tiles counted from dense mass (``calibrate_early_stop``). Then, per layer:

* ``mass``: mean over query heads and rows of the dense causal softmax probability on the keys of the tiles the
  plan computes for the row's query block (key and query permutations followed; with S2O's early stop, only the
  tiles the walk of ``plan.py`` visits);
* ``oracle_mass``: the most mass any plan keeps at the contender's own density, per head (the ``oracle`` below at
  that density), so ``oracle_mass - mass`` is what the selection rule loses at the density it paid for;
* ``rel_l1`` (sum |o - o_dense| / sum |o_dense|) and ``mse`` against dense causal attention of the plan's output,
  computed exactly from the dense probabilities (renormalised over the computed keys, times V); ``--reference``
  runs ``plan.reference_attention`` instead and reports the largest differences (``check_output``,
  ``check_visited``: 1e-5 and 0 on layer 1 for pbs, s2o and the oracles); ``density``: tiles computed (visited)
  over causal tiles (``plan_density``, the listed tiles, is ``listed_density``).

Oracles (identity order, from the true block-mass table): ``oracle`` keeps per head the diagonal tiles, tile 0 and
then the (query block, tile) pairs with the most true mass over all blocks until the density is ``--density``
(this maximises ``mass`` at that density); ``oracle-block`` gives every query block the same share of its visible
tiles (diagonal and tile 0 forced, then its top tiles by mass), the per-block budget the selectors use.

    python benchmarks/research/mass_kept.py --steps 10             # CPU, 2 cores: ~10 min (3 prompts x 4 layers x 8 rows)

Rows: ``results/mass_kept.jsonl`` (``harness.append_store``), one per (prompt, layer, contender).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the maintained helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_selectors, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sparse_compile  # noqa: E402
import retrieval_families as rf  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from density_calibration import calibrate  # noqa: E402
from bench_selectors import attention_by  # noqa: E402
from harness import append_store, format_table  # noqa: E402
from sparse_compile.kernels.validate import expand_heads  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.plan import (VISIBLE_NONE, VISIBLE_PARTIAL, block_visibility, causal_tile_count,  # noqa: E402
                                 plan_density, plan_from_block_mask, reference_attention)

CONTENDERS = {  # name: (method, reorder override, fixed parameters)
    "pbs": ("pbs", None, {}),
    "pbs-noperm": ("pbs", "none", {}),
    "s2o": ("s2o", None, {}),  # S = 2048: its intra-segment window alone computes ~0.49 of the tiles at 8K
    "s2o-S256": ("s2o", None, {"segment_size": 256}),  # the largest segment whose floor (~0.11) is near 0.1
    "sampled": ("sampled", None, {}),
    "peak": ("peak", None, {}),
}


def dense_probs(q: torch.Tensor, k: torch.Tensor, head: int) -> torch.Tensor:
    """(N, N) float32 causal softmax of query head ``head`` (batch 0), scale 1/sqrt(D)."""
    n = q.shape[2]
    kv = k[0, head * k.shape[1] // q.shape[1]].float()
    logits = (q[0, head].float() @ kv.T) / math.sqrt(q.shape[-1])
    logits.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(logits, -1)


def plan_tiles(plan, probs: list, heads: int) -> list:
    """Per query head and logical query block of ``plan`` (batch 0): (physical query rows (m,), physical keys of
    each listed tile (T, block_n) with N for padding or a key past the end, the rows' dense mass on each listed
    tile (m, T), masked tile count). ``probs``: each head's (N, N) dense causal probabilities."""
    n = probs[0].shape[0]
    offsets = expand_heads(plan.tile_offsets, heads)[0].long()
    counts = expand_heads(plan.tile_counts, heads)[0].long()
    masked = expand_heads(plan.masked_counts, heads)[0].long()
    key_index = None if plan.key_index is None else expand_heads(plan.key_index, heads)[0].long()
    query_index = None if plan.query_index is None else expand_heads(plan.query_index, heads)[0].long()
    out = []
    for h in range(heads):
        padded = torch.nn.functional.pad(probs[h], (0, 1))  # column N: zero mass, the dump of padding keys
        order = torch.arange(n) if query_index is None else query_index[h]
        blocks = []
        for i in range(offsets.shape[1]):
            count = int(counts[h, i])
            logical = offsets[h, i, :count, None] + torch.arange(plan.block_n)
            if key_index is None:
                phys = torch.where(logical < n, logical, n)
            else:
                length = key_index.shape[-1]
                phys = torch.where(logical < length, key_index[h, logical.clamp(max=length - 1)], -1)
                phys = torch.where((phys >= 0) & (phys < n), phys, n)
            rows = order[i * plan.block_m:(i + 1) * plan.block_m]
            tile_mass = padded[rows][:, phys.flatten()].view(rows.numel(), count, plan.block_n).sum(-1)
            blocks.append((rows, phys, tile_mass, int(masked[h, i])))
        out.append(blocks)
    return out


def visited_counts(tiles: list, early_stop: float) -> torch.Tensor:
    """(heads, nqb) tiles each query block computes: all it lists, or with ``early_stop`` = tau > 0 the walk of
    ``plan.py``'s early stop, from dense mass (after an unmasked tile t the block stops, keeping t, when every row's
    gain on t is below tau times its mass on tiles 0..t-1; the ratio is the online softmax's, whatever the max)."""
    visited = torch.zeros(len(tiles), len(tiles[0]), dtype=torch.long)
    for h, blocks in enumerate(tiles):
        for i, (_, _, tile_mass, masked) in enumerate(blocks):
            count = tile_mass.shape[1]
            if early_stop <= 0 or count == 0:
                visited[h, i] = count
                continue
            before = tile_mass.cumsum(1) - tile_mass
            goes_on = (tile_mass >= early_stop * before).any(0) | (torch.arange(count) < masked)
            stops = (~goes_on).nonzero()
            visited[h, i] = int(stops[0]) + 1 if stops.numel() else count
    return visited


def evaluate(tiles: list, visited: torch.Tensor, probs: list, v: torch.Tensor) -> tuple:
    """(mass kept per head, output (1, heads, N, D)) of the plan's computed tiles: the dense probabilities on the
    computed keys, renormalised, times V (the online softmax over those keys, exactly)."""
    heads, n = len(tiles), probs[0].shape[0]
    out = torch.zeros(1, heads, n, v.shape[-1])
    mass = []
    for h, blocks in enumerate(tiles):
        values = torch.nn.functional.pad(v[0, h * v.shape[1] // heads].float(), (0, 0, 0, 1))
        padded = torch.nn.functional.pad(probs[h], (0, 1))
        total = 0.0
        for i, (rows, phys, tile_mass, _) in enumerate(blocks):
            keys = phys[: int(visited[h, i])].flatten()
            kept = tile_mass[:, : int(visited[h, i])].sum(-1, keepdim=True)
            total += float(kept.sum())
            out[0, h, rows] = (padded[rows][:, keys] @ values[keys]) / kept.clamp_min(1e-30)
        mass.append(total / n)
    return mass, out


def block_mass(probs: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """(nqb, nkt) true mass of each (query block, key tile), summed over the block's rows (N a multiple of both)."""
    n = probs.shape[0]
    return probs.view(n // block_m, block_m, n // block_n, block_n).sum((1, 3))


def oracle_keep(mass: torch.Tensor, vis: torch.Tensor, density: float, per_block: bool) -> torch.Tensor:
    """(nqb, nkt) bool: diagonal (partially visible) tiles and tile 0 forced, then the visible tiles with the most
    true ``mass``: globally until ``density`` of the causal tiles (``per_block`` False) or ``density`` of each
    block's visible tiles (rounded, at least the forced ones)."""
    visible = vis != VISIBLE_NONE
    forced = (vis == VISIBLE_PARTIAL) | (visible & (torch.arange(mass.shape[1]) == 0))
    rest = torch.where(visible & ~forced, mass, torch.full_like(mass, -1.0))
    keep = forced.clone()
    if per_block:
        extra = (density * visible.sum(-1)).round().long() - forced.sum(-1)
        rank = rest.argsort(-1, descending=True).argsort(-1)
        return keep | ((rank < extra[:, None]) & (rest >= 0))
    budget = max(0, round(density * int(visible.sum())) - int(forced.sum()))
    top = rest.flatten().topk(budget).indices
    keep.view(-1)[top] = True
    return keep & visible


def oracle_mass_at(mass: torch.Tensor, vis: torch.Tensor, density: float) -> float:
    """Total true ``mass`` kept by the global oracle at ``density`` (``oracle_keep`` with ``per_block`` False)."""
    return float((mass * oracle_keep(mass, vis, density, per_block=False)).sum())


def oracle_plan(q: torch.Tensor, tables: list, density: float, per_block: bool, block: int):
    """The oracle's ``BlockPlan`` (identity order, per query head) from each head's block-mass table."""
    n, heads = q.shape[2], q.shape[1]
    vis = block_visibility(n, n, block, block, heads=heads)
    keep = torch.stack([oracle_keep(t, vis[0, h], density, per_block) for h, t in enumerate(tables)])[None]
    return plan_from_block_mask(keep, vis, block, block)


def measure(name: str, plan, q, k, v, probs: list, tables: list, dense_out: torch.Tensor, tiles=None,
            reference: bool = False) -> dict:
    """Density, mass kept, oracle mass at the same per-head density, rel L1 and MSE of ``plan`` on one layer; with
    ``reference``, outputs and visited tiles from ``plan.reference_attention`` instead (slow on the CPU), and
    ``check``: the largest difference from the dense-mass evaluation."""
    n, heads = q.shape[2], q.shape[1]
    tiles = plan_tiles(plan, probs, heads) if tiles is None else tiles
    visited = visited_counts(tiles, plan.early_stop)
    mass, out = evaluate(tiles, visited, probs, v)
    row = {}
    if reference:
        ref, ref_visited = reference_attention(q, k, v, plan, return_visited=True)
        row = {"check_output": float((ref.float() - out).abs().max()),
               "check_visited": float((ref_visited[0].long() - visited).abs().max())}
        out, visited = ref.float(), ref_visited[0].long()
    dens = visited.sum(-1).float() / causal_tile_count(n, n, plan.block_m, plan.block_n)  # per head: computed
    vis = block_visibility(n, n, n // tables[0].shape[0], n // tables[0].shape[1])[0, 0]
    best = [oracle_mass_at(tables[h], vis, float(dens[h])) / n for h in range(heads)]
    err = (out - dense_out).flatten()
    return {"contender": name, "density": float(dens.mean()),
            "listed_density": float(plan_density(plan, n, n, heads).mean()),
            "mass": sum(mass) / heads, "oracle_mass": sum(best) / heads,
            "rel_l1": float(err.abs().sum() / dense_out.abs().sum()), "mse": float(err.pow(2).mean()), **row}


def calibrate_early_stop(name: str, target: float, layers: list, base, steps: int) -> dict:
    """``density_calibration.calibrate`` for a method whose density knob is its early stop (S2O): the same bisection
    on the same knob, on the mean density over ``layers`` ((q, k) pairs), each layer's computed tiles counted by
    ``visited_counts`` from its dense mass rather than by the reference's slow tile-by-tile walk (the plan's
    listed tiles do not depend on the knob: checked)."""
    spec = sparse_compile.registry.method_spec(CONTENDERS[name][0]).density
    walks = []
    for q, k in layers:
        n, heads = q.shape[2], q.shape[1]
        plans = [build_plan(q, k, None, config_of(name, {spec.name: x}, base), implementation="reference")
                 for x in (spec.low, spec.high)]
        assert all(torch.equal(getattr(plans[0], f), getattr(plans[1], f)) for f in ("tile_offsets", "tile_counts"))
        probs = [dense_probs(q, k, h) for h in range(heads)]
        walks.append((plan_tiles(plans[0], probs, heads),
                      causal_tile_count(n, n, plans[0].block_m, plans[0].block_n) * heads))
        del probs
    low, high, best = spec.low, spec.high, None
    for _ in range(steps):
        mid = (low + high) / 2
        d = sum(float(visited_counts(tiles, mid).sum()) / total for tiles, total in walks) / len(walks)
        if best is None or abs(d - target) < abs(best[1] - target):
            best = (mid, d)
        if (d < target) == spec.higher_keeps_more:
            low = mid
        else:
            high = mid
    return {spec.name: best[0]}


def config_of(name: str, knob: dict, base):
    """The contender's ``SparseConfig`` with its knob."""
    method, reorder, fixed = CONTENDERS[name]
    config = base.with_overrides(method, {**fixed, **knob})
    return config.replace(reorder=reorder) if reorder else config


def calibrated(name: str, target: float, layers: list, base, steps: int) -> dict:
    """The contender's knob for mean density ``target`` over ``layers`` ((q, k) pairs)."""
    method, reorder, fixed = CONTENDERS[name]
    if sparse_compile.registry.method_spec(method).density.name == "early_stop":
        return calibrate_early_stop(name, target, layers, base, steps)
    return calibrate(method, target, layers, base.with_overrides(method, fixed) if fixed else base, reorder=reorder, steps=steps)[0]


def average(rows: list, keys: tuple) -> list:
    """Mean of the numeric fields over the rows sharing ``keys``."""
    groups = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for key, group in groups.items():
        numeric = [f for f, x in group[0].items() if isinstance(x, float)]
        out.append({**dict(zip(keys, key)), **{f: sum(r[f] for r in group) / len(group) for f in numeric},
                    "rows": len(group)})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(tsl.REPO / "benchmarks" / "checkpoints" /
                                                    "retrieval_families_lm.pt"))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--families", nargs="+", default=["yaml", "json", "table"],
                        help="held-out families, one prompt each")
    parser.add_argument("--seed", type=int, default=5_555_555)
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="layers to measure (default all)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--calibrate", choices=("per-layer", "shared"), default="shared",
                        help="one knob per contender for the first prompt's layers (shared) or one per layer")
    parser.add_argument("--steps", type=int, default=12, help="bisection steps of the calibration")
    parser.add_argument("--reference", action="store_true",
                        help="outputs and visited tiles by plan.reference_attention, with the check columns (slow)")
    parser.add_argument("--out", default=None, help="store folder (default benchmarks/results); 'none': no store")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = tsl.load_checkpoint(args.checkpoint, device="cpu", dtype=torch.float32)
    corpus = tsl.build_corpus(1 << 20, log=lambda *a, **k: None)
    base = sparse_compile.SparseConfig(min_seq_len=1024, dense_when_faster=False)
    rng = random.Random(args.seed)
    instances = [i for f in args.families for i in rf.make_batch([f], corpus.heldout, args.length, rng)]
    prompts = []
    for inst in instances:
        capture = []
        with attention_by(model, None, capture, values=True):
            model(inst.tokens[None].long())
        prompts.append(capture)
    layers = args.layers if args.layers is not None else list(range(len(prompts[0])))
    shared = {}
    if args.calibrate == "shared":
        shared = {name: calibrated(name, args.density, [(q, k) for q, k, _ in prompts[0]], base, args.steps)
                  for name in args.contenders}
    rows, started = [], time.perf_counter()
    extra = {"checkpoint": Path(args.checkpoint).name, "target_density": args.density, "calibrate": args.calibrate,
             "steps": args.steps}
    for family, capture in zip(args.families, prompts):
        for layer in layers:
            q, k, v = capture[layer]
            n, heads = q.shape[2], q.shape[1]
            found = []
            knobs = {name: shared.get(name) or calibrated(name, args.density, [(q, k)], base, args.steps)
                     for name in args.contenders}
            probs = [dense_probs(q, k, h) for h in range(heads)]
            tables = [block_mass(p, 128, 128) for p in probs]
            dense_out = torch.stack([p @ v[0, h * v.shape[1] // heads].float() for h, p in enumerate(probs)])[None]
            for name in args.contenders:
                plan = build_plan(q, k, None, config_of(name, knobs[name], base), implementation="reference")
                found.append({**measure(name, plan, q, k, v, probs, tables, dense_out, reference=args.reference),
                              "params": ", ".join(f"{a}={b:.4g}" for a, b in {**CONTENDERS[name][2],
                                                                               **knobs[name]}.items())})
            for label, per_block in (("oracle", False), ("oracle-block", True)):
                plan = oracle_plan(q, tables, args.density, per_block, 128)
                found.append({**measure(label, plan, q, k, v, probs, tables, dense_out, reference=args.reference),
                              "params": f"density={args.density}"})
            for row in found:
                row.update({"N": n, "family": family, "layer": layer})
                print(f"{family} L{layer} {row['contender']:>12}: density {row['density']:.3f} mass {row['mass']:.4f}"
                      f" (oracle {row['oracle_mass']:.4f}) rel_l1 {row['rel_l1']:.4f} mse {row['mse']:.3g}"
                      + (f" check out {row['check_output']:.2g} visited {row['check_visited']:.0f}"
                         if args.reference else "") + f"  [{time.perf_counter() - started:.0f}s]", flush=True)
            rows += found
            del probs
    if args.out != "none":
        append_store("mass_kept", rows, params=("N", "layer"), out_dir=args.out, extra=extra)
    columns = ["contender", "density", "mass", "oracle_mass", "rel_l1", "mse", "rows"]
    print("\nper layer (mean over prompts)")
    print(format_table(average(rows, ("layer", "contender")), ["layer"] + columns))
    print("\nmean over layers and prompts")
    print(format_table(average(rows, ("contender",)), columns))


if __name__ == "__main__":
    main()
