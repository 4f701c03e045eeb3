"""Retrieval accuracy per method, through the compiled backend, on a model that retrieves (RULER-style).

    python benchmarks/bench_retrieval.py                      # GPU: 16K, 32K, 64K; every method; ~6 min
    python benchmarks/bench_retrieval.py --lengths 16384 --densities 0.1
    python benchmarks/bench_retrieval.py --smoke              # CPU: an untrained tiny model, seconds
    python benchmarks/bench_retrieval.py --families --natural 4 --densities 0.05 0.1 0.2 --dense-lengths 131072
    python benchmarks/bench_retrieval.py --smoke --checkpoint benchmarks/checkpoints/retrieval_lm.pt --families \
        --natural 1 --per-task 0 --methods sampled --densities --calibrate-errors  # CPU: the trained model, 2K

The model is ``checkpoints/retrieval_lm.pt`` (``train_small_lm.py --retrieval``: byte level, head dim 128, GQA 4:1,
RoPE), compiled whole with ``backend="sparse_prefill"`` as a user would. Instances (``retrieval_tasks.py``) plant
needles in held-out code and end with queries; a value is retrieved when the teacher-forced argmax reproduces all
its bytes. Contenders, all in the one compiled model and switched by ``sparsity(...)`` regions:

* ``dense``: sparsity off (cuDNN / the SDPA the op falls back to);
* ``<method>``: each method at its defaults, forced to run its plan (``dense_when_faster=False``: the question here
  is what the selector keeps, not whether dispatch would have run dense);
* ``<method>@ρ``: the method's density knob calibrated so that its plans keep about ρ of the causal tiles, on
  average over the layers of the first instance (where the knob can reach it: S2O's intra-segment windows alone
  are S/N of the tiles);
* ``pbs-noperm`` (and ``@ρ``): PBS's selector without its permutation;
* ``<method>-calibrated@e`` (``--calibrate-errors``): ``sparse_compile.calibrate`` on the first instance, one knob
  per layer keeping that layer's relative L1 error under ``e``; next to it ``<method>-global@e``, one knob for
  every layer set to the same mean density (the question: does per-layer calibration buy accuracy?).

Per contender and length: accuracy per task and per needle-depth bin, the achieved density, the difference in
bits per byte on held-out code windows against dense, and for every missed value whether the needle's key tile
was listed for the query block that reads it: as a share of layers x heads, and for the lookup head, the one whose
attention row puts the most mass on the needle, the byte it reads; and over every row that predicts a byte of the
value, the share whose reading head's plan lists the byte it reads (for S2O a listed tile may still be cut by early
stop). Rows: ``results/bench_retrieval.jsonl``; the run's table and plot: ``--out`` (default ``results/runs/``).

Beyond the task styles the model trained on (``--per-task 0`` leaves them out):

* ``--families``: ``retrieval_families.py`` instances (12 keys with near-miss distractors, 3 queries, per prompt
  from 16K); ``family_train`` pools the training families, ``family_heldout`` the held-out ones (formats that no
  training window carried), ``family.<name>`` each family; ``family_missed_*`` the coverage of missed values, the
  held-out families' first. Plots ``<name>_family_train.png`` and ``<name>_family_heldout.png``.
* ``--natural W``: W held-out code windows per length; on the bytes whose 16-byte n-gram last occurred 4K-16K /
  16K+ bytes back (``retrieval_families.natural_positions``: no template), the argmax accuracy
  (``natural_acc.<bucket>``) and bits per byte (``natural_bpb.<bucket>``), ``natural_count.<bucket>`` bytes.
* ``--dense-lengths 131072``: lengths scored dense only (how far the model extrapolates).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from sparse_compile.pipeline import capturing  # noqa: E402
import retrieval_families as rf  # noqa: E402
import retrieval_tasks as rt  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from density_calibration import calibrate, method_spec, split_spec  # noqa: E402
from harness import RUNS_DIR, format_table, read_store, write_results  # noqa: E402

# bisection steps of a density knob: on a model with concentrated attention, mass thresholds must come within 1e-4
# of 1 (and S2O's early stop within 1e-5 of 0) before ρ 0.2-0.3 is kept; 10 steps end at 0.999 / 0.0005
KNOB_STEPS = 20

DEFAULT_CHECKPOINT = tsl.DEFAULT_CHECKPOINT.with_name("retrieval_lm.pt")
METHODS = tuple(sparse_compile.registry.registered_methods())  # the four papers' and the sampled selector
NEEDLE_BYTES = 50  # a needle line's span checked for coverage: the key and the value


def base_config(smoke: bool) -> sparse_compile.SparseConfig:
    if not smoke:
        return sparse_compile.SparseConfig(min_seq_len=4096, dense_when_faster=False)
    return sparse_compile.SparseConfig(
        min_seq_len=256, dense_when_faster=False, pbs={"block_size": 32, "segment_size": 64},
        sparge={"block_size_q": 32, "block_size_kv": 32},
        bfla={"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32},
        s2o={"segment_size": 64, "block_size_q": 32, "block_size_kv": 32},
        sampled={"block_size": 32, "sample_every": 4})


def method_and_reorder(contender: str) -> tuple[str, Optional[str]]:
    """The registered method of a contender's base name and its reorder override (``pbs-noperm``: PBS, none)."""
    return ("pbs", "none") if contender == "pbs-noperm" else (contender, None)


