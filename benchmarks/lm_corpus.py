"""The small LMs' corpus: the ``*.py`` files of the interpreter's source roots, split into training and held-out
files by path hash (``SPLIT_RULE``; ``train_small_lm.py`` describes the data), and the long held-out files the
quality benchmarks evaluate on."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

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
