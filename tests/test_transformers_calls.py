"""transformers models as users call them, whole-model compiled: every attention site must run sparse.

The compatibility suite: CI runs it on the latest transformers and on older families (``.ci/run``). The models
are traced by Dynamo and rewritten by the real pass; most tests execute the rewritten graph without Inductor (the
rewrite and the op are what differ between versions; Inductor is exercised in test_end_to_end.py).

Call styles: ``model(ids)``, ``model(ids, attention_mask=ones)`` (what a tokenizer returns),
``model(ids, use_cache=False)``, a left-padded batch, a right-padded batch, and the prefill of ``generate()``.
With every method's keep-everything setting the logits equal eager (valid positions for padded batches) and the
generated tokens are identical. ``runtime_stats()`` counts the sparse calls.
"""

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.rewrite import rewrite_graph

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16, "local_tiles": 1,
                   "stride": 4},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16})
SIZES = dict(vocab_size=128, max_position_embeddings=1024, intermediate_size=128, num_hidden_layers=2)
LAYERS = SIZES["num_hidden_layers"]


def tiny(name: str, **extra):
    T = transformers
    build = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                          num_key_value_heads=2, **SIZES, **extra)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=64, num_attention_heads=4,
                                                          num_key_value_heads=2, **SIZES, **extra)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(hidden_size=64, num_attention_heads=4,
                                                                num_key_value_heads=2, **SIZES, **extra)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                                          head_dim=16, **SIZES, **extra)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                       pad_token_id=0, **SIZES, **extra)),
    }[name]
    model = build()
    model.config._attn_implementation = "sdpa"
    return model.eval()


class Recorder:
    """A backend that runs the real rewrite and executes the rewritten graph (no Inductor: fast)."""

    def __init__(self, config: SparseConfig):
        self.config = config
        self.records = []

    def __call__(self, gm, example_inputs):
        self.records.extend(rewrite_graph(gm, self.config))
        return gm.forward

    def prefill_records(self):
        return [r for r in self.records if r.q_shape and r.q_shape[2] > 1]


def sparse_calls() -> dict:
    return {site: sum(n for (path, _), n in s.calls.items() if path == "sparse")
            for site, s in sparse_compile.runtime_stats().items()}


def padded(ids: torch.Tensor, side: str) -> torch.Tensor:
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :7] = 0
    else:
        mask[0, -9:] = 0
    mask[-1, :] = 1
    return mask


CALL_STYLES = {
    "ids": lambda ids: {},
    "ones_mask": lambda ids: {"attention_mask": torch.ones_like(ids)},
    "no_cache": lambda ids: {"use_cache": False},
    "left_padded": lambda ids: {"attention_mask": padded(ids, "left")},
    "right_padded": lambda ids: {"attention_mask": padded(ids, "right")},
}
MODELS = ("llama", "qwen2", "mistral", "gemma", "phi3")


@pytest.mark.parametrize("style", list(CALL_STYLES))
@pytest.mark.parametrize("name", MODELS)
def test_every_site_sparse_and_keep_all_equals_eager(name, style):
    model = tiny(name)
    ids = torch.randint(1, 128, (2, 70))
    kwargs = CALL_STYLES[style](ids)
    method = "s2o" if name in ("qwen2", "phi3") else "pbs"  # the two permuting methods: the strictest plans
    backend = Recorder(SparseConfig(method=method, **SMALL).keep_all())
    with torch.no_grad():
        ref = model(ids, **kwargs).logits
        out = torch.compile(model, backend=backend)(ids, **kwargs).logits
    records = backend.prefill_records()
    assert len(records) == LAYERS and all(r.rewritten for r in records), [r.reason for r in records]
    assert sparse_calls() == {r.site: 1 for r in records}, sparse_compile.runtime_stats()
    valid = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_generate_prefill_sparse_decode_dense_same_tokens(name):
    """Through ``model.compile(backend=..., options=...)``: prefill sparse, decode dense, tokens as eager."""
    model = tiny(name)
    ids = torch.randint(1, 128, (2, 64))
    mask = padded(ids, "left")
    backend = Recorder(SparseConfig(**SMALL).keep_all())
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        model.compile(backend=backend)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    records = backend.prefill_records()
    assert len(records) == LAYERS and all(r.rewritten for r in records), [r.reason for r in records]
    assert sparse_calls() == {r.site: 1 for r in records}  # once per layer: the prefill