def keep_all_params(method: str) -> dict:
    """The method's parameters that keep every tile (exact attention through the same path)."""
    return dict(sparse_compile.registry.registered_methods()[method].keep_all)


def contender_region(name: str, params: dict) -> dict:
    """``sparsity(...)`` keywords of a contender (a calibrated one carries its whole region in ``params``)."""
    if name == "dense":
        return {"enabled": False}
    if "-calibrated@" in name:
        return dict(params)
    # "pbs@0.1/layer2" too: params carry its site_params; "sampled:mass_target=0.97": its fields
    method, reorder = method_and_reorder(name.split("@")[0].removesuffix("-global").partition(":")[0])
    return {"method": method, **({"reorder": reorder} if reorder else {}), **params}


def capture_qk(compiled, tokens, sites: Optional[list] = None) -> list:
    """(q, k) of every attention call of a dense run (the calibration input); the calls' site names are appended
    to ``sites`` when given."""
    calls = []

    def keep(site, q, k, v, scale, chunked):
        calls.append((q.detach().clone(), k.detach().clone()))
        if sites is not None:
            sites.append(site)

    with torch.no_grad(), sparse_compile.sparsity(enabled=False), capturing(keep):
        compiled(tokens)
    return calls


def per_layer_params(method: str, densities: list, layers: list, sites: list, base, reorder=None) -> dict:
    """``site_params`` that give each attention site its own density: the knob calibrated on that site's captured
    (q, k) alone; a density of 1 keeps every tile. ``layers`` and ``sites``: one entry per site, in call order."""
    if len(densities) != len(sites):
        raise ValueError(f"--layer-densities: {len(densities)} densities for {len(sites)} attention sites")
    keep_all = keep_all_params(method)
    site_params = {}
    for site, qk, rho in zip(sites, layers, densities):
        site_params[site] = (keep_all if rho >= 1 else
                             calibrate(method, rho, [qk], base, reorder=reorder, steps=KNOB_STEPS)[0])
    return {"site_params": site_params}


def one_layer_sparse(method: str, params: dict, sites: list, layer: int) -> dict:
    """``params`` with every site but ``sites[layer]`` set to the method's keep-all parameters (exact attention
    through the same path), so that only that layer runs the contender's selection."""
    keep_all = keep_all_params(method)
    return {**params, "site_params": {site: keep_all for i, site in enumerate(sites) if i != layer}}


