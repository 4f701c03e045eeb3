"""The package's layering, read from the source: no import cycles, and ``kernels/`` below ``sparse_compile``.

Every ``import`` counts, also one inside a function (a lazy import still ties two modules together); only imports
under ``if TYPE_CHECKING:`` (annotations, never run) do not. The graph is built from the files with ``ast``,
without importing anything, so the check is fast and sees what tools see.
``kernels/`` is installed as ``sparse_compile.kernels`` and is named so here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparse_compile"
KERNELS = PACKAGE + ".kernels"


def _modules() -> dict[str, Path]:
    """Module name -> file, for the package and its kernels."""
    found = {}
    for base, folder in ((PACKAGE, ROOT / "sparse_compile"), (KERNELS, ROOT / "kernels")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([base] + parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its file). ``from X import name`` is an edge to
    ``X.name`` when that is a module, else to ``X``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                if target.startswith("kernels.") or target == "kernels":  # the source tree's name of the kernels
                    target = PACKAGE + "." + target
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]  # a name inside a module: the module
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_import_graph_sees_lazy_imports():
    graph = import_graph()
    assert "sparse_compile.kernels.block_sparse_attention" not in graph  # names resolve to their modules
    assert "sparse_compile.plan" in graph["sparse_compile.methods.tiles"]
    assert "sparse_compile.kernels.hopper" in graph["sparse_compile.kernels.attention"]  # a function-level import
    assert "sparse_compile.methods.pbs" not in graph["sparse_compile.config"]  # annotations only
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_package_or_its_kernels():
    graph = import_graph()
    # the package's __init__ imports every layer for its public names and is imported by none
    importers = sorted(name for name, targets in graph.items() if PACKAGE in targets)
    assert not importers, f"modules that import the package's __init__: {importers}"
    assert find_cycles(graph) == []


def test_kernels_import_nothing_from_the_package():
    graph = import_graph()
    upward = {name: sorted(t for t in targets if not t.startswith(KERNELS))
              for name, targets in graph.items() if name.startswith(KERNELS)}
    assert {name: t for name, t in upward.items() if t} == {}


def test_the_methods_import_nothing_from_the_configuration():
    """A stage receives its own method's parameters, never the configuration: ``methods/`` stays below
    ``config.py`` (which reads the registry the methods fill)."""
    graph = import_graph()
    upward = {name: sorted(targets & {f"{PACKAGE}.config", f"{PACKAGE}.context", f"{PACKAGE}.site"})
              for name, targets in graph.items() if name.startswith(f"{PACKAGE}.methods")}
    assert {name: t for name, t in upward.items() if t} == {}


def _code_mentions(path: Path, word: str) -> list[int]:
    """Lines where ``word`` occurs in code (names, attributes, strings that are not docstrings, imports)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    lines = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            text = " ".join([getattr(node, "module", None) or ""] + [a.name for a in node.names])
        if text is not None and word.lower() in text.lower():
            lines.append(node.lineno)
    return sorted(set(lines))


def test_a_method_with_kernels_is_its_own_files_and_one_line():
    """``sampled`` (a method with fast stages and kernels of its own) is named in code only by its two files, its
    registration line in ``methods/__init__.py``, the extension API's name of its parameters (``extend.py``) and
    the package default (``DEFAULT_METHOD = "sampled"`` in ``config.py``)."""
    own = {ROOT / "sparse_compile" / "methods" / "sampled.py", ROOT / "kernels" / "sampled.py"}
    found = {}
    for path in _modules().values():
        if path not in own and (lines := _code_mentions(path, "sampled")):
            found[str(path.relative_to(ROOT))] = lines
    extend = (ROOT / "sparse_compile" / "extend.py").read_text().splitlines()
    public = found.pop("sparse_compile/extend.py", [])  # ``from .methods.sampled import SampledParams``, __all__
    assert public and all("SampledParams" in extend[n - 1] for n in public), public
    registration = found.pop("sparse_compile/methods/__init__.py", [])
    assert len(registration) == 1, registration
    config = (ROOT / "sparse_compile" / "config.py").read_text().splitlines()
    default = found.pop("sparse_compile/config.py", [])  # ``DEFAULT_METHOD = "sampled"``: the package default
    assert default and all("DEFAULT_METHOD" in config[n - 1] for n in default), default
    assert found == {}, f"code outside the method's files that names it: {found}"


