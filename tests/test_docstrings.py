"""Module docstrings stay short: what a module is, its contract and invariants, a pointer to docs/. Measurement logs,
research history and long derivations live in docs/ (kernels.md, methods.md, design.md).

Two modules are exempt: ``masks.py`` (its docstring is the mask proof's argument) and ``plan.py`` (the plan
contract)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
MAX_LINES = 25
EXEMPT = {"sparse_compile/masks.py", "sparse_compile/plan.py"}


def _modules() -> list[Path]:
    return sorted(path for folder in ("sparse_compile", "kernels") for path in (ROOT / folder).glob("**/*.py"))


def _docstring_lines(path: Path) -> int:
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    return len(docstring.splitlines()) if docstring else 0


def test_the_modules_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in _modules()}
    assert EXEMPT <= names
    assert {"kernels/attention.py", "sparse_compile/methods/sampled.py"} <= names


def test_module_docstrings_are_at_most_25_lines():
    long = [f"{path.relative_to(ROOT).as_posix()}: {lines} lines" for path in _modules()
            if path.relative_to(ROOT).as_posix() not in EXEMPT and (lines := _docstring_lines(path)) > MAX_LINES]
    assert not long, (f"module docstrings over {MAX_LINES} lines (move measurements and derivations to docs/):\n"
                      + "\n".join(long))
