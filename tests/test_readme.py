"""The README's Python blocks run as written, and where a block says sparse, ``runtime_stats()`` shows sparse calls.

Every ``python`` block of README.md is either run here or skipped with its reason (the Multi-GPU blocks need
several processes and GPUs); a block added to the README without an entry in ``CHECKS`` or ``SKIPPED`` fails
``test_every_python_block_is_run_or_skipped``. The first Usage block builds its own small model and prompt; each
later block starts, as the README says, from that block's ``model`` and ``input_ids`` again (uncompiled: the
prelude below is the first block's own lines), with ``tokenizer`` and ``prompts`` as the README's reader brings them
(a stand-in tokenizer that left-pads two prompts of token ids).

For speed (CPU, about a minute) the blocks run at smaller sizes (``SMALLER``: a quarter of the width, half the
prompt, which still reaches the blocks' ``min_seq_len``, fewer calibration steps; the README says so) and without
Inductor's code generation: ``compile_fx`` hands back the rewritten graph to run as it is. What the blocks claim
(which sites run sparse, which dense) is decided by the rewrite and the op before Inductor sees the graph; the
examples, run as users run them, go through Inductor (``test_examples.py``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import sparse_compile

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def python_blocks() -> list[tuple[int, str, str]]:
    """(line, heading, code) of each ```python block of the README, in order."""
    blocks, heading, inside, start, code = [], "", False, 0, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if not inside and line.startswith("#"):
            heading = line.lstrip("#").strip()
        if not inside and line.strip() == "```python":
            inside, start, code = True, number, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append((start, heading, "\n".join(code) + "\n"))
        elif inside:
            code.append(line)
    return blocks


def sparse_sites(stats) -> set[str]:
    return {site for site, entry in stats.items() if any(path == "sparse" for path, _ in entry.calls)}


def dense_only_sites(stats) -> set[str]:
    return {site for site, entry in stats.items() if entry.calls and sparse_sites({site: entry}) == set()}


LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def check_usage(namespace, stats):
    """First Usage block: layer 1 sparse (layer 0 skipped, dense), sparse_attention sparse at min_seq_len 1024."""
    assert sparse_sites(stats) >= {LAYERS[1], "sparse_attention"}, stats
    assert LAYERS[0] in dense_only_sites(stats), stats
    reasons = {reason for (path, reason) in stats[LAYERS[1]].calls}
    assert any("pbs" in r for r in reasons) and any("sampled" in r for r in reasons), reasons  # both regions ran


def check_generate(namespace, stats):
    """generate(): the prefill sparse at every site, the decode steps dense."""
    for site in LAYERS:
        paths = {path for path, _ in stats[site].calls}
        assert paths == {"sparse", "dense"}, (site, stats)
    assert namespace["tokens"].shape[1] > namespace["batch"]["input_ids"].shape[1]


def check_keep_all(namespace, stats):
    """keep_all(): the sparse path at every site, the dense result."""
    assert sparse_sites(stats) == set(LAYERS), stats
    with torch.no_grad():
        dense = namespace["uncompiled"](namespace["input_ids"]).logits
    torch.testing.assert_close(namespace["exact"], dense, rtol=1e-4, atol=1e-4)


def check_calibration(namespace, stats):
    """calibrate(): the returned config runs the sample sparse at every site it calibrated."""
    calibration = namespace["calibration"]
    assert calibration.config.min_seq_len <= namespace["input_ids"].shape[1]
    calibrated = {s.site for s in calibration.sites if not s.dense}
    assert calibrated and sparse_sites(stats) >= calibrated, (str(calibration), stats)
    assert (Path.cwd() / "pbs_calibration.json").exists()


#: a distinctive line of each block run here -> the check of what it claims
CHECKS = {
    "sparse_compile.explain(model, input_ids)": check_usage,
    "tokens = model.generate(": check_generate,
    ".keep_all()": check_keep_all,
    "sparse_compile.calibrate(": check_calibration,
}
#: a distinctive line of each block skipped -> why
SKIPPED = {
    "parallelize_module(": "tensor parallelism: torchrun over several GPUs",
    "sequence_parallel()": "sequence parallelism: a process group of several ranks",
}


