"""Sliding-window and chunked-local layers of transformers models (small configs, random weights): Mistral, Qwen2
(``use_sliding_window``), Gemma-3, Cohere2 and Llama-4's text model through the compiled path (traced by Dynamo, the
rewrite, no Inductor: fast), and those plus Gemma-2 and gpt-oss through the front door, as users call them (a
left-padded batch, ``generate()``). With the keep-everything setting the logits equal the model's own attention.

Every window / chunked layer must be counted sparse with its ``Local`` named in the reason, the global layers
without one.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.local import Local
from sparse_compile.rewrite import rewrite_graph

transformers = pytest.importorskip("transformers")

from test_attention_interface import SUPPORTED, assert_padded_logits_unchanged, before_and_after_keep_all  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")
needs_interface = pytest.mark.skipif(not SUPPORTED, reason="transformers has no AttentionMaskInterface")

W = 8  # every window and chunk size: the prompts are several times longer
SIZES = dict(vocab_size=128, max_position_embeddings=1024, intermediate_size=64, num_hidden_layers=2)
HEADS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SLIDING_FIRST = ["sliding_attention", "full_attention"]
KEEP_ALL = SparseConfig(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32}).keep_all()


def build(name: str, implementation: str = "sdpa", **extra):
    T = transformers
    makers = {
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**HEADS, **SIZES, sliding_window=W)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**HEADS, **SIZES, use_sliding_window=True, sliding_window=W,
                                                          max_window_layers=0, layer_types=SLIDING_FIRST)),
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**HEADS, **SIZES, sliding_window=W,
                                                                  layer_types=SLIDING_FIRST, query_pre_attn_scalar=20)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**HEADS, **SIZES, sliding_window=W,
                                                             layer_types=SLIDING_FIRST, **extra)),
        "cohere2": lambda: T.Cohere2ForCausalLM(T.Cohere2Config(**HEADS, **SIZES, sliding_window=W,
                                                                layer_types=SLIDING_FIRST)),
        "gpt_oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(**HEADS, **SIZES, sliding_window=W,
                                                              layer_types=SLIDING_FIRST, num_local_experts=2,
                                                              num_experts_per_tok=1)),
        "llama4": lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
            **HEADS, **SIZES, attention_chunk_size=W, intermediate_size_mlp=64, num_local_experts=1,
            no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"])),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = makers[name]().eval()
        except AttributeError:
            pytest.skip(f"{name} is not in transformers {transformers.__version__}")
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    elif model.config._attn_implementation != implementation:  # before 4.48 chosen at construction only
        pytest.skip(f"{name} built with {model.config._attn_implementation} attention in transformers "
                    f"{transformers.__version__}")
    return model


def chunks_from_first_valid_key() -> bool:
    """transformers counts Llama-4's chunks from each row's first valid key (its left padding); before, from key 0,
    which differs under left padding: such a layer then runs dense, with transformers' mask."""
    import inspect

    from transformers import masking_utils

    overlay = getattr(masking_utils, "chunked_overlay", None)
    return overlay is not None and len(inspect.signature(overlay).parameters) >= 2


# layer 0 is local in every model, layer 1 global (Mistral: both sliding)
LOCAL = {"mistral": {0: Local(window=W), 1: Local(window=W)}, "qwen2": {0: Local(window=W)},
         "gemma3": {0: Local(window=W)}, "gemma2": {0: Local(window=W)}, "cohere2": {0: Local(window=W)},
         "gpt_oss": {0: Local(window=W)}, "llama4": {0: Local(chunk=W)}}


def sparse_calls() -> dict:
    return {site: sum(n for (p, _), n in s.calls.items() if p == "sparse")
            for site, s in sparse_compile.runtime_stats().items()}


def layer_of(site: str) -> int:
    return int(site.split("layers.")[1].split(".")[0])


def local_layers(name: str) -> dict:
    """layer -> Local: Qwen2 before layer_types slides every layer from max_window_layers (0) on."""
    if name == "qwen2" and "layer_types" not in transformers.Qwen2Config().to_dict():
        return {0: Local(window=W), 1: Local(window=W)}
    return LOCAL[name]


def assert_local_layers_ran(name: str, calls_per_layer: int) -> None:
    """Each local layer ran sparse with its Local (named in the reasons), the global ones without one."""
    if name == "llama4" and not chunks_from_first_valid_key():
        return  # left-padded: dense (the reason is checked where the proof is)
    stats = sparse_compile.runtime_stats()
    for site, s in stats.items():
        local = local_layers(name).get(layer_of(site))
        sparse = [(r, n) for (p, r), n in s.calls.items() if p == "sparse"]
        if local is not None:
            assert sum(n for _, n in sparse) >= calls_per_layer, (site, s.calls)
            assert all(local.describe() in r for r, _ in sparse), (site, s.calls)
        else:
            assert not any("sliding window" in r or "chunks of" in r for r, _ in sparse), (site, s.calls)
    assert {layer_of(site) for site in stats} >= set(local_layers(name)), stats


