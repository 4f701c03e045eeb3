"""``sparse_compile.explain``: what the rewrite did to a transformers model, why, and the graph diff.

    python examples/explain.py                  # a 3-layer Llama (random weights), 4,096 tokens, on the CPU
    python examples/explain.py --seq-len 1024   # shorter and faster: the tiles every plan keeps are all of them

Prints the per-site table (what the rewrite did, what the call ran, why, its density), the graph diff, the same
as data, and why the densities are as high as they are (``density_note.py``).
"""

from __future__ import annotations

import argparse

import torch
import transformers

import sparse_compile
from density_note import explain_density


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    # keep the first layer dense (a common choice), sparse from 1024 tokens on
    config = sparse_compile.SparseConfig(min_seq_len=1024, skip_layers=(0,))
    if args.seq_len < config.min_seq_len:
        parser.error(f"--seq-len: at least {config.min_seq_len} (the example's min_seq_len: shorter prompts run "
                     "dense)")
    torch.manual_seed(0)
    model_config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=max(8192, args.seq_len))
    model_config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(model_config).eval()
    ids = torch.randint(0, 1000, (1, args.seq_len))
    report = sparse_compile.explain(model, ids, config=config)
    print(report)
    # the same, as data
    densities = []
    for row in report.rows():
        print(row["site"], row["run"], row["density"], row["reason"])
        if row["run"] == "sparse" and row["density"] not in (None, "", "-"):
            densities.append(float(row["density"]))
    note = explain_density(config, args.seq_len, sum(densities) / len(densities) if densities else None)
    if note:
        print(note)


if __name__ == "__main__":
    main()