#: sizes the test runs at, smaller than the README's (its text says so): each README text -> what runs instead
SMALLER = {
    "hidden_size=256, intermediate_size=512": "hidden_size=64, intermediate_size=128",
    "torch.randint(0, 1000, (1, 2048))": "torch.randint(0, 1000, (1, 1024))",
    "torch.randn(1, 8, 2048, 64), torch.randn(1, 2, 2048, 64), torch.randn(1, 2, 2048, 64)":
        "torch.randn(1, 4, 1024, 16), torch.randn(1, 2, 1024, 16), torch.randn(1, 2, 1024, 16)",
    'method="pbs", target_error=0.02)': 'method="pbs", target_error=0.02, steps=3)',  # fewer bisection steps
}


def smaller(code: str) -> str:
    for text, instead in SMALLER.items():
        code = code.replace(text, instead)
    return code


def first_block_prelude() -> str:
    """The first Usage block's lines up to its compile: the model and the prompt the later blocks start from."""
    code = python_blocks()[0][2]
    return code.split("\nmodel = torch.compile(", 1)[0] + "\n"


def tokenizer(prompts, return_tensors="pt", padding=True):
    """Stands in for a tokenizer: prompts are lists of token ids, left-padded with 0 (padding_side="left")."""
    assert return_tensors == "pt" and padding
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def no_inductor(monkeypatch):
    import torch._inductor.compile_fx as inductor

    monkeypatch.setattr(inductor, "compile_fx", lambda gm, example_inputs, **kwargs: gm.forward)


def _entry(code: str, table: dict):
    found = [value for key, value in table.items() if key in code]
    assert len(found) <= 1, code
    return found[0] if found else None


def test_every_python_block_is_run_or_skipped():
    blocks = python_blocks()
    assert len(blocks) >= 6
    for line, heading, code in blocks:
        assert (_entry(code, CHECKS) is None) != (_entry(code, SKIPPED) is None), \
            f"README.md:{line} ({heading}): add the block to CHECKS or SKIPPED in tests/test_readme.py"
    assert "import torch" in blocks[0][2] and "model = " in first_block_prelude()
    for text in SMALLER:  # the sizes the test substitutes are the README's
        assert any(text in code for _, _, code in blocks), text


def test_the_usage_blocks_say_what_their_reader_provides():
    text = README.read_text()
    usage = text.split("## Usage", 1)[1].split("```python", 1)[0]
    for name in ("model", "input_ids", "tokenizer", "prompts", "tests/test_readme.py"):
        assert name in usage, name


RUN = [b for b in python_blocks() if _entry(b[2], SKIPPED) is None]


@pytest.mark.parametrize("line, heading, code", RUN, ids=[f"line {b[0]}" for b in RUN])
def test_readme_block_runs_as_written(line, heading, code, no_inductor, tmp_path, monkeypatch):
    check = _entry(code, CHECKS)
    assert check is not None, f"README.md:{line}: no check"
    monkeypatch.chdir(tmp_path)  # a block may write files (calibration.save)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "readme"}
    first = code == python_blocks()[0][2]
    if not first:
        exec(compile(smaller(first_block_prelude()), "README.md (first block)", "exec"), namespace)
        ids = namespace["input_ids"][0].tolist()  # two prompts from the first block's: all of it, its last 3/4
        namespace.update(uncompiled=namespace["model"], tokenizer=tokenizer, prompts=[ids, ids[len(ids) // 4:]])
    sparse_compile.reset_runtime_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and Dynamo's notes; the claims are checked below
        exec(compile(smaller(code), f"README.md:{line}", "exec"), namespace)
    check(namespace, sparse_compile.runtime_stats())


def test_readme_quotes_a_min_seq_len_its_prompts_reach():
    """Blocks that compile set a min_seq_len at most the first block's prompt length (else they would run dense),
    at the README's sizes and at the test's."""
    lengths = [int(re.search(r"torch\.randint\(0, \d+, \(1, (\d+)\)\)", prelude).group(1))
               for prelude in (first_block_prelude(), smaller(first_block_prelude()))]
    length = min(lengths)
    for line, _, code in python_blocks():
        for value in re.findall(r"min_seq_len[\"']?[:=] ?(\d+)", code):
            assert int(value) <= length, f"README.md:{line}: min_seq_len {value} > the prompt's {length} tokens"
