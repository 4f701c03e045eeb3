"""Quickstart: compile a model with ``backend="sparse_prefill"`` and prefill a long prompt.

    python examples/quickstart.py                 # CPU: small model, 2K tokens, PyTorch reference executor
    python examples/quickstart.py --seq-len 65536 # GPU: bf16, Triton kernels

Prints the time of the compiled model with sparsity off (exact dense attention) and on, how close the
last-token logits are, and what each attention site ran, with its density.
"""

from __future__ import annotations

import argparse
import time

import torch

import sparse_compile
from model import ModelArgs, Transformer


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
    parser.add_argument("--method", default="pbs", choices=["pbs", "sparge", "bfla", "s2o"])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model_args = ModelArgs(dim=1024 if cuda else 256, n_heads=8 if cuda else 4, n_kv_heads=2, n_layers=args.layers,
                           intermediate_size=2048 if cuda else 512)
    model = Transformer(model_args).to(device=device, dtype=dtype).eval()
    tokens = torch.randint(0, model_args.vocab_size, (1, args.seq_len), device=device)

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
    print(f"dense: {t_dense * 1e3:8.1f} ms   sparse: {t_sparse * 1e3:8.1f} ms   speedup {t_dense / t_sparse:.2f}x   "
          f"relative error of last-token logits: {err:.2e}")
    for site, stats in sparse_compile.runtime_stats().items():
        density = f"{stats.mean_density:.3f}" if stats.mean_density is not None else "-"
        print(f"  {site:24s} {stats.last_path:6s} density {density}   ({stats.last_reason})")


if __name__ == "__main__":
    main()