def test_generate_through_compiled_forward_and_tokenizer_style_mask():
    model = tiny("llama")
    ids = torch.randint(1, 128, (1, 80))
    backend = Recorder(SparseConfig(method="bfla", **SMALL).keep_all())
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        model.forward = torch.compile(model.forward, backend=backend)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    assert set(sparse_calls().values()) == {1} and len(sparse_calls()) == LAYERS


def test_dynamic_shapes_one_graph_many_lengths_and_paddings():
    model = tiny("llama")
    backend = Recorder(SparseConfig(**SMALL).keep_all())
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (40, 57):
            ids = torch.randint(1, 128, (3, n))
            mask = torch.ones_like(ids)
            mask[0, :5] = 0
            mask[1, n - 4:] = 0
            mask[2, 10:13] = 0  # a hole: the row is gathered
            ref = model(ids, attention_mask=mask).logits
            out = compiled(ids, attention_mask=mask).logits
            valid = mask.bool()
            torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert len(backend.prefill_records()) == LAYERS  # one graph for both lengths
    assert set(sparse_calls().values()) == {2}


# -- masks that must stay dense -----------------------------------------------------------------------------------
def test_sliding_window_shorter_than_the_prompt_stays_dense():
    model = tiny("mistral", sliding_window=24)
    ids = torch.randint(1, 128, (1, 70))
    backend = Recorder(SparseConfig(**SMALL))
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, backend=backend)(ids).logits
    records = backend.prefill_records()
    if all(r.rewritten for r in records):
        pytest.skip("this transformers version ignores sliding_window for Mistral with SDPA")  # pragma: no cover
    assert records and not any(r.rewritten for r in records)
    assert all("not proven causal" in r.reason for r in records), [r.reason for r in records]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_sliding_window_longer_than_the_prompt_is_causal():
    model = tiny("mistral", sliding_window=4096)
    ids = torch.randint(1, 128, (1, 70))
    backend = Recorder(SparseConfig(**SMALL))
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    assert all(r.rewritten for r in backend.prefill_records())


def test_packed_documents_run_each_on_its_own():
    """transformers 5.x (with use_cache=False) splits documents where position ids restart: each runs on its own."""
    model = tiny("llama")
    ids = torch.randint(1, 128, (1, 64))
    position_ids = torch.cat([torch.arange(30), torch.arange(34)])[None]
    backend = Recorder(SparseConfig(**SMALL).keep_all())
    with torch.no_grad():
        ref = model(ids, position_ids=position_ids, use_cache=False).logits
        out = torch.compile(model, backend=backend)(ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    records = backend.prefill_records()
    if all("a function of sizes only" in r.reason for r in records):
        pytest.skip("this transformers version does not build a packed-document mask")
    assert records and all(r.rewritten and "documents packed in each row" in r.reason for r in records), \
        [r.reason for r in records]


def test_padding_mask_with_its_own_length_symbol_is_proven():
    """Views whose storage offset equals their length make Dynamo trace the mask's length as its own symbol."""
    model = tiny("llama")
    ids = torch.randint(1, 128, (2, 70))
    mask = torch.ones_like(ids)
    mask[0, :40] = 0
    positions = torch.arange(70).expand(2, 70)
    backend = Recorder(SparseConfig(**SMALL).keep_all())
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        compiled(ids.narrow(1, 35, 35), position_ids=positions.narrow(1, 35, 35))
        args = dict(attention_mask=mask.narrow(1, 35, 35), position_ids=positions.narrow(1, 35, 35))
        out = compiled(ids.narrow(1, 35, 35), **args).logits
        ref = model(ids.narrow(1, 35, 35), **args).logits
    assert all(r.rewritten for r in backend.prefill_records()), [r.reason for r in backend.prefill_records()]
    valid = mask.narrow(1, 35, 35).bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
