"""The repository states facts, not its development history: no tracked file (name or text) speaks of numbered
work periods, rounds or the machine it was written on. Results carry their device, versions, date and command instead; git keeps
the history. Also: the README stays short, and the links inside the README and docs/ point at files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: words that date a statement by the work that produced it rather than by what was measured
HISTORY = re.compile(
    r"\bsessions? ?\d+|\bsession-\d+|\b(?:this|last|next|previous|that) round\b|the issue.s targets|"
    r"\bthis machine\b|\bissue #?\d+\b|\bs\d+ run\b|no (?:multi-)?GPU machine was available",
    re.IGNORECASE)
#: the same in file names: numbered work-period suffixes such as ``_s7`` or ``-s18``
HISTORY_NAME = re.compile(r"[_-]s\d+(?=[._-]|$)|session", re.IGNORECASE)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is not available")
    if out.returncode:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p]


def history_words(path: Path, text: str) -> list[str]:
    """Each offending line of ``text`` as ``path:line: match``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in HISTORY.finditer(line):
            hits.append(f"{path}:{number}: {match.group(0)!r}")
    return hits


def test_no_development_history_in_tracked_files():
    hits = []
    this_file = Path(__file__).resolve().relative_to(ROOT).as_posix()  # it spells the words out
    for name in _tracked_files():
        if name == this_file:
            continue
        if HISTORY_NAME.search(Path(name).name):
            hits.append(f"{name}: file name")
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (checkpoints, images)
            continue
        hits += history_words(Path(name), data.decode("utf-8", errors="replace"))
    assert not hits, "development history in tracked files (state the fact with device, date and command):\n" + \
        "\n".join(hits[:50])


def test_history_pattern_catches_what_it_should():
    bad = ["measured in session 7", "Session 18: a walk", "the session-7 row", "rerun this round",
           "this machine's disk", "the issue's targets", "(issue 13)"]
    good = ["one session of pytest", "rounds of timing", "round to nearest", "issues of wgmma", "the s2o method"]
    assert all(HISTORY.search(s) for s in bad)
    assert not any(HISTORY.search(s) for s in good)
    assert HISTORY_NAME.search("verify_s18.md") and HISTORY_NAME.search("e2e_defaults_s7.json")
    assert not HISTORY_NAME.search("s2o.py") and not HISTORY_NAME.search("bench_s2o_parts.md")


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_readme_method_table_is_what_the_stores_hold():
    """The README's method table is generated from ``benchmarks/results``: it must equal what the stores give now."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def _paragraphs(markdown: str) -> list[str]:
    """Paragraphs and list items of the prose (code blocks and the generated table left out)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"<!-- method table.*?<!-- end of method table -->", "", prose, flags=re.DOTALL)
    return [block for block in re.split(r"\n\s*\n|\n(?=\* )", prose) if block.strip()]


def test_speedups_in_the_readme_name_device_and_date():
    """A speedup quoted in prose says where and when it was measured (the generated table's caption does so)."""
    undated = [block.strip()[:120] for block in _paragraphs((ROOT / "README.md").read_text())
               if re.search(r"\d×", block) and not (re.search(r"\bH[12]00\b", block)
                                                    and re.search(r"20\d\d-\d\d-\d\d", block))]
    assert undated == []


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)  # comments in code are no headings
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)}


def test_links_in_readme_and_docs_resolve():
    link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                missing.append(f"{doc.relative_to(ROOT)} -> {target} (no such heading)")
    assert not missing, "broken links:\n" + "\n".join(missing)
