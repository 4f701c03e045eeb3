"""Quickstart: compile a model with ``backend="sparse_prefill"`` and prefill a long prompt.

    python examples/quickstart.py                  # CPU: small model, 2K tokens (checks results, not speed)
    python examples/quickstart.py --seq-len 65536  # GPU: bf16, Triton kernels
    python examples/quickstart.py --method pbs     # any registered method

Prints how close the last-token logits are with sparsity on and off, what each attention site ran, and its
density: the share of the causal attention tiles the sparse path computed (1.0 = everything dense attention
computes). On a GPU it also prints the time of the compiled model with sparsity off and on. On the CPU the sparse
path runs the PyTorch reference executor, a specification rather than a fast path, so no speed is printed there.
"""

from __future__ import annotations

import argparse
import time

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


def timed(fn, *args, repeats=1):
    fn(*args)  # warm-up (and compile)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq-len", type=int, default=32768 if cuda else 2048)
    parser.add_argument("--method", default=sparse_compile.config.DEFAULT_METHOD,
                        choices=list(sparse_compile.registry.registered_methods()))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.seq_len < 1024:
        parser.error("--seq-len: at least 1024 (the example's min_seq_len: shorter prompts run dense)")

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = TinyDecoder(dim=1024 if cuda else 256, layers=args.layers, heads=8 if cuda else 4, kv_heads=2)
    model = model.to(device=device, dtype=dtype).eval()
    tokens = torch.randint(0, 256, (1, args.seq_len), device=device)

    # record_density costs a host sync per call; it is on here to show what each site did
    options = {"method": args.method, "min_seq_len": 1024, "record_density": True}
    compiled = torch.compile(model, backend="sparse_prefill", options=options)
    with torch.no_grad():
        with sparse_compile.sparsity(enabled=False):  # the same compiled graph, exact dense attention
            dense_logits, t_dense = timed(lambda x: compiled(x, last_only=True), tokens)
        sparse_compile.reset_runtime_stats()
        sparse_logits, t_sparse = timed(lambda x: compiled(x, last_only=True), tokens)

    err = (sparse_logits.float() - dense_logits.float()).norm() / dense_logits.float().norm()
    print(f"prompt {args.seq_len} tokens on {device} ({dtype}), method {args.method}")
    print(f"relative error of last-token logits, sparse vs dense: {err:.2e}")
    if cuda:
        print(f"dense: {t_dense * 1e3:8.1f} ms   sparse: {t_sparse * 1e3:8.1f} ms   speedup {t_dense / t_sparse:.2f}x")
    else:
        print("(CPU: the sparse path runs the PyTorch reference executor; time it on a GPU)")
    print("density: share of the causal attention tiles computed (1.0 = all of them, as dense attention)")
    densities = []
    for site, stats in sparse_compile.runtime_stats().items():
        density = f"{stats.mean_density:.3f}" if stats.mean_density is not None else "-"
        print(f"  {site:12s} {stats.last_path:6s} density {density}   ({stats.last_reason})")
        densities += [stats.mean_density] if stats.mean_density is not None else []
    note = explain_density(sparse_compile.SparseConfig(**options), args.seq_len,
                           sum(densities) / len(densities) if densities else None)
    if note:
        print(note)


if __name__ == "__main__":
    main()
