"""One compiled model, different sparsity per region of code, chosen at run time (no recompile).

    python examples/regions.py
"""

from __future__ import annotations

import torch

import sparse_compile
from model import ModelArgs, Transformer


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Transformer(ModelArgs(n_layers=2)).to(device=device, dtype=dtype).eval()
    tokens = torch.randint(0, 256, (1, 16384 if device == "cuda" else 2048), device=device)

    compiled = torch.compile(model, backend="sparse_prefill", options={"min_seq_len": 1024, "record_density": True})
    with torch.no_grad():
        with sparse_compile.sparsity(enabled=False):
            reference = compiled(tokens, last_only=True).float()
        regions = [
            ("pbs (compiled default)", sparse_compile.sparsity()),
            ("pbs, threshold 0.5", sparse_compile.sparsity(threshold=0.5)),
            ("bfla, mass 0.9", sparse_compile.sparsity(method="bfla", mass_threshold=0.9)),
            ("sparge", sparse_compile.sparsity(method="sparge")),
            ("s2o, early stop 0.01", sparse_compile.sparsity(method="s2o", early_stop=0.01)),
        ]
        for name, region in regions:
            sparse_compile.reset_runtime_stats()
            with region:
                out = compiled(tokens, last_only=True).float()
            densities = [s.mean_density for s in sparse_compile.runtime_stats().values() if s.mean_density is not None]
            density = sum(densities) / len(densities) if densities else float("nan")
            err = (out - reference).norm() / reference.norm()
            print(f"{name:24s} density {density:.3f}   logits error vs dense {err:.2e}")


if __name__ == "__main__":
    main()
