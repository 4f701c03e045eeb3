"""Train a small causal byte-level LM on real text that every machine here has: Python source files.

    python benchmarks/train_small_lm.py --smoke --out-dir /tmp/lm          # CPU: tiny model, a few steps, seconds
    PYTHONPATH=. python benchmarks/train_small_lm.py --out-dir "$OUT"       # GPU: about 6 minutes of steps

Why this exists: no model weights or datasets can be downloaded here, yet sparse prefill is only worth measuring
on *real* attention patterns. Python source has long-range structure (imports, identifiers, repeated code,
docstrings that name functions defined far above), so a byte-level model trained on contexts of 4K-32K bytes
learns to look far back and copy (induction heads): the attention that sparse methods must not lose.

Data: the ``*.py`` files under ``sysconfig.get_paths()`` stdlib and site-packages (purelib/platlib), walked in
sorted order, 256 B to 1 MB each. Split by file: a file is held out iff the first 8 bytes of
sha1(relative path) mod 1000 < 30 (3 %); held-out files are never read for training, and training files whose
content equals a held-out file's are dropped (vendored copies). Training files are read in path-hash order up
to ``--max-train-bytes``. The device machine (Python 3.12, torch, transformers, jax, ...) has a different corpus
from this CPU machine, so the JSON records the manifest, including the long held-out files (path, size, sha1)
that ``quality.py`` and ``attention_map.py`` evaluate on: they re-read exactly those files and check the hashes.

Model: ``tests/models.py``'s Transformer (RoPE, GQA, SDPA causal attention) with head_dim 64 so that the
sparse kernels apply. Training: AdamW (``--retrieval``: Muon for the blocks' weight matrices), cosine LR with
warm-up, bf16 autocast, fixed seed, a length curriculum
(4K then 16K then 32K contexts, about the same tokens per step; ``--retrieval``: 4K, 16K, then steps that cycle
through 16K / 32K / 64K, so the model does not end on one length), and a step count calibrated from measured
step times so that the run fits a wall-clock budget. The checkpoint stores bf16 weights (a few MB).
``--retrieval --families``: the windows carry ``retrieval_families.py``'s training families instead of the
styles' tasks (checkpoint ``retrieval_families_lm.pt``), and the evaluation reports training and held-out
families apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # retrieval_tasks, when imported from elsewhere
DEFAULT_CHECKPOINT = REPO / "benchmarks" / "checkpoints" / "small_lm.pt"

# --- corpus -------------------------------------------------------------------------------------------------
ROOT_NAMES = ("stdlib", "purelib", "platlib")
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # nested package dirs are walked as their own root
MIN_FILE_BYTES = 256  # stubs and empty __init__.py teach nothing
MAX_FILE_BYTES = 1 << 20  # generated tables (unicode data, big test vectors) would dominate the byte count
HELDOUT_PER_MILLE = 30
LONG_DOC_BYTES = 8192  # held-out documents used for evaluation are at least this long
MANIFEST_LONG_FILES = 512  # how many long held-out files the manifest lists (more than any evaluation uses)
DOC_SEPARATOR = 0  # byte 0 never occurs in source text: it marks document boundaries in the training stream

SPLIT_RULE = (
    f"*.py files of sysconfig stdlib/purelib/platlib (dirs {sorted(EXCLUDED_DIRS)} skipped, symlinks skipped), "
    f"{MIN_FILE_BYTES} <= size <= {MAX_FILE_BYTES} bytes; relative path = '<root name>/<path under root>'; "
    f"held out iff int.from_bytes(sha1(relpath)[:8], 'big') % 1000 < {HELDOUT_PER_MILLE}; held-out files with "
    "identical content are kept once (first by path hash); training files whose content equals a held-out file "
    "are dropped, as are exact duplicates among training files; training files are read in path-hash order until "
    "max_train_bytes"
)


def load_model_module():
    """``tests/models.py`` (the small Transformer the tests and these benchmarks share) under a private module name."""
    name = "_sparse_compile_test_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def corpus_roots() -> list[tuple[str, str]]:
    """(name, directory) of each distinct source root of this interpreter."""
    paths = sysconfig.get_paths()
    seen, roots = set(), []
    for name in ROOT_NAMES:
        path = paths.get(name)
        if not path or not os.path.isdir(path):
            continue
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        roots.append((name, path))
    return roots


def path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big")


def is_heldout(rel: str) -> bool:
    return path_hash(rel) % 1000 < HELDOUT_PER_MILLE


def list_source_files(roots: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Sorted (relpath, abspath, size) of every candidate file; only directory walks and stats, no reads."""
    out = []
    for name, root in roots:
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("."))
            for f in files:
                if not f.endswith(".py"):
                    continue
                full = os.path.join(dirpath, f)
                if os.path.islink(full):
                    continue
                try:
                    size = os.stat(full).st_size
                except OSError:
                    continue
                if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                    rel = name + "/" + os.path.relpath(full, root).replace(os.sep, "/")
                    out.append((rel, full, size))
    out.sort()
    return out


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # a separator byte inside a document would look like a boundary; such files are binary-ish anyway
    return None if bytes([DOC_SEPARATOR]) in data else data


def _read_many(paths: list[str]) -> list[Optional[bytes]]:
    with ThreadPoolExecutor(max_workers=16) as pool:  # file reads release the GIL; cold caches dominate
        return list(pool.map(_read, paths))


