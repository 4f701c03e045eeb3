"""The examples as a user runs them (``python examples/<name>.py``, a subprocess, Inductor included), at the small
sizes their flags give: each exits 0, runs sparse where it says so, and what it prints beside a density or an
error holds for the run it made (no expected range from another device or length).

``examples/regions.py`` runs at its defaults in ``test_structure.py``; ``hf_model.py --generate`` takes the path
the README's ``generate()`` block takes (``test_readme.py``), so it is left out here for time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *flags: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *flags], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def densities(text: str) -> list[float]:
    return [float(d) for d in re.findall(r"density (\d\.\d{3})", text)]


def test_quickstart():
    out = run_example("quickstart.py", "--seq-len", "1024", "--layers", "1")
    assert "prompt 1024 tokens on cpu" in out
    assert re.search(r"layers\.0\s+sparse density 1\.000", out), out
    # at 1024 tokens every tile is one the plan keeps whatever the scores: said, with the length where it is not
    assert "at 1024 tokens every sampled plan keeps 1.00 of the tiles" in out.replace("\n ", " "), out
    error = float(re.search(r"sparse vs dense: (\S+)", out).group(1))
    assert error < 1e-4  # density 1: the dense result up to rounding


def test_hf_model_states_what_it_measured():
    out = run_example("hf_model.py", "--seq-len", "1024", "--layers", "2")
    assert "expect 0.1-0.5" not in out
    line = re.search(r"sparse vs dense: (\S+) at mean density (\S+) of the sparse sites \(layer 0 kept dense\), "
                     r"1024 tokens on cpu", out)
    assert line, out
    error, density = float(line.group(1)), float(line.group(2))
    assert density == pytest.approx(1.0) and error < 1e-4, out
    assert "the error grows as the density falls" not in out  # said only where tiles were skipped
    assert "at 1024 tokens every sampled plan keeps 1.00" in out.replace("\n ", " "), out
    assert re.search(r"^model\.layers\.1\.self_attn .*$", out, flags=re.MULTILINE), out  # the stats table


def test_explain_lists_what_ran_and_why():
    out = run_example("explain.py", "--seq-len", "1024")
    rows = re.findall(r"^(model\.layers\.\d\.self_attn) (sparse|dense) (\S*) ?(.*)$", out, flags=re.MULTILINE)
    assert [(site, run) for site, run, _, _ in rows] == [("model.layers.0.self_attn", "dense"),
                                                          ("model.layers.1.self_attn", "sparse"),
                                                          ("model.layers.2.self_attn", "sparse")], out
    assert all(float(density) == 1.0 for _, run, density, _ in rows if run == "sparse")
    assert "at 1024 tokens every sampled plan keeps 1.00 of the tiles" in out.replace("\n ", " "), out
    assert "causal_attention" in out  # the graph diff


def test_the_density_note_holds_for_its_run():
    """The share every plan keeps, as the examples print it, against a plan's measured density at the least budget:
    at most it (the note says the density cannot fall below it), and close (each block adds one scored tile)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from density_note import explain_density, kept_by_every_plan
    finally:
        sys.path.remove(str(ROOT / "examples"))
    import torch

    import sparse_compile

    config = sparse_compile.SparseConfig(min_seq_len=1024, record_density=True, mass_target=0.0, budget=0.001, min_budget=0.001,
                                         sampled={"block_size": 64, "sample_every": 8})
    q = torch.randn(1, 2, 1024, 16)
    sparse_compile.sparse_attention(q, q, q, config=config)
    measured = sparse_compile.runtime_stats()["sparse_attention"].mean_density
    floor = kept_by_every_plan(config, 1024)
    assert floor <= measured <= floor + 0.05, (measured, floor)
    assert kept_by_every_plan(sparse_compile.SparseConfig(method="pbs"), 1024) is None
    assert "random weights" in explain_density(sparse_compile.SparseConfig(method="pbs"), 1024, 1.0)
    assert explain_density(sparse_compile.SparseConfig(method="pbs"), 1024, 0.5) == ""
