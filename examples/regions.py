"""One compiled model, different sparsity per region of code, chosen at run time (no recompile).

    python examples/regions.py                  # CPU: 2,048 tokens; GPU: 16,384
    python examples/regions.py --seq-len 8192   # longer: the tiles every plan keeps are a smaller share

Prints, per region, the density (the share of the causal attention tiles computed, 1.0 = dense), how far the
last-token logits are from dense attention's, and why a density is as high as it is where that is the tiles every
plan keeps or random weights (``density_note.py``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from density_note import explain_density


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention (GQA) and an MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        q, k, v = self.qkv(self.attention_norm(x)).split(sizes, dim=-1)
        q = q.view(B, N, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        # the call sparse_prefill rewrites: causal SDPA, no mask, K/V with fewer heads than Q
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, N, -1))
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    """A small decoder-only language model (random weights); nothing in it knows about sparse_compile."""

    def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x[:, -1:] if last_only else x)


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