def left_padded(batch: int, n: int) -> tuple:
    ids = torch.randint(1, 128, (batch, n))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3", "cohere2", "llama4"])
def test_compiled_local_layers_keep_all_equals_sdpa(name):
    """Left-padded batch, dynamic lengths: the window / chunks proven from the traced mask, named in the record."""
    model = build(name)
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, KEEP_ALL))
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (40, 53):
            ids, mask = left_padded(2, n)
            ref = model(ids, attention_mask=mask).logits
            out = compiled(ids, attention_mask=mask).logits
            valid = mask.bool()
            torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    by_layer = {layer_of(r.site): r for r in records}
    if name == "llama4" and not chunks_from_first_valid_key():
        assert not by_layer[0].rewritten and "with a padding mask" in by_layer[0].reason, by_layer[0].reason
        return
    for layer, local in local_layers(name).items():
        assert by_layer[layer].rewritten, by_layer[layer].reason
        assert f"causal mask AND {local.describe()} AND key padding proven from the graph" in by_layer[layer].reason
    assert_local_layers_ran(name, 2)


@needs_interface
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3", "cohere2", "llama4"])
def test_front_door_local_layers_keep_all_equals_sdpa(name):
    model = build(name)
    ids, mask = left_padded(2, 45)
    assert_padded_logits_unchanged(model, ids, mask, KEEP_ALL, tol=1e-4)
    assert_local_layers_ran(name, 1)


@needs_interface
@pytest.mark.parametrize("name", ["mistral", "llama4"])
def test_front_door_generate_with_a_window_gives_the_same_tokens(name):
    """generate(): a windowed / chunked prefill, then decode steps over the sliding cache (dense, each with its
    window; a chunked layer's cache offset puts its chunks elsewhere: transformers' mask)."""
    model = build(name)
    ids, mask = left_padded(2, 30)
    ref, out = before_and_after_keep_all(
        model, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), KEEP_ALL)
    assert torch.equal(out, ref)
    assert_local_layers_ran(name, 1)


@needs_interface
@pytest.mark.parametrize("name, why", [("gemma2", "attention logit soft-capping (50.0)"),
                                       ("gpt_oss", "attention sinks")])
def test_soft_capping_and_sinks_keep_the_eager_delegate_with_the_window(name, why):
    """What the sparse path lacks runs the model's eager attention with the mask the window layer needs."""
    model = build(name, "eager")
    ids, mask = left_padded(2, 40)
    assert_padded_logits_unchanged(model, ids, mask, KEEP_ALL, tol=1e-4)
    stats = sparse_compile.runtime_stats()
    assert all(sum(n for (p, _), n in s.calls.items() if p == "sparse") == 0 for s in stats.values()), stats
    assert all({r for (_, r) in s.calls} == {why} for s in stats.values()), {k: s.calls for k, s in stats.items()}


@needs_interface
def test_gemma2_without_soft_capping_runs_its_window():
    model = build("gemma2", "eager", attn_logit_softcapping=None)
    ids, mask = left_padded(2, 40)
    assert_padded_logits_unchanged(model, ids, mask, KEEP_ALL, tol=1e-4)
    assert_local_layers_ran("gemma2", 1)


@needs_interface
@pytest.mark.parametrize("name", ["mistral", "llama4"])
def test_front_door_chunked_prefill_over_a_sliding_cache(name):
    """A prompt prefilled in chunks of 16 over the model's cache (a sliding / chunked layer keeps only the keys its
    window or chunk can still see): every chunk runs with its Local; keys of a chunk no query is in are left out."""
    model = build(name)
    ids = torch.randint(1, 128, (1, 64))

    def chunked():
        cache, logits = None, []
        for s in range(0, 64, 16):  # the model makes its own cache, as generate() does
            out = model(ids[:, s:s + 16], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
        return torch.cat(logits, 1)

    ref, out = before_and_after_keep_all(model, chunked, KEEP_ALL)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert_local_layers_ran(name, 4)


@needs_interface
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_front_door_static_cache_generate_with_a_window(name):
    """A static cache: generate() builds the masks (made contiguous) and the model's forward builds them again from
    them (one mask type: Mistral) or takes them (several: Gemma-3); the same tokens, the prefill sparse."""
    model = build(name)
    ids, mask = left_padded(2, 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    ref, out = before_and_after_keep_all(model, lambda: model.generate(ids, **kwargs), KEEP_ALL)
    assert torch.equal(out, ref)
    assert_local_layers_ran(name, 1)