def listed_keys(plan, head: int, row: int) -> torch.Tensor:
    """The physical keys that ``plan`` (batch 0, its head ``head``) lists for the query block holding query ``row``;
    padding entries of a permuted key list (past its end or negative) are left out."""
    heads = plan.tile_offsets.shape[1]
    logical = row
    if plan.query_index is not None:
        order = plan.query_index[0, head * plan.query_index.shape[1] // heads].long()
        logical = int((order == row).nonzero()[0, 0])
    block = logical // plan.block_m
    count = int(plan.tile_counts[0, head, block])
    offsets = plan.tile_offsets[0, head, block, :count].long()
    keys = (offsets[:, None] + torch.arange(plan.block_n, device=offsets.device)).flatten()
    if plan.key_index is not None:
        index = plan.key_index[0, head * plan.key_index.shape[1] // heads].long()
        keys = index[keys[keys < index.numel()]]
    return keys[keys >= 0]


def needle_coverage(compiled, base, instance, answer, region: dict) -> tuple[float, bool, float]:
    """For the query block that predicts ``answer``'s first byte: (the share of (layer, head) plans that list a tile
    holding a byte of its needle, whether the plan of the lookup head lists the needle byte that head reads, and
    the same check over every row that predicts a byte of the value: the share of those rows whose reading head's
    plan lists the needle byte it reads). A row's reading head is the (layer, query head) whose attention row puts
    the most mass on the needle, and the byte it reads is that row's most attended needle byte: on the retrieval
    model one head does the lookup and the others barely look there, so the share alone can read 0.94 while the
    one plan that matters drops the byte (a permuted tile can hold other needle bytes without it). Later bytes are
    copied from later needle positions, which a permuted tile may hold or not. Plans and masses are rebuilt from
    the attention inputs of this run."""
    from sparse_compile.context import resolve
    from sparse_compile.methods import build_plan

    inputs = []

    def keep(site, q, k, v, scale, chunked):
        inputs.append((q.detach(), k.detach(), scale))

    tokens = instance.tokens[None].to(next(compiled.parameters()).device).long()
    with torch.no_grad(), sparse_compile.sparsity(**region), capturing(keep):
        compiled(tokens)
        config = resolve(base)
    row = answer.start - 1
    rows = list(range(answer.start - 1, answer.end - 1))  # each predicts the next byte of the value
    needle = torch.arange(answer.needle_start, answer.needle_start + NEEDLE_BYTES)
    hits, total = 0, 0
    reading = [(-1.0, False)] * len(rows)  # per row: (the reading head's needle mass, its byte listed)
    for q, k, scale in inputs:
        plan = build_plan(q, k, scale, config)
        heads_q, plan_heads = q.shape[1], plan.tile_offsets.shape[1]
        listed = [listed_keys(plan, h, row) for h in range(plan_heads)]
        hits += sum(bool(torch.isin(needle.to(keys.device), keys).any()) for keys in listed)
        total += plan_heads
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        r = torch.tensor(rows, device=q.device)
        for h in range(heads_q):
            kv = k[0, h * k.shape[1] // heads_q, : rows[-1] + 1].float()
            logits = q[0, h, r].float() @ kv.T * scale
            logits = logits.masked_fill(torch.arange(kv.shape[0], device=kv.device)[None, :] > r[:, None],
                                        float("-inf"))
            on_needle = torch.softmax(logits, dim=-1)[:, needle.to(kv.device)]  # (rows, needle bytes)
            mass, read = on_needle.sum(-1).tolist(), needle[on_needle.argmax(-1).cpu()].tolist()
            for i, row_i in enumerate(rows):
                if mass[i] > reading[i][0]:
                    keys = listed_keys(plan, h * plan_heads // heads_q, row_i)
                    reading[i] = (mass[i], bool((keys == read[i]).any()))
    return hits / max(total, 1), reading[0][1], sum(ok for _, ok in reading) / len(reading)


def bits_per_byte(compiled, windows, region: dict) -> float:
    total, count = 0.0, 0
    with torch.no_grad(), sparse_compile.sparsity(**region):
        for window in windows:
            logits = compiled(window[None, :-1])
            total += float(F.cross_entropy(logits[0].float(), window[1:], reduction="sum"))
            count += window.numel() - 1
    return total / count / math.log(2)


def share(results: list, field: str) -> Optional[float]:
    """The mean of ``field`` over ``results`` (None when there are none)."""
    return sum(r[field] for r in results) / len(results) if results else None


def family_row(results: list) -> dict:
    """A contender's family scores: pooled over the training and over the held-out families (reported apart: the
    held-out ones measure retrieval in formats the model never trained on), and per family."""
    row = {}
    for split in ("train", "heldout"):
        mine = [r for r in results if r["style"] == split]
        row[f"family_{split}"] = share(mine, "exact")
        row[f"family_{split}_values"] = len(mine)
    for name in rf.FAMILIES:
        mine = [r for r in results if r["task"] == name]
        if mine:
            row[f"family.{name}"] = share(mine, "exact")
    return row


def natural_windows(stream: bytes, length: int, count: int, rng: random.Random, ngram: int,
                    distances) -> list:
    """``count`` random windows of held-out code, each with its natural-measure positions per distance bucket
    (``retrieval_families.natural_positions``)."""
    out = []
    for _ in range(count):
        start = rng.randrange(0, len(stream) - length - 1)
        data = stream[start:start + length]
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        out.append((tokens, rf.natural_positions(data, ngram, distances)))
    return out


def run(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke and args.checkpoint is None:
        mod = tsl.load_model_module()
        torch.manual_seed(0)
        model = mod.Transformer(mod.ModelArgs(**tsl.RETRIEVAL_SMOKE_MODEL, max_seq_len=4096)).to(device).eval()
        manifest = None
    else:
        args.checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
        model, ckpt = tsl.load_checkpoint(args.checkpoint, device=device, dtype=dtype)
        manifest = json.loads(Path(args.checkpoint).with_suffix(".json").read_text())["manifest"]
    corpus = tsl.build_corpus(1 << 20)
    if manifest is not None and corpus.manifest["heldout"]["bytes"] != manifest["heldout"]["bytes"]:
        print("warning: the local held-out corpus differs from the one the checkpoint was trained next to",
              file=sys.stderr)
    base = base_config(args.smoke)
    base = base.replace(**{m: base.params_of(m).updated(v) for m, v in args.method_params.items()})
    options = {"min_seq_len": base.min_seq_len, "dense_when_faster": base.dense_when_faster,
               **{m: base.params_of(m) for m in METHODS}}
    compiled = torch.compile(model, backend=functools.partial(sparse_compile.sparse_prefill, options=options),
                             dynamic=True)

    rows = []
    for length in list(args.lengths) + list(args.dense_lengths):
        dense_only = length in args.dense_lengths and length not in args.lengths
        rng = random.Random(7_777_777 + length)
        instances = [inst for style in args.styles for task in rt.TASKS
                     for inst in rt.make_batch([task] * args.per_task, corpus.heldout, length, rng, style)]
        windows = []
        for _ in range(args.bpb_windows):
            start = rng.randrange(0, len(corpus.heldout) - length - 2)
            windows.append(torch.frombuffer(bytearray(corpus.heldout[start:start + length + 1]),
                                            dtype=torch.uint8).to(device).long())
        # families and natural windows draw from their own seeds: adding them leaves the style instances as they were
        family_rng = random.Random(5_555_555 + length)
        family_instances = [inst for name in args.families
                            for inst in rf.make_batch([name] * args.per_family, corpus.heldout, length, family_rng)]
        natural = natural_windows(corpus.heldout, length, args.natural, random.Random(3_333_333 + length),
                                  args.natural_ngram, args.natural_distances)
        natural = [(tokens.to(device), positions) for tokens, positions in natural]
        first = (instances or family_instances or [w for w, _ in natural] or [None])[0]
        if first is None:
            raise SystemExit("nothing to score: --per-task 0 without --families or --natural")
        first = (first.tokens if isinstance(first, rt.Instance) else first)[None].to(device).long()
        sites: list = []
        layers = [] if dense_only else capture_qk(compiled, first, sites)  # calibration input
        contenders = [("dense", {})] + ([] if dense_only else [(spec, split_spec(spec)[1]) for spec in args.methods])
        if "pbs" in args.methods and not dense_only:
            contenders.append(("pbs-noperm", {}))
        plain = [m for m in args.methods if not split_spec(m)[1]]  # the density knobs are fitted at the defaults
        for rho in [] if dense_only else args.densities:
            for m in plain + (["pbs-noperm"] if "pbs" in plain else []):
                method, reorder = method_and_reorder(m)
                params, _ = calibrate(method, rho, layers, base, reorder=reorder, steps=KNOB_STEPS)
                contenders.append((f"{m}@{rho}", params))
                if m in args.layer_ablation:  # the same threshold in one layer at a time, the others exact
                    contenders += [(f"{m}@{rho}/layer{i}", one_layer_sparse(method, params, sites, i))
                                   for i in range(len(sites))]
        for spec in [] if dense_only else args.layer_densities:
            densities = [float(x) for x in spec.split(",")]
            for m in args.layer_ablation or ["pbs"]:
                method, reorder = method_and_reorder(m)
                contenders.append((f"{m}@layers[{spec}]", per_layer_params(
                    method, densities, layers, sites, base, reorder=reorder)))
        for error in [] if dense_only else args.calibrate_errors:
            method = args.calibrate_method
            calibration = sparse_compile.calibrate(compiled, first, method=method, target_error=error,
                                                   config=base.with_overrides(method))
            contenders.append((f"{method}-calibrated@{error}", calibration.sparsity_options()))
            params, _ = calibrate(method, calibration.density, layers, base)
            contenders.append((f"{method}-global@{error}", params))
            print(f"calibrated {method} at error {error}: mean density {calibration.density:.3f}; per layer "
                  + ", ".join(f"{site.density:.2f}" for site in calibration.sites), flush=True)
        dense_bpb = None
        for name, params in contenders:
            region = contender_region(name, params)
            started = time.perf_counter()
            results, family_results = [], []
            for inst in instances + family_instances:
                with torch.no_grad(), sparse_compile.sparsity(**region):
                    logits = compiled(inst.tokens[None].to(device).long())[0]
                for result, answer in zip(rt.score(logits.float(), inst), inst.answers):
                    result["answer"], result["instance"], result["style"] = answer, inst, inst.style
                    (results if inst.task in rt.TASKS else family_results).append(result)
            natural_sums = {}
            for tokens, positions in natural:
                with torch.no_grad(), sparse_compile.sparsity(**region):
                    logits = compiled(tokens[None])[0]
                for bucket, sums in rf.score_natural(logits, tokens, positions).items():
                    total = natural_sums.setdefault(bucket, {"count": 0, "hits": 0, "bits": 0.0})
                    for key in total:
                        total[key] += sums[key]
            # achieved density: one recorded run (recording costs syncs: not part of the timing above)
            sparse_compile.reset_runtime_stats()
            density = None
            if name != "dense":
                with torch.no_grad(), sparse_compile.sparsity(record_density=True, **region):
                    compiled(first)
                values = [s.mean_density for s in sparse_compile.runtime_stats().values()
                          if s.mean_density is not None]
                density = sum(values) / len(values) if values else None
            bpb = bits_per_byte(compiled, windows, region) if windows else None
            if name == "dense":
                dense_bpb = bpb
            shown = {k: v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "site_params" in params and "/layer" not in name and "@layers[" not in name:
                shown = {f"{site}.{k}": v for site, values in params["site_params"].items() for k, v in values.items()}
            row = {"N": length, "contender": name, "density": density,
                   "params": ", ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                   "exact": share(results, "exact"), "chars": share(results, "chars"), "values": len(results),
                   "delta_bpb": None if bpb is None or dense_bpb is None else bpb - dense_bpb,
                   "seconds": round(time.perf_counter() - started, 1)}
            for task in rt.TASKS:
                row[task] = share([r for r in results if r["task"] == task], "exact")
            if family_results:
                row.update(family_row(family_results))
            for bucket, total in natural_sums.items():
                row[f"natural_count.{bucket}"] = total["count"]
                row[f"natural_acc.{bucket}"] = total["hits"] / total["count"] if total["count"] else None
                row[f"natural_bpb.{bucket}"] = total["bits"] / total["count"] if total["count"] else None
            if len(args.styles) > 1 and results:
                for style in args.styles:
                    row[f"style_{style}"] = share([r for r in results if r["style"] == style], "exact")
            row["by_depth"] = {}
            for lo, hi in zip(rt.DEPTH_BINS, rt.DEPTH_BINS[1:]):
                mine = [r for r in results if lo <= r["depth"] < hi]
                if mine:
                    row["by_depth"][f"{lo:.1f}-{min(hi, 1.0):.1f}"] = sum(r["exact"] for r in mine) / len(mine)
            for prefix, scored in (("missed", results), ("family_missed", family_results)):
                # held-out families first: where a method's misses matter most
                missed = sorted((r for r in scored if not r["exact"]), key=lambda r: r["style"] != "heldout")
                if name != "dense" and missed and args.coverage:
                    cover = [needle_coverage(compiled, base, r["instance"], r["answer"], region)
                             for r in missed[:args.coverage]]
                    row[f"{prefix}_needle_listed"] = sum(c[0] for c in cover) / len(cover)
                    row[f"{prefix}_lookup_head_listed"] = sum(c[1] for c in cover) / len(cover)
                    row[f"{prefix}_value_rows_listed"] = sum(c[2] for c in cover) / len(cover)
                    row[f"{prefix}_examined"] = len(cover)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def plot(rows: list, path: Path, metric: str = "exact", ylabel: str = "values retrieved exactly",
         ylim: Optional[tuple] = (-0.02, 1.02)) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lengths = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        mine = [r for r in rows if r["N"] == n]
        dense = [r.get(metric) for r in mine if r["contender"] == "dense" and r.get(metric) is not None]
        for m in METHODS + ("pbs-noperm",):
            pts = sorted((r["density"], r[metric]) for r in mine
                         if r["contender"].split("@")[0] == m and r["density"] is not None
                         and r.get(metric) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2, label=m)
        if dense:
            ax.axhline(dense[0], color="k", ls=":", lw=1, label="dense")
        ax.set_title(f"{n // 1024}K", fontsize=9)
        ax.set_xlabel("density (kept causal tiles)")
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    # the legend on the panel with the most curves (a dense-only length or a metric with no values has none)
    fullest = max(axes[0], key=lambda ax: len(ax.get_legend_handles_labels()[0]))
    if fullest.get_legend_handles_labels()[0]:
        fullest.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(commits: list, name: str) -> None:
    """``--report``: the format-family table and its plots from the store's rows of ``commits`` (the latest row per
    length, contender and metric wins), into ``results/<name>_*.png``."""
    wide: dict = {}
    for r in read_store("bench_retrieval"):
        if r.get("commit") in commits and "--families" in r.get("command", ""):
            key = (r["N"], r["contender"])
            row = wide.setdefault(key, {"N": r["N"], "contender": r["contender"], "params": r.get("params")})
            if r["date"] >= row.get("_date", {}).get(r["metric"], ""):
                row[r["metric"]] = r["value"]
                row.setdefault("_date", {})[r["metric"]] = r["date"]
    rows = sorted(wide.values(), key=lambda r: (r["N"], r["contender"] != "dense", r["contender"]))
    for r in rows:
        r.pop("_date", None)
    print(format_table(rows, ["N", "contender", "density", "family_train", "family_heldout", "natural_bpb.4K-16K",
                              "natural_bpb.16K+", "params"]))
    out = tsl.REPO / "benchmarks" / "results"
    plot(rows, out / f"{name}_family_heldout.png", "family_heldout", "held-out families: exact")
    plot(rows, out / f"{name}_natural.png", "natural_bpb.4K-16K", "natural bytes 4K-16K back: bits/byte", None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None,
                        help=f"the model (default {DEFAULT_CHECKPOINT.relative_to(tsl.REPO)}; --smoke: an untrained "
                             "tiny model unless this is given)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[16384, 32768, 65536])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), type=method_spec,
                        help="registered methods at their defaults, or name:field=value,... (e.g. "
                             "sampled:mass_target=0.97)")
    parser.add_argument("--densities", type=float, nargs="*", default=[0.05, 0.1, 0.2, 0.3])
    parser.add_argument("--per-task", type=int, default=8, help="instances per task, style and length")
    parser.add_argument("--styles", nargs="+", default=["vkey"], choices=list(rt.STYLES),
                        help="prompt styles (retrieval_tasks.STYLES); the first results used vkey")
    parser.add_argument("--bpb-windows", type=int, default=2, help="held-out code windows per length for bits/byte")
    parser.add_argument("--coverage", type=int, default=4, help="missed values examined per contender (0: none)")
    parser.add_argument("--calibrate-errors", type=float, nargs="*", default=[0.05, 0.1],
                        help="per-layer calibration targets (relative L1), each beside a global knob at its density")
    parser.add_argument("--calibrate-method", default="pbs", choices=METHODS)
    parser.add_argument("--layer-ablation", nargs="*", default=[], metavar="CONTENDER",
                        help="for these fixed-density contenders (pbs, pbs-noperm, sparge, ...), also run their "
                             "threshold in one layer at a time, the other layers exact")
    parser.add_argument("--layer-densities", nargs="*", default=[], metavar="D0,D1,...",
                        help="per-layer densities (one per attention site, 1 = keep all), each calibrated on its "
                             "layer alone, for the --layer-ablation contenders (default pbs)")
    parser.add_argument("--method-params", type=json.loads, default={}, metavar="JSON",
                        help='overrides of the methods\' parameters for every contender, e.g. '
                             '\'{"pbs": {"block_size": 64}}\' (block granularity against retrieval)')
    parser.add_argument("--families", nargs="*", default=None, metavar="FAMILY",
                        help="score retrieval_families instances: family names, 'train', 'heldout' or 'all' (the "
                             "default when the option is given bare); training and held-out families are reported "
                             "apart (family_train, family_heldout) and per family (family.<name>)")
    parser.add_argument("--per-family", type=int, default=8, help="instances per family and length (3 queries each)")
    parser.add_argument("--natural", type=int, default=0, metavar="WINDOWS",
                        help="held-out code windows per length for the natural measure (accuracy and bits per "
                             "byte on bytes copyable only from far back; 0: none)")
    parser.add_argument("--natural-ngram", type=int, default=rf.NATURAL_NGRAM,
                        help="the natural measure's n-gram length (bytes)")
    parser.add_argument("--natural-distances", type=int, nargs="+", default=None, metavar="D",
                        help=f"its distance buckets' lower bounds (default {list(rf.NATURAL_DISTANCES)}; "
                             "--smoke: 256 1024)")
    parser.add_argument("--dense-lengths", type=int, nargs="*", default=[],
                        help="extra lengths scored dense only (how far the model extrapolates), e.g. 131072")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: an untrained tiny model (or --checkpoint's) at 1K (2K with --families or "
                             "--natural), seconds (minutes with a checkpoint); options given explicitly are kept")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="retrieval")
    parser.add_argument("--report", nargs="+", default=None, metavar="COMMIT",
                        help="only the table and plots of the format-family rows of these commits in the store")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.name)
    args.families = families_of(args.families)
    if args.smoke:
        smoke = {"lengths": [2048] if args.families or args.natural else [1024], "per_task": 1,
                 "densities": [0.3], "bpb_windows": 1, "per_family": 1,
                 "calibrate_errors": args.calibrate_errors[:1]}
        for field, value in smoke.items():  # only where the option was left at its default
            if getattr(args, field) == parser.get_default(field.replace("-", "_")):
                setattr(args, field, value)
        args.natural_distances = args.natural_distances or [256, 1024]
    args.natural_distances = args.natural_distances or list(rf.NATURAL_DISTANCES)
    rows = run(args)
    extra = [c for r in rows for c in r if c.startswith(("family_train", "family_heldout", "family.",
                                                         "natural_acc.", "natural_bpb."))
             and not c.endswith("_values")]
    columns = ["N", "contender", "density", "exact", "chars", *rt.TASKS, *dict.fromkeys(extra), "delta_bpb",
               "missed_needle_listed", "missed_lookup_head_listed", "missed_value_rows_listed",
               *(["family_missed_lookup_head_listed"] if args.families else []), "params"]
    print(write_results(args.name, rows, out_dir=args.out, columns=columns,
                        store=None if args.smoke and not args.out else "bench_retrieval",
                        params=("N",),
                        meta={"checkpoint": None if args.checkpoint is None else str(args.checkpoint), "per_task": args.per_task,
                              "families": args.families, "per_family": args.per_family,
                              "natural_windows": args.natural, "natural_ngram": args.natural_ngram,
                              "natural_distances": args.natural_distances}))
    out_dir = Path(args.out) if args.out else RUNS_DIR
    plot(rows, out_dir / f"{args.name}.png")
    if args.families:
        plot(rows, out_dir / f"{args.name}_family_train.png", "family_train", "training families: exact")
        plot(rows, out_dir / f"{args.name}_family_heldout.png", "family_heldout", "held-out families: exact")
    if args.natural:
        last = rf.bucket_name(args.natural_distances[-1], None)
        plot(rows, out_dir / f"{args.name}_natural.png", f"natural_acc.{last}", f"natural accuracy, {last} back")


def families_of(names: Optional[list]) -> list:
    """``--families``' names expanded ('train', 'heldout', 'all'; bare: all), in ``FAMILIES`` order."""
    if names is None:
        return []
    groups = {"train": [f.name for f in rf.TRAIN_FAMILIES], "heldout": [f.name for f in rf.HELDOUT_FAMILIES],
              "all": list(rf.FAMILIES)}
    wanted = set()
    for name in names or ["all"]:
        if name not in groups and name not in rf.FAMILIES:
            raise SystemExit(f"--families: unknown {name!r}; valid: {list(groups)} or {list(rf.FAMILIES)}")
        wanted.update(groups.get(name, [name]))
    return [name for name in rf.FAMILIES if name in wanted]


if __name__ == "__main__":
    main()