def sha1_hex(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@dataclasses.dataclass
class Corpus:
    train: bytes  # documents joined by DOC_SEPARATOR
    heldout: bytes
    manifest: dict


def build_corpus(max_train_bytes: int, log=print) -> Corpus:
    t0 = time.time()
    roots = corpus_roots()
    files = list_source_files(roots)
    held = [f for f in files if is_heldout(f[0])]
    train = sorted((f for f in files if not is_heldout(f[0])), key=lambda f: path_hash(f[0]))
    held.sort(key=lambda f: path_hash(f[0]))

    held_docs, held_meta, held_sha = [], [], set()
    dup_held = 0
    for (rel, _, size), data in zip(held, _read_many([f[1] for f in held])):
        if data is None:
            continue
        digest = sha1_hex(data)
        if digest in held_sha:
            dup_held += 1
            continue
        held_sha.add(digest)
        held_docs.append(data)
        held_meta.append({"path": rel, "bytes": len(data), "sha1": digest})

    # read training files in batches until the byte budget is met (the budget, not the corpus, bounds the time)
    train_docs, train_paths, train_sha = [], [], set()
    dup_train = dup_cross = unreadable = 0
    total = 0
    batch = 512
    for start in range(0, len(train), batch):
        if total >= max_train_bytes:
            break
        chunk = train[start:start + batch]
        for (rel, _, _), data in zip(chunk, _read_many([f[1] for f in chunk])):
            if total >= max_train_bytes:
                break
            if data is None:
                unreadable += 1
                continue
            digest = sha1_hex(data)
            if digest in held_sha:
                dup_cross += 1
                continue
            if digest in train_sha:
                dup_train += 1
                continue
            train_sha.add(digest)
            train_docs.append(data)
            train_paths.append(rel)
            total += len(data)

    sep = bytes([DOC_SEPARATOR])
    long_files = [m for m in held_meta if m["bytes"] >= LONG_DOC_BYTES]
    manifest = {
        "split_rule": SPLIT_RULE,
        "python": platform.python_version(),
        "roots": {name: path for name, path in roots},
        "candidate_files": len(files),
        "candidate_bytes": sum(f[2] for f in files),
        "max_train_bytes": max_train_bytes,
        "train": {
            "files": len(train_docs),
            "bytes": sum(map(len, train_docs)),
            "files_available": len(train),
            "bytes_available": sum(f[2] for f in train),
            "dropped_equal_to_heldout": dup_cross,
            "dropped_duplicates": dup_train,
            "unreadable_or_binary": unreadable,
            # the file list itself is long; its hash identifies it (paths in read order, '\n'-joined)
            "paths_sha256": hashlib.sha256("\n".join(train_paths).encode()).hexdigest(),
        },
        "heldout": {
            "files": len(held_docs),
            "bytes": sum(map(len, held_docs)),
            "dropped_duplicates": dup_held,
            "long_doc_min_bytes": LONG_DOC_BYTES,
            "long_files_total": len(long_files),
            "long_files_at_least_16k": sum(m["bytes"] >= 16384 for m in long_files),
            "long_files_at_least_32k": sum(m["bytes"] >= 32768 for m in long_files),
            # in path-hash order (a fixed pseudo-random order); evaluation takes the first eligible ones
            "long_files": long_files[:MANIFEST_LONG_FILES],
        },
        "build_seconds": round(time.time() - t0, 1),
    }
    log(f"corpus: {len(files)} candidate files ({manifest['candidate_bytes'] / 1e6:.1f} MB) under "
        f"{[r[1] for r in roots]}; train {len(train_docs)} files {total / 1e6:.1f} MB; held-out "
        f"{len(held_docs)} files, {len(long_files)} >= {LONG_DOC_BYTES} B; {manifest['build_seconds']} s")
    return Corpus(sep.join(train_docs) + sep, sep.join(held_docs) + sep, manifest)


def heldout_documents(manifest: dict, min_bytes: int, count: int, exclude=(), *, verify: bool = True) -> list[dict]:
    """The first ``count`` long held-out files of ``manifest`` with at least ``min_bytes`` bytes, read from disk.

    Each result is the manifest entry plus ``data`` (bytes). With ``verify`` a missing file or a changed hash is
    an error: evaluation must run on the machine (image) the manifest was recorded on.
    """
    roots = manifest["roots"]
    out = []
    for entry in manifest["heldout"]["long_files"]:
        if len(out) >= count:
            break
        if entry["bytes"] < min_bytes or entry["path"] in exclude:
            continue
        root_name, rel = entry["path"].split("/", 1)
        path = os.path.join(roots[root_name], rel)
        data = _read(path)
        if data is None or sha1_hex(data) != entry["sha1"]:
            if verify:
                raise FileNotFoundError(
                    f"held-out file {entry['path']} ({path}) is missing or differs from the manifest: run the "
                    "evaluation on the machine the checkpoint was trained on (same Python and packages)")
            continue
        out.append(dict(entry, data=data))
    if len(out) < count:
        raise ValueError(f"only {len(out)} held-out documents of >= {min_bytes} bytes, {count} requested")
    return out


# --- model and checkpoint ---------------------------------------------------------------------------------------
GPU_MODEL = dict(vocab_size=256, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=512,
                 rope_base=100000.0)
SMOKE_MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256,
                   rope_base=100000.0)
# --retrieval: the attention geometry of production models (head dim 128, GQA 4:1, RoPE) in a model whose bf16
# checkpoint stays under 16 MB; RoPE's base is raised for 64K contexts (``--conv-width 4`` adds a short causal
# convolution before each attention: not better on 32 instances per task, docs/results.md)
RETRIEVAL_MODEL = dict(vocab_size=256, dim=512, n_layers=4, n_heads=4, n_kv_heads=1, intermediate_size=768,
                       rope_base=500000.0)
RETRIEVAL_SMOKE_MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256,
                             rope_base=500000.0)


