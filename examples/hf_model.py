"""A transformers model compiled with ``backend="sparse_prefill"``: no change to the model's code.

    python examples/hf_model.py                # CPU: a small Llama from a config (random weights)
    python examples/hf_model.py --arch qwen2   # another architecture
    python examples/hf_model.py --seq-len 65536 --full-size   # GPU: Llama-3.1-8B shapes, bf16
    python examples/hf_model.py --generate     # generate() on a left-padded batch, as a tokenizer pads it
    python examples/hf_model.py --seq-len 1024 --layers 2   # smaller and faster (CPU)

Builds the model from a config (no download), prefills one prompt with the compiled model, and compares the
last-token logits with sparsity on and off. With ``--generate``, compiles the module in place
(``model.compile``: ``torch.compile(model).generate`` would compile nothing) and generates from two prompts of
different lengths, left-padded with their ``attention_mask``: the prefill runs sparse, decode steps dense.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import sparse_compile
from density_note import explain_density

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


MIN_SEQ_LEN = 1024  # the example's: shorter prompts run dense (the package default, 16384, suits GPUs)


def build(arch: str, full_size: bool, device: str, dtype: torch.dtype, layers: int):
    config_cls, model_cls = ARCHS[arch]
    if full_size:  # Llama-3.1-8B shapes
        sizes = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
    else:
        sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
    config = config_cls(max_position_embeddings=131072, **sizes)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = model_cls(config).to(dtype).eval()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--seq-len", type=int, default=32768 if cuda else 2048)
    parser.add_argument("--method", default=sparse_compile.config.DEFAULT_METHOD,
                        choices=list(sparse_compile.registry.registered_methods()))
    parser.add_argument("--full-size", action="store_true", help="Llama-3.1-8B shapes (GPU)")
    parser.add_argument("--generate", action="store_true", help="generate() on a left-padded batch")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the small model (default 4)")
    args = parser.parse_args()
    shortest = args.seq_len * 3 // 4 if args.generate else args.seq_len  # --generate pads a quarter of one row
    if shortest < MIN_SEQ_LEN:
        parser.error(f"--seq-len: the prompts must reach the example's min_seq_len {MIN_SEQ_LEN} to run sparse "
                     f"(with --generate the shorter prompt is 3/4 of --seq-len)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    model = build(args.arch, args.full_size, device, dtype, args.layers)
    ids = torch.randint(1, model.config.vocab_size, (1, args.seq_len), device=device)
    if args.generate:
        generate(model, ids, args.method)
        return

    # record_density costs a host sync per call; it is on here to show what each site did
    options = {"method": args.method, "min_seq_len": MIN_SEQ_LEN, "skip_layers": (0,), "record_density": True}
    compiled = torch.compile(model, backend="sparse_prefill", options=options)
    with torch.no_grad():
        for enabled in (False, True):
            with sparse_compile.sparsity(enabled=enabled):
                compiled(ids, logits_to_keep=1)  # warm-up / compile
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                logits = compiled(ids, logits_to_keep=1).logits.float()
                if cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
            if not enabled:
                dense = logits
            # on the CPU the sparse path runs the PyTorch reference executor: a check of results, not of speed
            timing = f"{elapsed * 1e3:.1f} ms" if cuda else "(CPU: not timed)"
            print(f"{args.arch} {args.seq_len} tokens, sparsity {'on (' + args.method + ')' if enabled else 'off'}: "
                  f"{timing}")
    err = (logits - dense).norm() / dense.norm()
    stats = sparse_compile.runtime_stats()
    densities = [s.mean_density for s in stats.values() if s.mean_density is not None]
    density = sum(densities) / len(densities) if densities else None
    shown = f"{density:.3f}" if density is not None else "-"
    print(f"relative error of last-token logits, sparse vs dense: {err:.2e} at mean density {shown} of the sparse "
          f"sites (layer 0 kept dense), {args.seq_len} tokens on {device}")
    # what this run measured, not a prediction: random weights attend almost uniformly, so every skipped tile held
    # real weight and the error grows as the density falls; trained weights concentrate attention
    if density is not None and density < 0.99:
        print("(random weights: each skipped tile held real attention weight, so the error grows as the density "
              "falls;\n on trained weights the loss is what the README's method table measures)")
    note = explain_density(sparse_compile.SparseConfig(**options), args.seq_len, density)
    if note:
        print(note)
    print(stats)


def generate(model, ids, method: str) -> None:
    batch = ids.repeat(2, 1)
    mask = torch.ones_like(batch)
    mask[1, : ids.shape[1] // 4] = 0  # the shorter prompt, left-padded as tokenizers pad for generation
    batch[1, : ids.shape[1] // 4] = 0
    model.compile(backend="sparse_prefill", options={"method": method, "min_seq_len": MIN_SEQ_LEN})
    sparse_compile.reset_runtime_stats()
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    print("generated:", out[:, ids.shape[1]:].tolist())
    calls = {path: 0 for path in ("sparse", "dense")}
    for stats in sparse_compile.runtime_stats().values():
        for (path, _), count in stats.calls.items():
            calls[path] = calls.get(path, 0) + count
    print(f"attention calls: {calls['sparse']} sparse (the prefill of both prompts, once per site), {calls['dense']} "
          "dense (the decode steps: one query each)")
    print(sparse_compile.runtime_stats())


if __name__ == "__main__":
    main()
