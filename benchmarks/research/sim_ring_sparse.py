"""Ring (context) parallelism with sparse plans, simulated on real attention patterns (CPU, no GPU needed).

    python benchmarks/research/sim_ring_sparse.py                 # 8K and 16K, 4 layers, ~5 min on one core
    python benchmarks/research/sim_ring_sparse.py --smoke         # 2K, one layer, seconds (what the test runs)

Ulysses sequence parallelism gives each rank whole sequences for H/U heads, so it stops at U = number of KV heads
(8 for the Llama-3.1-8B shape). Past that, ring attention splits the sequence into P shards; a rank keeps its query
shard and receives the KV shards of the other ranks, one ring step each. With a ``BlockPlan`` a rank can skip every
remote KV shard that none of its query blocks selects. This script measures how much that is, on the plans the
selectors build for the small trained LM (``checkpoints/retrieval_lm.pt``: byte level, head dim 128, 4 query heads
sharing 1 KV head, i.e. exactly the head group one rank of an 8-way Ulysses group holds for the 8B shape). Each
layer's plan is one rank-group's plan; per layer and shard count P:

* ``remote_pairs_needed``: of the causal (rank, remote rank) pairs (the rank's queries can see some of the remote
  rank's keys), the share where the rank's query blocks select at least one tile of the remote rank's keys. One
  minus it is what ring steps can skip.
* ``recv_shard_frac_max``: KV bytes a rank receives when it skips unneeded remote chunks whole, over the bytes of
  dense ring attention (P - 1 shards), max over ranks (the straggler).
* ``recv_keys_frac_max``: the same when only the selected keys are fetched (a lower bound for any transfer scheme).
* ``compute_imbalance``: selected tiles per rank, max over mean (1.0 is balanced).

Assignments: ``contiguous`` (rank r holds shard r of P) and ``zigzag`` (the sequence in 2P chunks; rank r holds
chunks r and 2P-1-r, the load-balanced layout of causal ring attention). Values are means over layers (the
per-layer values are kept). Plans: the keep-everything causal plan (``dense``), ``sampled`` at budget 0.1 and
``pbs`` with its threshold bisected to a mean density of about 0.1.

Text: held-out source files of the checkpoint's data manifest, read from this interpreter's stdlib/site-packages;
files whose hash matches the manifest come first (exactly the held-out text), then files at held-out paths whose
version differs, then (none of those long enough) torch's own sources. The JSON says which was used.

Output: ``results/ring_sparse_sim.json`` (rows: method, length, P, assignment, metric, value) and a markdown table on
stdout, followed by the analytic cost model of the ring's communication for the 8B shape at 1M tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the maintained helpers, checkpoints and results
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import lm_corpus  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from quality_data import capture_attention_inputs  # noqa: E402

from sparse_compile.config import SparseConfig  # noqa: E402
from sparse_compile.methods import build_plan  # noqa: E402
from sparse_compile.plan import BlockPlan, causal_plan  # noqa: E402

__all__ = ["chunk_owner", "rank_key_needs", "shard_metrics", "cost_model", "ASSIGNMENTS", "METRICS"]

ASSIGNMENTS = ("contiguous", "zigzag")
METRICS = ("remote_pairs_needed", "recv_shard_frac_max", "recv_keys_frac_max", "compute_imbalance")
CHECKPOINT = HERE / "checkpoints" / "retrieval_lm.pt"


# --- the simulation -----------------------------------------------------------------------------------------------
def chunk_owner(num_ranks: int, assignment: str) -> torch.Tensor:
    """int64 (chunks,): the rank that holds each equal sequence chunk (P chunks contiguous, 2P zig-zag)."""
    if num_ranks < 1:
        raise ValueError(f"chunk_owner: num_ranks must be >= 1, got {num_ranks}")
    if assignment == "contiguous":
        return torch.arange(num_ranks)
    if assignment == "zigzag":
        c = torch.arange(2 * num_ranks)
        return torch.where(c < num_ranks, c, 2 * num_ranks - 1 - c)
    raise ValueError(f"chunk_owner: assignment must be one of {ASSIGNMENTS}, got {assignment!r}")


def _listed_tiles(plan: BlockPlan, num_keys: int):
    """(query block, physical keys) of every listed tile of batch 0, all heads: int64 (M,), (M, block_n) with -1
    for padding keys."""
    if plan.query_index is not None:
        # a query block would then hold rows of several shards; no selector used here permutes queries
        raise ValueError("rank_key_needs: plans with query_index (permuted queries) are not supported")
    offsets, counts = plan.tile_offsets[0].long(), plan.tile_counts[0].long()  # (H, nqb, T), (H, nqb)
    heads, nqb, width = offsets.shape
    listed = torch.arange(width)[None, None, :] < counts[..., None]
    h, qb, t = listed.nonzero(as_tuple=True)
    logical = offsets[h, qb, t][:, None] + torch.arange(plan.block_n)[None, :]  # (M, block_n)
    if plan.key_index is None:
        phys = torch.where(logical < num_keys, logical, -1)
    else:
        index = plan.key_index[0].long()  # (Hk, Lk)
        kh = h * index.shape[0] // heads  # a GQA group's query heads share their KV head's order
        inside = logical < index.shape[1]
        phys = torch.where(inside, index[kh[:, None], logical.clamp(max=index.shape[1] - 1)], -1)
        phys = torch.where(phys < num_keys, phys, -1)
    return qb, phys


def rank_key_needs(plan: BlockPlan, num_keys: int, num_ranks: int, assignment: str):
    """What each rank needs under ``assignment`` (queries = keys = ``num_keys`` positions, causal, batch 0).

    Returns (need (R, N) bool: key positions some listed tile of the rank's query blocks reads, tiles (R,) int64:
    listed tiles whose query block the rank holds, owner (N,) int64: the rank holding each key, chunk (N,) int64:
    each position's chunk). Every head of the plan is one rank's (its head group in a Ulysses x ring hybrid)."""
    owners = chunk_owner(num_ranks, assignment)
    chunks = owners.numel()
    if num_keys % chunks or (num_keys // chunks) % plan.block_m:
        raise ValueError(f"rank_key_needs: num_keys={num_keys} must split into {chunks} chunks that are multiples "
                         f"of block_m={plan.block_m}")
    size = num_keys // chunks
    chunk = torch.arange(num_keys) // size
    owner = owners[chunk]
    qb, phys = _listed_tiles(plan, num_keys)
    q_rank = owner[qb * plan.block_m]
    need = torch.zeros(num_ranks, num_keys + 1, dtype=torch.bool)  # column N collects padding
    rows = q_rank[:, None].expand_as(phys)
    need[rows.reshape(-1), torch.where(phys < 0, num_keys, phys).reshape(-1)] = True
    tiles = torch.bincount(q_rank, minlength=num_ranks)
    return need[:, :num_keys], tiles, owner, chunk


def shard_metrics(plan: BlockPlan, num_keys: int, num_ranks: int, assignment: str) -> dict:
    """The four ``METRICS`` of one plan (module docstring) for ``num_ranks`` ranks."""
    need, tiles, owner, chunk = rank_key_needs(plan, num_keys, num_ranks, assignment)
    ranks = torch.arange(num_ranks)
    chunks = int(chunk.max()) + 1
    size = num_keys // chunks
    remote = owner[None, :] != ranks[:, None]  # (R, N)
    # causal pair (r, s): some query of r may see some key of s (r's last query is not before s's first key)
    last_q = torch.full((num_ranks,), -1, dtype=torch.long).scatter_reduce(
        0, owner, torch.arange(num_keys), reduce="amax")
    first_k = torch.full((num_ranks,), num_keys, dtype=torch.long).scatter_reduce(
        0, owner, torch.arange(num_keys), reduce="amin")
    causal = (first_k[None, :] <= last_q[:, None]) & (ranks[None, :] != ranks[:, None])  # (r, s)
    pair_need = torch.zeros(num_ranks, num_ranks, dtype=torch.bool)
    r_idx, k_idx = need.nonzero(as_tuple=True)
    pair_need[r_idx, owner[k_idx]] = True
    pairs = int(causal.sum())
    chunk_need = need.reshape(num_ranks, chunks, size).any(-1) & remote.reshape(num_ranks, chunks, size)[..., 0]
    dense_bytes = (num_ranks - 1) * (num_keys // num_ranks)  # key positions the straggler receives in dense ring
    shard_recv = chunk_need.sum(-1) * size
    keys_recv = (need & remote).sum(-1)
    return {
        "remote_pairs_needed": float((pair_need & causal).sum()) / pairs if pairs else float("nan"),
        "recv_shard_frac_max": float(shard_recv.max()) / dense_bytes if dense_bytes else float("nan"),
        "recv_keys_frac_max": float(keys_recv.max()) / dense_bytes if dense_bytes else float("nan"),
        "compute_imbalance": float(tiles.max()) / float(tiles.float().mean()),
    }


# --- the analytic cost model --------------------------------------------------------------------------------------
# Llama-3.1-8B shape and the measurements the model starts from (4x H200, Ulysses, 1M tokens, PBS at density ~0.1)
SHAPE = dict(layers=32, kv_heads=8, head_dim=128, bytes_per_value=2)
MEASURED = dict(gpus=4, tokens=1 << 20, density=0.1, attention_s=14.0, non_attention_s=6.75)
LINKS_GBPS = {"nvlink": 330.0, "ib_400g": 50.0}  # NVLink: low end of measured all-reduce bus bandwidth


def cost_model(total_gpus: int, density: float, skip_frac: float = 1.0, tokens: int = 1 << 20,
               ulysses: int = 8) -> dict:
    """Per rank and layer: ring communication against sparse attention compute for the 8B shape.

    Ulysses ``ulysses`` x ring R = total_gpus / ulysses; a rank holds one KV head (8 KV heads / 8) of N/R positions
    and receives R - 1 shards of that head per layer (K and V, bf16). Attention time scales from the measurement:
    linear in density and in 1/GPUs (the work splits evenly; zig-zag keeps it even). ``skip_frac``: the share of
    the dense ring bytes still sent after shard skipping (1.0: none skipped)."""
    ring = total_gpus // ulysses
    heads_per_rank = SHAPE["kv_heads"] // ulysses
    bytes_per_pos = heads_per_rank * SHAPE["head_dim"] * 2 * SHAPE["bytes_per_value"]  # K and V
    step_bytes = tokens // ring * bytes_per_pos
    attn_layer = (MEASURED["attention_s"] * (density / MEASURED["density"]) * (tokens / MEASURED["tokens"]) ** 2
                  * MEASURED["gpus"] / total_gpus / SHAPE["layers"])
    out = {"total_gpus": total_gpus, "ulysses": ulysses, "ring": ring, "density": density, "tokens": tokens,
           "kv_bytes_per_layer_all_heads": tokens * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2 * SHAPE["bytes_per_value"],
           "ring_step_bytes": step_bytes, "ring_step_bytes_sent": step_bytes * skip_frac,
           "skip_frac": skip_frac, "ring_bytes_per_layer": step_bytes * (ring - 1) * skip_frac,
           "attention_ms_per_layer": attn_layer * 1e3, "attention_ms_per_step": attn_layer / ring * 1e3}
    for link, gbps in LINKS_GBPS.items():
        comm_step = step_bytes * skip_frac / (gbps * 1e9)
        out[f"{link}_ms_per_step"] = comm_step * 1e3
        out[f"{link}_comm_over_compute"] = comm_step / (attn_layer / ring)
        out[f"{link}_hidden"] = comm_step < attn_layer / ring
        # density below which a step's transfer outlasts its compute
        out[f"{link}_breakeven_density"] = density * comm_step / (attn_layer / ring)
    return out


# --- plans from the trained model ---------------------------------------------------------------------------------
def pick_documents(lengths: list[int]) -> list[dict]:
    """One distinct document per length (longest first), see the module docstring for the order of preference."""
    manifest = json.loads(CHECKPOINT.with_suffix(".json").read_text())["manifest"]
    paths = sysconfig.get_paths()
    roots = {"stdlib": paths["stdlib"], "purelib": paths["purelib"], "platlib": paths["platlib"]}
    exact, changed = [], []
    for entry in manifest["heldout"]["long_files"]:
        root, rel = entry["path"].split("/", 1)
        data = lm_corpus._read(os.path.join(roots.get(root, "/nonexistent"), rel))
        if data is None:
            continue
        (exact if lm_corpus.sha1_hex(data) == entry["sha1"] else changed).append(
            {"path": entry["path"], "data": data, "source": "heldout (hash matches the manifest)" if
             lm_corpus.sha1_hex(data) == entry["sha1"] else "heldout path, different file version"})
    torch_dir = Path(torch.__file__).parent
    fallback = [{"path": f"torch/{p.relative_to(torch_dir)}", "data": p.read_bytes(), "source": "torch source"}
                for p in sorted(torch_dir.rglob("*.py"))[:2000] if p.stat().st_size >= max(lengths)]
    used, out = set(), []
    for length in sorted(lengths, reverse=True):
        doc = next((d for d in exact + changed + fallback if len(d["data"]) >= length and d["path"] not in used), None)
        if doc is None:
            raise ValueError(f"no document of >= {length} bytes found")
        used.add(doc["path"])
        out.append({"length": length, "path": doc["path"], "source": doc["source"],
                    "tokens": torch.frombuffer(bytearray(doc["data"][:length]), dtype=torch.uint8).long()[None]})
    return out


def capture_layers(model, tokens: torch.Tensor, layers: list[int]) -> list[dict]:
    captured: list = []
    with torch.no_grad(), capture_attention_inputs(captured):
        model(tokens)
    return [captured[i] for i in layers]


def mean_density(plans: list[BlockPlan], n: int) -> float:
    return sum(float(p.density(n, n).mean()) for p in plans) / len(plans)


def pbs_at_density(caps: list[dict], n: int, target: float, tolerance: float, log,
                   iterations: int = 10) -> tuple[float, list]:
    """PBS plans with the threshold bisected (density rises with the threshold) to ``target`` mean density."""
    def plans_at(threshold):
        cfg = SparseConfig.from_options({"method": "pbs", "pbs": {"threshold": threshold}})
        return [build_plan(c["q"], c["k"], c["scale"], cfg) for c in caps]

    lo, hi, best, previous = 0.0, 1.0, None, None
    for _ in range(iterations):
        mid = (lo + hi) / 2
        plans = plans_at(mid)
        d = mean_density(plans, n)
        log(f"    pbs threshold {mid:.5f}: density {d:.4f}")
        if best is None or abs(d - target) < abs(best[2] - target):
            best = (mid, plans, d)
        if abs(d - target) <= tolerance:
            break
        if d > target and previous is not None and abs(d - previous) < 1e-4:
            break  # a lower threshold keeps the same tiles: the floor (diagonal segments, sink) is above the target
        previous = d
        lo, hi = (mid, hi) if d < target else (lo, mid)
    return best[0], best[1]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def markdown_table(rows: list[dict], shards: list[int]) -> str:
    keyed = {(r["method"], r["length"], r["assignment"], r["metric"], r["P"]): r["value"] for r in rows}
    combos = sorted({(r["method"], r["length"], r["assignment"], r["metric"]) for r in rows},
                    key=lambda c: (METRICS.index(c[3]), c[0], c[1], ASSIGNMENTS.index(c[2])))
    lines = ["| metric | method | length | assignment | " + " | ".join(f"P={p}" for p in shards) + " |",
             "|---|---|---|---|" + "---|" * len(shards)]
    for m, n, a, metric in combos:
        vals = [keyed.get((m, n, a, metric, p)) for p in shards]
        lines.append(f"| {metric} | {m} | {n} | {a} | " + " | ".join("" if v is None else f"{v:.3f}" for v in vals)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices (default: all)")
    ap.add_argument("--target-density", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "ring_sparse_sim.json")
    ap.add_argument("--smoke", action="store_true", help="2K tokens, layer 0, P in 2 4 8: seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.shards, args.layers = [2048], [2, 4, 8], [0]
    for p in args.shards:
        if p < 2:
            raise ValueError(f"--shards: every shard count must be >= 2, got {p}")
    torch.set_num_threads(1)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    model, ckpt = tsl.load_checkpoint(CHECKPOINT)
    n_layers = ckpt["model_args"]["n_layers"]
    layers = list(range(n_layers)) if args.layers is None else args.layers
    docs = pick_documents(args.lengths)
    rows, plans_meta = [], []
    for doc in sorted(docs, key=lambda d: d["length"]):
        n = doc["length"]
        log(f"L={n}: {doc['path']} ({doc['source']})")
        caps = capture_layers(model, doc["tokens"], layers)
        log(f"  captured {len(caps)} layers, q {tuple(caps[0]['q'].shape)} k {tuple(caps[0]['k'].shape)}")
        q0 = caps[0]["q"]
        methods = {"dense": ({}, [causal_plan(1, q0.shape[1], n, n) for _ in caps])}
        sampled_cfg = SparseConfig.from_options({"method": "sampled", "sampled": {"budget": 0.1}})
        methods["sampled"] = ({"budget": 0.1}, [build_plan(c["q"], c["k"], c["scale"], sampled_cfg) for c in caps])
        log("  sampled plans built")
        threshold, pbs_plans = pbs_at_density(caps, n, args.target_density, 0.01, log, 3 if args.smoke else 10)
        methods["pbs"] = ({"threshold": threshold}, pbs_plans)
        for name, (params, plans) in methods.items():
            dens = [float(p.density(n, n).mean()) for p in plans]
            plans_meta.append({"method": name, "length": n, "params": params, "density_per_layer": dens,
                               "density": sum(dens) / len(dens)})
            for shards in args.shards:
                for assignment in ASSIGNMENTS:
                    if n % (2 * shards) or (n // (2 * shards)) % plans[0].block_m:
                        log(f"  skip P={shards}: {n} positions do not split into 2P chunks of whole blocks")
                        continue
                    per_layer = [shard_metrics(p, n, shards, assignment) for p in plans]
                    for metric in METRICS:
                        vals = [m[metric] for m in per_layer]
                        rows.append({"method": name, "length": n, "P": shards, "assignment": assignment,
                                     "metric": metric, "value": sum(vals) / len(vals), "per_layer": vals})
            log(f"  {name}: density {sum(dens) / len(dens):.4f}, metrics done")

    # shard skipping at 1M is estimated by the 16K simulation's straggler share at the ring degree (2 or 4)
    def skip_share(method, ring):
        vals = [r["value"] for r in rows if r["method"] == method and r["length"] == max(args.lengths)
                and r["P"] == ring and r["assignment"] == "zigzag" and r["metric"] == "recv_shard_frac_max"]
        return vals[0] if vals else 1.0

    costs = []
    for gpus in (16, 32):
        for density in (0.1, 0.05):
            costs.append(dict(cost_model(gpus, density), skipping=False))
            costs.append(dict(cost_model(gpus, density, skip_share("pbs", gpus // 8)), skipping=True))
    result = {
        "description": "ring/context parallelism with sparse plans: shard skipping, received bytes and compute "
                       "balance, simulated on plans of the small trained LM (benchmarks/sim_ring_sparse.py)",
        "command": "python benchmarks/research/sim_ring_sparse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "checkpoint": str(CHECKPOINT.relative_to(HERE.parent)), "layers": layers,
        "documents": [{"length": d["length"], "path": d["path"], "source": d["source"]} for d in docs],
        "plans": plans_meta, "rows": rows,
        "cost_model": {"assumptions": {"shape": SHAPE, "measured": MEASURED, "links_GBps": LINKS_GBPS},
                       "cases": costs},
        "seconds": round(time.time() - t0, 1), "cpu_seconds": round(time.process_time(), 1),
    }
    result["metrics"] = {
        "remote_pairs_needed": "share of causal (rank, remote rank) pairs whose KV some query block selects",
        "recv_shard_frac_max": "KV bytes received skipping unneeded chunks whole / dense ring, max over ranks",
        "recv_keys_frac_max": "KV bytes if only selected keys are fetched / dense ring, max over ranks",
        "compute_imbalance": "selected tiles per rank, max / mean",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(markdown_table(rows, args.shards))
    print()
    for m in plans_meta:
        print(f"- {m['method']} at {m['length']}: density {m['density']:.3f} {m['params']}")
    print()
    print("| GPUs (Ulysses x ring) | density | shard skipping | ring MB/step | attention ms/step | NVLink ms/step "
          "| IB 400G ms/step | hidden (NVLink / IB) | break-even density (NVLink / IB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in costs:
        print(f"| {c['total_gpus']} (8x{c['ring']}) | {c['density']} | {'yes' if c['skipping'] else 'no'} | "
              f"{c['ring_step_bytes_sent'] / 1e6:.0f} | "
              f"{c['attention_ms_per_step']:.1f} | {c['nvlink_ms_per_step']:.2f} | {c['ib_400g_ms_per_step']:.2f} | "
              f"{c['nvlink_hidden']} / {c['ib_400g_hidden']} | {c['nvlink_breakeven_density']:.4f} / "
              f"{c['ib_400g_breakeven_density']:.4f} |")
    log(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