def test_the_configuration_names_no_method():
    """``config.py`` knows methods through the registry alone: no method's name in its code but the package default
    (``DEFAULT_METHOD``); their parameters and field checks are ``params.py`` and the methods' own modules."""
    import sparse_compile

    path = ROOT / "sparse_compile" / "config.py"
    lines = path.read_text().splitlines()
    for name in sparse_compile.registry.registered_methods():
        named = [n for n in _code_mentions(path, name) if "DEFAULT_METHOD" not in lines[n - 1]]
        assert named == [], (name, named)


def test_examples_offer_every_registered_method():
    """``--method`` of the examples comes from the registry: ``sampled`` included, and any method registered later."""
    import os
    import subprocess
    import sys

    import sparse_compile

    for example in ("quickstart.py", "hf_model.py"):
        run = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--help"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0, run.stderr[-2000:]
        offered = run.stdout.split("--method", 1)[1].split("}", 1)[0]
        for name in sparse_compile.registry.registered_methods():
            assert name in offered, (example, name, offered)


def test_the_regions_example_runs_every_region():
    """``examples/regions.py`` as a user runs it (CPU, 2,048 tokens): every region's line printed."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(ROOT / "examples" / "regions.py")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if "logits error vs dense" in line]
    assert len(lines) == 6, run.stdout


def test_importing_the_package_writes_no_module_table():
    """No module of the package or its kernels writes ``sys.modules`` or hooks imports (``sys.meta_path``,
    ``sys.path_hooks``): ``sparse_compile.kernels`` comes from the install's mapping (pyproject.toml's package-dir)."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                target = next((t for t in targets if isinstance(t, ast.Subscript)
                               and ast.unparse(t.value) in ("sys.modules", "_sys.modules")), None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if owner.endswith(("sys.meta_path", "sys.path_hooks", "sys.modules")) and node.func.attr in (
                        "insert", "append", "extend", "update", "setdefault", "pop", "remove"):
                    target = node
            if target is not None:
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_kernels_are_the_top_level_folder():
    import sparse_compile.kernels

    assert Path(sparse_compile.kernels.__file__).resolve().parent == ROOT / "kernels"


def test_no_private_name_crosses_a_module():
    """A module uses another's public names only: no ``from .x import _name`` and no private module (``._x``)."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                parts = (node.module or "").split(".") + [alias.name for alias in node.names]
                if any(part.startswith("_") and not part.startswith("__") for part in parts):
                    found.append(f"{name}:{node.lineno}")
    assert found == []


# module docstrings say what a module is, its contract and invariants, and point to docs/; measurement logs,
# research history and long derivations live in docs/ (kernels.md, methods.md, design.md). The mask proof's argument
# (masks.py) and the plan contract (plan.py) are the docstrings' own subject.
DOCSTRING_LINES = 25
LONG_DOCSTRINGS = {"sparse_compile/masks.py", "sparse_compile/plan.py"}


def test_module_docstrings_are_at_most_25_lines():
    files = {path.relative_to(ROOT).as_posix(): path for path in _modules().values()}
    assert LONG_DOCSTRINGS <= set(files) and "kernels/attention.py" in files
    long = []
    for name, path in sorted(files.items()):
        docstring = ast.get_docstring(ast.parse(path.read_text(), name), clean=False) or ""
        if name not in LONG_DOCSTRINGS and len(docstring.splitlines()) > DOCSTRING_LINES:
            long.append(f"{name}: {len(docstring.splitlines())} lines")
    assert not long, f"module docstrings over {DOCSTRING_LINES} lines (move measurements to docs/): {long}"
