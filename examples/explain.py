"""``sparse_compile.explain``: what the rewrite did to a transformers model, why, and the graph diff.

    python examples/explain.py
"""

from __future__ import annotations

import torch
import transformers

import sparse_compile


def main() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, 1500))
    # keep the first layer dense (a common choice), sparse from 1024 tokens on
    report = sparse_compile.explain(model, ids, config=sparse_compile.SparseConfig(min_seq_len=1024, skip_layers=(0,)))
    print(report)
    # the same, as data
    for row in report.rows():
        print(row["site"], row["run"], row["density"], row["reason"])


if __name__ == "__main__":
    main()
