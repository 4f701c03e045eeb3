"""One compiled model, different sparsity per region of code, chosen at run time (no recompile).

    python examples/regions.py                  # CPU: 2,048 tokens; GPU: 16,384
    python examples/regions.py --seq-len 8192   # longer: the tiles every plan keeps are a smaller share

Prints, per region, the density (the share of the causal attention tiles computed, 1.0 = dense), how far the
last-token logits are from dense attention's, and why a density is as high as it is where that is the tiles every
plan keeps or random weights (``density_note.py``). The model is ``quickstart.py``'s ``TinyDecoder``.
"""

from __future__ import annotations

import argparse

import torch

import sparse_compile
from density_note import explain_density
from quickstart import TinyDecoder  # the same small random-weights decoder, nothing sparse in it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq-len", type=int, default=16384 if cuda else 2048)
    args = parser.parse_args()
    options = {"min_seq_len": 1024, "record_density": True}
    if args.seq_len < options["min_seq_len"]:
        parser.error(f"--seq-len: at least {options['min_seq_len']} (the example's min_seq_len: shorter prompts run "
                     "dense)")
    torch.manual_seed(0)
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyDecoder(layers=2).to(device=device, dtype=dtype).eval()
    tokens = torch.randint(0, 256, (1, args.seq_len), device=device)
    print(f"prompt {args.seq_len} tokens on {device} ({dtype}), 2 layers, random weights")

    compiled = torch.compile(model, backend="sparse_prefill", options=options)
    with torch.no_grad():
        with sparse_compile.sparsity(enabled=False):
            reference = compiled(tokens, last_only=True).float()
        regions = [  # (name, the region's options: any SparseConfig field or the method's parameters)
            ("sampled (the default)", {}),
            ("sampled, fixed share 0.1", dict(mass_target=0.0, budget=0.1)),
            ("pbs, threshold 0.5", dict(method="pbs", threshold=0.5)),
            ("bfla, mass 0.9", dict(method="bfla", mass_threshold=0.9)),
            ("sparge", dict(method="sparge")),
            ("s2o, early stop 0.01", dict(method="s2o", early_stop=0.01)),
        ]
        said: dict = {}  # reason -> the regions' methods it explains
        for name, region in regions:
            sparse_compile.reset_runtime_stats()
            with sparse_compile.sparsity(**region):  # the same compiled graph: no recompile
                out = compiled(tokens, last_only=True).float()
            densities = [s.mean_density for s in sparse_compile.runtime_stats().values() if s.mean_density is not None]
            density = sum(densities) / len(densities) if densities else float("nan")
            err = (out - reference).norm() / reference.norm()
            print(f"{name:24s} density {density:.3f}   logits error vs dense {err:.2e}")
            note = explain_density(sparse_compile.SparseConfig(**options, **region), args.seq_len, density)
            said.setdefault(note, []).append(name.split(",")[0].split(" ")[0])
            if note and len(said[note]) == 1:  # each reason once, where it first applies
                print("  " + note.replace("\n", "\n  "))
        for note, names in said.items():
            if note and len(names) > 1 and len(set(names)) > 1:  # a reason several methods share: name them
                print(f"  (the same holds for {', '.join(names[1:])})")


if __name__ == "__main__":
    main()