def save_checkpoint(model, path: Path, meta: dict) -> int:
    """bf16 weights + the ModelArgs: small enough to commit. Returns the file size in bytes."""
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": 1, "model_args": dataclasses.asdict(model.args), "state_dict": state, "meta": meta}, path)
    return path.stat().st_size


def load_checkpoint(path, device="cpu", dtype=torch.float32):
    """(model in eval mode on ``device``/``dtype``, checkpoint dict)."""
    mod = load_model_module()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = mod.Transformer(mod.ModelArgs(**ckpt["model_args"]))
    model.load_state_dict({k: v.float() for k, v in ckpt["state_dict"].items()})
    return model.to(device=device, dtype=dtype).eval(), ckpt


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --- training -----------------------------------------------------------------------------------------------
def _batches(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len + 1 bytes (they may cross document boundaries, marked by byte 0)."""
    start = torch.randint(0, stream.numel() - seq_len - 1, (batch, 1), generator=gen, device=stream.device)
    idx = start + torch.arange(seq_len + 1, device=stream.device)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]


@contextlib.contextmanager
def fused_attention_for_training(device: torch.device):
    """Training only: K/V repeated for GQA and SDPA's math backend excluded on the GPU.

    The math backend would build (N x N) scores: at 32K with batch 2 that is gigabytes per layer, silently.
    Repeating K/V (a few MB here) lets every fused backend apply whatever its GQA support in this torch version;
    excluding math turns a missing fused kernel into an error instead of a slow run. Evaluation scripts run the
    model unchanged (native GQA), as a user would.
    """
    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION]):
                yield
        else:
            yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig


def answer_weight_at(seq_len: int, answer_weight: float) -> float:
    """The loss weight of one retrieved value byte: ``answer_weight`` per 4K of context, so the answers' share of
    a window's loss does not shrink as windows grow (at 64K, 32 answer bytes are otherwise 0.05% of it)."""
    return max(1.0, answer_weight * seq_len / 4096)


def extra_lookups_at(seq_len: int, per_64k: float, rng) -> int:
    """How many extra lookups a training window of ``seq_len`` bytes carries: ``per_64k`` per 64K bytes, the
    fraction rounded at random (no draw when ``per_64k`` is 0, so earlier runs' streams are unchanged)."""
    if per_64k <= 0:
        return 0
    mean = per_64k * seq_len / 65536
    return int(mean) + (rng.random() < mean - int(mean))


def _retrieval_batches(train: bytes, seq_len: int, batch: int, rng, task_share: float, device,
                       styles=("vkey",), answer_weight: float = 0.0, task_weights=None, extra_lookups: float = 0.0,
                       extra_list_share: float = 0.0, extra_near_miss_share: float = 0.0, families=None):
    """Like ``_batches``, but each window is, with probability ``task_share``, a retrieval instance
    (``retrieval_tasks.py``, a random task in a random one of ``styles``) built on that window's code; built on the
    host while the GPU runs the last step. Returns (x, y, per-target loss weights or None): with
    ``answer_weight`` > 0 the bytes of retrieved values weigh ``answer_weight_at(seq_len, answer_weight)``.
    ``task_weights`` (one per ``retrieval_tasks.TASKS``): how often each task is drawn (None: uniformly).
    ``extra_lookups``: lookups added to each instance per 64K bytes (``extra_lookups_at``), a share
    ``extra_list_share`` of them three-value lists, near-miss keys in a share ``extra_near_miss_share`` of the
    windows; their values weighted like the task's. ``families`` (names of ``retrieval_families.FAMILIES``): the
    instances are of a random one of these families instead, with 3 queries plus ``extra_lookups`` per 64K over
    twice as many keys (tasks, styles and the list and near-miss shares unused)."""
    import retrieval_families as rf
    import retrieval_tasks as rt

    rows = []
    weights = torch.ones(batch, seq_len) if answer_weight > 0 else None
    heavy = answer_weight_at(seq_len, answer_weight)
    for row in range(batch):
        start = rng.randrange(0, len(train) - seq_len - 2)
        window = train[start:start + seq_len + 1]
        if families and rng.random() < task_share:
            # extra lookups become more queries: the 3 of an evaluation prompt plus extra_lookups per 64K
            queries = 3 + extra_lookups_at(seq_len, extra_lookups, rng)
            family = rng.choices(families, weights=rf.training_weights(families))[0]
            instance = rf.make_instance(family, window, seq_len + 1, rng, queries)
            rows.append(instance.tokens)
            if weights is not None:
                for answer in instance.answers:
                    weights[row, answer.start - 1:answer.end - 1] = heavy
        elif not families and rng.random() < task_share:
            # uniform draws keep rng.choice: the stream then matches runs from before task weights existed
            task = rng.choice(rt.TASKS) if task_weights is None else rng.choices(rt.TASKS, weights=task_weights)[0]
            # one style draws nothing: the stream then matches runs from before styles existed
            style = styles[0] if len(styles) == 1 else rng.choice(styles)
            instance = rt.make_instance(task, window, seq_len + 1, rng, style,
                                        extra_lookups_at(seq_len, extra_lookups, rng), extra_list_share,
                                        extra_near_miss_share)
            rows.append(instance.tokens)
            if weights is not None:
                for answer in instance.answers:  # target t predicts token t + 1
                    weights[row, answer.start - 1:answer.end - 1] = heavy
        else:
            rows.append(torch.frombuffer(bytearray(window), dtype=torch.uint8))
    data = torch.stack(rows)
    if device.type == "cuda":  # a pageable copy would wait for the GPU: pinned, the host builds ahead
        data = data.pin_memory()
        weights = weights.pin_memory() if weights is not None else None
    data = data.to(device, non_blocking=True).long()
    if weights is not None:
        weights = weights.to(device, non_blocking=True)
    return data[:, :-1], data[:, 1:], weights


@torch.no_grad()
def evaluate_retrieval(model, heldout: bytes, lengths, per_task: dict, seed: int, amp: bool, device,
                       styles=("vkey",)) -> dict:
    """Dense retrieval accuracy on held-out instances: per length and task, the share of values retrieved exactly
    (teacher-forced argmax, ``retrieval_tasks.score``) and of value bytes, in the ``vkey`` style; with more
    ``styles``, also each other style's mean over the tasks (half as many instances)."""
    import random

    import retrieval_tasks as rt

    def accuracy(task, count, rng, style):
        results = []
        for inst in rt.make_batch([task] * count, heldout, length, rng, style):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(inst.tokens[None].to(device).long())[0]
            results += rt.score(logits.float(), inst)
        return results

    model.eval()
    out = {}
    for length in lengths:
        rng = random.Random(seed * 1_000_003 + length)
        rows = {}
        for task in rt.TASKS:
            results = accuracy(task, per_task.get(length, 4), rng, "vkey")
            rows[task] = {"exact": sum(r["exact"] for r in results) / len(results),
                          "chars": sum(r["chars"] for r in results) / len(results), "values": len(results)}
        rows["mean_exact"] = sum(rows[t]["exact"] for t in rt.TASKS) / len(rt.TASKS)
        for style in styles:
            if style != "vkey":
                results = [r for task in rt.TASKS
                           for r in accuracy(task, max(1, per_task.get(length, 4) // 2), rng, style)]
                rows[f"style_{style}"] = sum(r["exact"] for r in results) / len(results)
        out[str(length)] = rows
        print(f"retrieval at {length}: " + ", ".join(f"{t} {rows[t]['exact']:.2f}" for t in rt.TASKS) +
              "".join(f", {k} {v:.2f}" for k, v in rows.items() if k.startswith("style_")), flush=True)
    model.train()
    return out


@torch.no_grad()
def evaluate_families(model, heldout: bytes, lengths, per_family: int, seed: int, amp: bool, device) -> dict:
    """Dense retrieval accuracy on held-out code per length: the share of values retrieved exactly over the
    training families (``family_train``), over the held-out ones (``family_heldout``, formats never trained on)
    and per family (``family.<name>``); ``per_family`` instances per family and length (3 queries each from 16K)."""
    import random

    import retrieval_families as rf
    import retrieval_tasks as rt

    model.eval()
    out = {}
    for length in lengths:
        rng = random.Random(seed * 1_000_003 + length + 17)
        results = []
        for name in rf.FAMILIES:
            for inst in rf.make_batch([name] * per_family, heldout, length, rng):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    logits = model(inst.tokens[None].to(device).long())[0]
                results += [dict(r, split=inst.style) for r in rt.score(logits.float(), inst)]
        rows = {}
        for split in ("train", "heldout"):
            mine = [r["exact"] for r in results if r["split"] == split]
            rows[f"family_{split}"] = sum(mine) / len(mine)
        for name in rf.FAMILIES:
            mine = [r["exact"] for r in results if r["task"] == name]
            rows[f"family.{name}"] = sum(mine) / len(mine)
        out[str(length)] = rows
        print(f"families at {length}: training {rows['family_train']:.2f}, held-out {rows['family_heldout']:.2f}; "
              + ", ".join(f"{n} {rows[f'family.{n}']:.2f}" for n in rf.FAMILIES), flush=True)
    model.train()
    return out


def _loss(model, x, y, amp: bool, weight: Optional[torch.Tensor] = None):
    """Mean next-byte loss; with ``weight`` (per target), (weighted mean to train on, plain mean to report)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)
    if weight is None:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    per_byte = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    weight = weight.reshape(-1)
    return (per_byte * weight).sum() / weight.sum(), per_byte.mean()


@torch.no_grad()
def evaluate_stream(model, stream, seq_len, batch, windows, seed, amp) -> float:
    """Mean next-byte loss (nats) over ``windows`` random windows of a byte stream (fixed seed)."""
    model.eval()
    gen = torch.Generator(device=stream.device).manual_seed(seed)
    total, n = 0.0, 0
    while n < windows:
        b = min(batch, windows - n)
        x, y = _batches(stream, seq_len, b, gen)
        total += float(_loss(model, x, y, amp)) * b
        n += b
    model.train()
    return total / max(n, 1)


@dataclasses.dataclass(frozen=True)
class Phase:
    """A stretch of training: its steps cycle through ``shapes`` ((seq_len, batch) each, in turn) for ``share`` of
    the time budget (or of the step count). One shape is a plain phase; several mix context lengths step by step."""

    shapes: tuple[tuple[int, int], ...]
    share: float

    @property
    def label(self) -> str:
        return "|".join(f"{seq}x{batch}" for seq, batch in self.shapes)


def parse_phases(text: str) -> list[Phase]:
    """'4096x16:0.6,16384x4|65536x1:0.4' -> phases; '|' mixes shapes within a phase (steps alternate between them).
    Shares are normalised to sum to 1."""
    phases = []
    for part in text.split(","):
        shape_text, share = part.split(":")
        shapes = []
        for shape in shape_text.split("|"):
            seq, batch = shape.lower().split("x")
            shapes.append((int(seq), int(batch)))
        phases.append(Phase(tuple(shapes), float(share)))
    total = sum(p.share for p in phases)
    return [dataclasses.replace(p, share=p.share / total) for p in phases]


def phase_shapes(phases: list[Phase]) -> list[tuple[int, int]]:
    """Every (seq_len, batch) the phases use, once each, in first-use order."""
    return list(dict.fromkeys(shape for p in phases for shape in p.shapes))


def orthogonalized(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Each matrix's polar factor U V^T (batched over leading dims), approximately: singular values pushed into
    about [0.7, 1.2] by a quintic Newton-Schulz iteration in bf16 on the wide orientation, whose coefficients
    favour a fast rise of small singular values over exact convergence (Muon, Jordan et al. 2024)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose step for each weight matrix is its Nesterov momentum orthogonalised (every direction
    moves at the same rate), scaled by sqrt(max(1, rows / cols)). ``row_splits`` maps a parameter to the row
    counts of the matrices it stacks (a fused q/k/v projection), orthogonalised one by one. Matrices of one
    shape are orthogonalised as one batch (a few dozen launches per step, not hundreds). Only for 2-D hidden
    weights: embeddings, the output head and norm gains stay with AdamW."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 row_splits: Optional[dict] = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.row_splits = row_splits or {}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p.grad)
                buf = state["momentum"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                start = 0
                for rows in self.row_splits.get(p, (p.shape[0],)):
                    part = update[start:start + rows]
                    by_shape.setdefault(tuple(part.shape), []).append((p, start, part))
                    start += rows
            for (rows, cols), parts in by_shape.items():
                steps = orthogonalized(torch.stack([part for _, _, part in parts]))
                scale = max(1.0, rows / cols) ** 0.5
                for (p, start, _), step in zip(parts, steps):
                    p[start:start + rows].add_(step, alpha=-group["lr"] * scale)


def make_optimizers(model, args, device) -> list:
    """AdamW for everything (``--optimizer adamw``), or Muon for the blocks' weight matrices and AdamW for the
    embedding, the output head and the norm gains (``--optimizer muon``). Each group keeps its peak rate in
    ``peak_lr``; the schedule scales it."""
    def adamw(params: list) -> torch.optim.AdamW:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # norms: decaying their gains only hurts
        return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    if args.optimizer == "adamw":
        opts = [adamw(list(model.parameters()))]
    else:
        hidden, splits = [], {}
        for block in model.layers:
            for name, p in block.named_parameters():
                if p.dim() == 2:
                    hidden.append(p)
                    if name.endswith("wqkv.weight"):
                        attn = block.attention
                        splits[p] = (attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim,
                                     attn.n_kv_heads * attn.head_dim)
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if id(p) not in hidden_ids]
        opts = [Muon(hidden, lr=args.muon_lr, weight_decay=0.0, row_splits=splits), adamw(rest)]
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


def optimizer_step_seconds(model, args, device, sync, repeats: int = 7) -> float:
    """Median time of one step of ``args.optimizer``'s optimizers, on a copy of the model with random gradients.
    On the GPU it is the device's time: in training the host launches a step while the previous one runs, so
    the launches' host time is hidden (timing it with the host clock over-counted Muon's step ~5x)."""
    import copy

    probe = copy.deepcopy(model)
    for p in probe.parameters():
        p.grad = torch.randn_like(p)
    opts = make_optimizers(probe, args, device)
    times = []
    for _ in range(repeats):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU work queued first: the launches below run ahead of it
            start.record()
            for opt in opts:
                opt.step()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            for opt in opts:
                opt.step()
            times.append(time.perf_counter() - t)
    del probe, opts
    return median_after_warmup(times)


def median_after_warmup(times: list, warmup: int = 2) -> float:
    """Median of timings, the first ``warmup`` dropped (allocations, autotuning)."""
    kept = sorted(times[warmup:])
    return kept[len(kept) // 2]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: tiny model, a few steps, seconds")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_CHECKPOINT.parent)
    parser.add_argument("--name", default="small_lm")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--phases", default=None,
                        help="length curriculum 'SEQxBATCH:SHARE,...' (share of the time budget, or of --steps); "
                             "'SEQxBATCH|SEQxBATCH:SHARE' is a phase whose steps cycle through its shapes")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of training steps; the step count is calibrated from measured step times")
    parser.add_argument("--steps", type=int, default=None, help="fixed total step count (overrides --time-budget)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop training after this many seconds whatever the step count (recorded as stopped)")
    parser.add_argument("--phase-steps", type=int, nargs="+", default=None, metavar="N",
                        help="fixed step count of each phase (overrides the calibrated or --steps counts): a "
                             "timed run's recorded counts repeat its schedule; the calibration still runs, so the "
                             "training data are the timed run's")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default=None,
                        help="muon: orthogonalised momentum for the blocks' weight matrices, AdamW for the rest "
                             "(default: muon with --retrieval, which trained the committed model 4; adamw otherwise)")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="--optimizer muon: peak rate of Muon's groups")
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--max-train-bytes", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=None)
    parser.add_argument("--retrieval", action="store_true",
                        help="the retrieval model: production attention geometry, code mixed with retrieval tasks")
    parser.add_argument("--task-share", type=float, default=0.8,
                        help="--retrieval: share of training windows that carry a retrieval instance")
    parser.add_argument("--styles", nargs="+", default=None,
                        help="--retrieval: prompt styles trained on (retrieval_tasks.STYLES; default: all)")
    parser.add_argument("--families", action="store_true",
                        help="--retrieval: train on retrieval_families' training families (and code) instead of "
                             "the styles' tasks; the evaluation (and --evaluate's) then scores every family, "
                             "training and held-out apart")
    parser.add_argument("--answer-weight", type=float, default=16.0,
                        help="--retrieval: loss weight of a retrieved value byte per 4K of context (0: plain mean)")
    parser.add_argument("--layers", type=int, default=None,
                        help="number of transformer layers (default: the chosen model's n_layers)")
    parser.add_argument("--task-weights", type=float, nargs=4, default=None,
                        metavar=("PASSKEY", "MULTIKEY", "MULTIVALUE", "RECALL"),
                        help="--retrieval: relative draw frequency of each task (default: uniform)")
    parser.add_argument("--evaluate", type=Path, default=None, metavar="CHECKPOINT",
                        help="no training: the retrieval evaluation of a saved checkpoint (--eval-instances per task "
                             "and length, 16K / 32K / 64K; --smoke: 1K / 2K), written to <out-dir>/<name>_eval.json; "
                             "--seed draws other instances than training's own evaluation")
    parser.add_argument("--eval-instances", type=int, default=None,
                        help="retrieval instances per task and length, --evaluate's and training's own final "
                             "evaluation (default 32; --smoke: 2; with --families: per family, 8; --smoke: 1)")
    parser.add_argument("--extra-lookups", type=float, default=12.0,
                        help="--retrieval: lookups added to each training instance per 64K bytes, "
                             "queried before the task's own (more supervised long-range lookups per step; 0: none; "
                             "--families: queries added to the 3 of each instance)")
    parser.add_argument("--extra-list-share", type=float, default=0.5,
                        help="--retrieval: share of the extra lookups that are three-value lists (multi-value's form)")
    parser.add_argument("--extra-near-miss-share", type=float, default=0.0,
                        help="--retrieval: share of windows whose extra lookups' keys share their first four digits")
    parser.add_argument("--attn-temperature", type=int, default=None, metavar="FLOOR",
                        help="long-context attention temperature from this many positions on "
                             "(ModelArgs.attn_temperature_floor; 0: none; default: the chosen model's)")
    parser.add_argument("--conv-width", type=int, default=None,
                        help="short causal convolution before each attention (ModelArgs.conv_width; 0: none; "
                             "default: the chosen model's)")
    args = parser.parse_args(argv)
    if args.retrieval and args.name == "small_lm":  # --families does not overwrite the styles' model
        args.name = "retrieval_families_lm" if args.families else "retrieval_lm"
    if args.optimizer is None:
        args.optimizer = "muon" if args.retrieval else "adamw"

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = args.smoke
    default_phases = (("1024x2:0.5,2048x1:0.5" if args.retrieval else "256x4:0.5,512x2:0.5") if smoke else
                      "4096x16:0.35,16384x4:0.2,16384x4|32768x2|65536x1:0.45" if args.retrieval else
                      "4096x16:0.6,16384x4:0.25,32768x2:0.15")
    phases = parse_phases(args.phases or default_phases)
    max_train_bytes = args.max_train_bytes or ((2 << 20) if smoke else (256 << 20))
    steps_total = args.steps if args.steps is not None else (6 if smoke and args.time_budget is None else None)
    time_budget = args.time_budget if args.time_budget is not None else (525.0 if args.retrieval else 330.0)
    eval_windows = args.eval_windows or (4 if smoke else 64)
    amp = device.type == "cuda"  # bf16 autocast on the GPU; fp32 on CPU (bf16 matmuls are slow there)
    t_start = time.time()
    if args.evaluate is not None:
        return _evaluate_checkpoint(args, device, smoke, amp)
    with fused_attention_for_training(device):
        return _train(args, device, smoke, phases, max_train_bytes, steps_total, time_budget, eval_windows, amp,
                      t_start)


def _store_rows(final: Optional[dict], retrieval: Optional[dict]) -> list:
    """The record's numbers as rows for the benchmark's store: per context length, its losses and each task's
    retrieval (the flattened dicts become metrics such as ``passkey.exact``)."""
    rows = []
    for length, losses in (final or {}).items():
        rows.append({"section": "loss", "N": int(length), **losses})
    for length, tasks in (retrieval or {}).items():
        rows.append({"section": "retrieval", "N": int(length), **tasks})
    return rows


def _append_store(args, rows: list, **extra) -> None:
    """Append to the store next to the results (``--out-dir`` itself when it is not the checkpoints folder)."""
    import harness

    out_dir = None if Path(args.out_dir).resolve() == DEFAULT_CHECKPOINT.parent.resolve() else args.out_dir
    if out_dir is None and args.smoke:  # a smoke run leaves the store alone
        return
    harness.append_store("train_small_lm", rows, params=("N",), extra={"name": args.name, **extra}, out_dir=out_dir)


def _evaluate_checkpoint(args, device, smoke, amp) -> dict:
    """Dense retrieval accuracy of a saved checkpoint on more held-out instances than training's own evaluation
    (the same held-out text and seed space; 8-16 instances per task move a task's score by 6-12 points each)."""
    corpus = build_corpus(1 << 20)  # held-out text is complete at any training size
    model, ckpt = load_checkpoint(args.evaluate, device=device)
    lengths = [1024, 2048] if smoke else [16384, 32768, 65536]
    if args.families:
        instances = args.eval_instances or (1 if smoke else 8)
        result = evaluate_families(model, corpus.heldout, lengths, instances, args.seed + 9, amp, device)
    else:
        instances = args.eval_instances or 32
        result = evaluate_retrieval(model, corpus.heldout, lengths, {n: instances for n in lengths},
                                    args.seed + 9, amp, device)
    record = {"checkpoint": str(args.evaluate), "instances_per_task": instances, "seed": args.seed + 9,
              "model_args": ckpt["model_args"], "retrieval": result}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}_eval.json").write_text(json.dumps(record, indent=1) + "\n")
    _append_store(args, _store_rows(None, result), mode="evaluate", checkpoint=Path(args.evaluate).name,
                  instances_per_task=instances, seed=args.seed + 9)
    return record


def _train(args, device, smoke, phases, max_train_bytes, steps_total, time_budget, eval_windows, amp, t_start):
    torch.manual_seed(args.seed)
    corpus = build_corpus(max_train_bytes)
    train_stream = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8).to(device)
    held_stream = torch.frombuffer(bytearray(corpus.heldout), dtype=torch.uint8).to(device)

    mod = load_model_module()
    sizes = ((RETRIEVAL_SMOKE_MODEL if smoke else RETRIEVAL_MODEL) if args.retrieval else
             (SMOKE_MODEL if smoke else GPU_MODEL))
    overrides = {"n_layers": args.layers, "conv_width": args.conv_width,
                 "attn_temperature_floor": args.attn_temperature}
    sizes = dict(sizes, **{field: value for field, value in overrides.items() if value is not None})
    shapes = phase_shapes(phases)
    model_args = mod.ModelArgs(**sizes, max_seq_len=max(seq for seq, _ in shapes))
    model = mod.Transformer(model_args).to(device)
    n_params = param_count(model)
    print(f"model: {dataclasses.asdict(model_args)}; {n_params / 1e6:.2f} M parameters; device {device}")

    opts = make_optimizers(model, args, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    import random

    import retrieval_tasks as rt

    host_rng = random.Random(args.seed)  # --retrieval: windows and instances are drawn on the host
    styles = tuple(args.styles or rt.STYLES)
    unknown = sorted(set(styles) - set(rt.STYLES))
    if unknown:
        raise SystemExit(f"--styles: unknown {unknown}; valid: {list(rt.STYLES)}")

    import retrieval_families as rf

    families = [f.name for f in rf.TRAIN_FAMILIES] if args.families else None
    if args.families and not args.retrieval:
        raise SystemExit("--families trains the retrieval model: give --retrieval too")

    def next_batch(seq, batch, generator):
        if args.retrieval:
            return _retrieval_batches(corpus.train, seq, batch, host_rng, args.task_share, device, styles,
                                      args.answer_weight, args.task_weights, args.extra_lookups,
                                      args.extra_list_share, args.extra_near_miss_share, families)
        return (*_batches(train_stream, seq, batch, generator), None)

    def train_loss(x, y, weight):
        """(loss to differentiate, loss to report: the plain mean next-byte loss)"""
        loss = _loss(model, x, y, amp, weight)
        return loss if weight is not None else (loss, loss)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # step allocation: a fixed count, or calibrated from forward+backward times (no optimizer step, so the
    # calibration leaves the weights untouched; it also warms up cuDNN/cuBLAS for each shape)
    step_times = {}  # (seq_len, batch) -> seconds per step
    if steps_total is None:
        calib_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        for seq, batch in shapes:
            times = []
            for i in range(7):
                x, y, weight = next_batch(seq, batch, calib_gen)
                sync()
                t = time.perf_counter()
                train_loss(x, y, weight)[0].backward()
                sync()
                times.append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
            step_times[seq, batch] = median_after_warmup(times) * 1.03  # + 3%: an AdamW step
        if args.optimizer != "adamw":
            # other optimizers' steps (AdamW's part included, so it counts twice: ~1% of a step) are timed on a
            # copy, so the weights stay as they are
            extra = optimizer_step_seconds(model, args, device, sync)
            step_times = {shape: t + extra for shape, t in step_times.items()}
        # a mixed phase's steps cycle through its shapes: its mean step time is theirs
        phase_steps = [max(1, int(p.share * time_budget * len(p.shapes) / sum(step_times[x] for x in p.shapes)))
                       for p in phases]
    else:
        phase_steps = [max(1, round(p.share * steps_total)) for p in phases]
    if args.phase_steps is not None:  # after the calibration, whose batches come from the same host generator
        if len(args.phase_steps) != len(phases) or min(args.phase_steps) < 1:
            raise SystemExit(f"--phase-steps: {len(phases)} positive counts needed (one per phase), "
                             f"got {args.phase_steps}")
        phase_steps = list(args.phase_steps)
    total_steps = sum(phase_steps)
    print(f"phases (seq x batch: steps): {[(p.label, n) for p, n in zip(phases, phase_steps)]}; "
          f"calibrated step seconds { {f'{s}x{b}': round(t, 4) for (s, b), t in step_times.items()} }")

    log = []
    step = 0
    running = torch.zeros((), device=device)
    running_n = 0
    t_train = time.time()
    model.train()
    stopped_at = None
    for phase, n_steps in zip(phases, phase_steps):
        if stopped_at is not None:
            break
        for phase_step in range(n_steps):
            if args.max_seconds is not None and time.time() - t_train > args.max_seconds:
                stopped_at = step  # a hard wall-clock limit: keep what was trained, say where it stopped
                print(f"stopped at step {step}/{total_steps}: --max-seconds {args.max_seconds} reached", flush=True)
                break
            seq, batch = phase.shapes[phase_step % len(phase.shapes)]
            factor = lr_at(step, total_steps, 1.0, min(args.warmup, max(1, total_steps // 10)), 0.1)
            lr = args.lr * factor
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * factor
            x, y, weight = next_batch(seq, batch, gen)
            objective, loss = train_loss(x, y, weight)
            objective.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
            running += loss.detach()
            running_n += 1
            step += 1
            if step % args.log_every == 0 or step == total_steps:
                value = float(running) / running_n  # one host sync per log line, not per step
                running.zero_()
                running_n = 0
                elapsed = time.time() - t_train
                log.append({"step": step, "seq_len": seq, "loss": round(value, 4),
                            "bpb": round(value / math.log(2), 4), "lr": lr, "seconds": round(elapsed, 1)})
                print(f"step {step:6d}/{total_steps} seq {seq:6d} loss {value:.4f} ({value / math.log(2):.3f} bpb) "
                      f"lr {lr:.2e} {elapsed:7.1f} s", flush=True)
    sync()
    train_seconds = time.time() - t_train

    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / f"{args.name}.pt"
    save_checkpoint(model, ckpt_path, {"steps": step})  # the weights first: an evaluation cut short keeps them
    final = {}
    for seq, batch in sorted(dict(shapes).items()):  # one evaluation per context length
        final[str(seq)] = {
            "train_loss": round(evaluate_stream(model, train_stream, seq, batch, eval_windows, args.seed + 7, amp), 4),
            "heldout_loss": round(evaluate_stream(model, held_stream, seq, batch, eval_windows, args.seed + 8, amp), 4),
        }
        final[str(seq)]["train_bpb"] = round(final[str(seq)]["train_loss"] / math.log(2), 4)
        final[str(seq)]["heldout_bpb"] = round(final[str(seq)]["heldout_loss"] / math.log(2), 4)
    print(f"final loss (nats/byte) per context length: {json.dumps(final)}")
    retrieval = None
    if args.retrieval:
        lengths = sorted(dict(shapes)) if smoke else [16384, 32768, 65536]
        if families:
            retrieval = evaluate_families(model, corpus.heldout, lengths, args.eval_instances or (1 if smoke else 8),
                                          args.seed + 9, amp, device)
        else:
            per_task = {n: (args.eval_instances or (2 if smoke else 32)) for n in lengths}
            retrieval = evaluate_retrieval(model, corpus.heldout, lengths, per_task, args.seed + 9, amp, device,
                                           styles=("vkey",) + tuple(s for s in styles if s != "vkey"))

    phase_records = [_phase_record(p, n) for p, n in zip(phases, phase_steps)]
    record = {
        "checkpoint": ckpt_path.name,
        "model_args": dataclasses.asdict(model_args),
        "parameters": n_params,
        "training": {
            "seed": args.seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "smoke": smoke,
            "precision": "bf16 autocast, fp32 master weights" if amp else "fp32",
            "optimizer": {"name": "AdamW" if args.optimizer == "adamw" else
                          "Muon (blocks' weight matrices, momentum 0.95, Nesterov) + AdamW (the rest)",
                          "muon_lr": args.muon_lr if args.optimizer == "muon" else None,
                          "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                          "grad_clip": 1.0, "schedule": "linear warm-up then cosine to 0.1x",
                          "warmup_steps": min(args.warmup, max(1, total_steps // 10))},
            "phases": phase_records,
            "steps": total_steps,
            "tokens": sum(r["tokens"] for r in phase_records),
            "time_budget_s": None if args.steps is not None or args.phase_steps is not None else time_budget,
            "calibrated_step_seconds": {f"{s}x{b}": t for (s, b), t in step_times.items()},
            "train_seconds": round(train_seconds, 1),
            "stopped_at_step": stopped_at,
            "total_seconds": None,  # filled below
            "log": log,
        },
        "final": final,
        "retrieval": retrieval,
        "task_share": args.task_share if args.retrieval else None,
        "task_weights": args.task_weights if args.retrieval else None,
        "answer_weight": args.answer_weight if args.retrieval else None,
        "extra_lookups_per_64k": args.extra_lookups if args.retrieval else None,
        "extra_list_share": args.extra_list_share if args.retrieval else None,
        "extra_near_miss_share": args.extra_near_miss_share if args.retrieval else None,
        "styles": list(styles) if args.retrieval and not families else None,
        "families": families,
        "eval_windows": eval_windows,
        "manifest": corpus.manifest,
    }
    size = save_checkpoint(model, ckpt_path, {"final": final, "steps": total_steps, "retrieval": retrieval})
    record["checkpoint_bytes"] = size
    record["training"]["total_seconds"] = round(time.time() - t_start, 1)
    (out_dir / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    _append_store(args, _store_rows(final, retrieval) + [{"section": "training", "steps": total_steps,
                                                          "train_seconds": round(train_seconds, 1),
                                                          "checkpoint_bytes": size}],
                  mode="train", seed=args.seed)
    print(f"saved {ckpt_path} ({size / 1e6:.2f} MB) and {args.name}.json; train {train_seconds:.1f} s, "
          f"total {record['training']['total_seconds']} s")
    _plot_loss(record, out_dir / f"{args.name}_loss.png")
    return record


def _plot_loss(record: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot")
        return
    log = record["training"]["log"]
    if not log:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in log], [r["bpb"] for r in log], lw=1.2)
    for phase_end in _phase_ends(record):
        ax.axvline(phase_end, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (bits per byte)")
    labels = ["|".join(f"{x['seq_len'] // 1024}K" for x in p["shapes"]) for p in record["training"]["phases"]]
    ax.set_title(f"small byte-level LM on Python source (phases: {' / '.join(labels)} contexts)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _phase_record(phase: Phase, steps: int) -> dict:
    """A phase as the JSON records it; a plain phase keeps the earlier records' fields (seq_len, batch)."""
    counts = [steps // len(phase.shapes) + (i < steps % len(phase.shapes)) for i in range(len(phase.shapes))]
    record = {"shapes": [{"seq_len": s, "batch": b, "steps": c} for (s, b), c in zip(phase.shapes, counts)],
              "steps": steps, "tokens": sum(s * b * c for (s, b), c in zip(phase.shapes, counts))}
    if len(phase.shapes) == 1:
        record = {"seq_len": phase.shapes[0][0], "batch": phase.shapes[0][1], **record}
    return record


def _phase_ends(record: dict) -> list[int]:
    ends, acc = [], 0
    for p in record["training"]["phases"][:-1]:
        acc += p["steps"]
        ends.append(acc)
    return ends


if __name__ == "__main__":
    main()
