"""Many transformers architectures (small configs, random weights): the rewrite finds their attention, and the
sparse path with every block kept reproduces eager logits. Traced by Dynamo and run without Inductor (fast)."""

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.rewrite import rewrite_graph

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, max_position_embeddings=512)
SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32}, sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16})


def _build(name):
    T = transformers
    small = dict(intermediate_size=128, num_hidden_layers=2, **COMMON)
    return {
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **small)),
        "phi3_head_dim_96": lambda: T.Phi3ForCausalLM(T.Phi3Config(hidden_size=192, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, **small)),
        "phi_head_dim_80": lambda: T.PhiForCausalLM(T.PhiConfig(hidden_size=160, num_attention_heads=2, **small)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, **small)),
        "gemma_mqa": lambda: T.GemmaForCausalLM(T.GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, **small)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=512, bos_token_id=0, eos_token_id=0)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, eos_token_id=0, **small)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64, **COMMON)),
    }[name]()


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.mark.parametrize("style", ["ids", "left_padded"])
@pytest.mark.parametrize("name", ["mistral", "phi3_head_dim_96", "phi_head_dim_80", "qwen3", "gemma_mqa", "gpt2",
                                  "gpt_neox", "opt"])
def test_architecture_keep_all_equals_eager(name, style):
    method = "s2o" if name in ("qwen3", "gpt2") else "pbs"  # the two permuting methods, one compile each
    try:
        model = _build(name).eval()
    except AttributeError:
        pytest.skip(f"{name} is not in this transformers version")
    records = []
    config = SparseConfig(method=method, **SMALL).keep_all()

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, config))
        return gm.forward

    ids = torch.randint(1, 128, (2, 70))
    kwargs = {}
    if style == "left_padded":
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][0, :9] = 0
    with torch.no_grad():
        ref = model(ids, **kwargs).logits
        out = torch.compile(model, backend=backend)(ids, **kwargs).logits
    assert records and all(r.rewritten for r in records), [r.reason for r in records]
    stats = sparse_compile.runtime_stats()
    assert stats and all(s.last_path == "sparse" for s in stats.values()), stats
    valid = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-5)
