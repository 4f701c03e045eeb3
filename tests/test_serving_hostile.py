"""The serving paths on inputs no other test names, against the model's own attention (keep-all configurations
must give dense results, each call counted once): ``varlen_attention`` over every method, dtype and GQA ratio with
empty, one-token and chunk-over-cache sequences, strided inputs and non-finite values in one sequence; the kernel
function with more queries than keys (transformers' unpadding at q_len 1 over a row that is all padding); chunked
prefill over a DynamicCache compiled and through the front door (chunk sizes that do not divide the prompt, chunk
size 1, a chunk after decode steps); and the kernels route (``serving_attention``) under continuous batching with
prompts longer than ``max_batch_tokens`` (a prefill split over steps), sliding-window layers (Mistral, Gemma-3), two
models of different configurations in one process, each call's output compared with dense attention inside the
batch.

The kernels route runs in a subprocess started outside the checkout, skipped with the reason where transformers
refuses the installed ``kernels`` (as ``test_continuous_batching.py`` does).
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import sparse_compile
from sparse_compile import pipeline
from sparse_compile import SparseConfig
from sparse_compile import serving
from sparse_compile.rules import prefill_length

from helpers import run_outside_the_checkout
from method_helpers import SMALL

transformers = pytest.importorskip("transformers")

PBS = dict(method="pbs", pbs={"block_size": 16, "segment_size": 32})


@pytest.fixture(autouse=True)
def _fresh_stats():
    sparse_compile.reset_runtime_stats()
    yield


def _total(path=None) -> int:
    return sum(n for s in sparse_compile.runtime_stats().values() for (p, _), n in s.calls.items()
               if path is None or p == path)


def _reference(q, k, v, cq, ck, scale=None):
    """Each sequence alone in float64, queries at the last positions of its keys (bottom-right: a query past the
    keys' count sees none and gives zeros)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].transpose(0, 1).double()
        ks, vs = (t[k0:k1].repeat_interleave(group, 1).transpose(0, 1).double() for t in (k, v))
        scores = qs @ ks.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        position = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        scores = scores.masked_fill(torch.arange(k1 - k0)[None] > position, float("-inf"))
        out[q0:q1] = torch.nan_to_num(scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _packed(q_lens, k_lens, hq, hkv, d=16, dtype=torch.float32):
    cq = list(itertools.accumulate([0] + q_lens))
    ck = list(itertools.accumulate([0] + k_lens))
    g = torch.Generator().manual_seed(0)
    return (torch.randn(cq[-1], hq, d, generator=g).to(dtype), torch.randn(ck[-1], hkv, d, generator=g).to(dtype),
            torch.randn(ck[-1], hkv, d, generator=g).to(dtype), cq, ck)


# an empty sequence with keys, a decode token, a prompt, a 3-token chunk over 150 keys, a chunk over a cache, a
# decode token over 40 keys, an empty one, a prompt of 77
Q_LENS = [0, 1, 200, 3, 130, 1, 0, 77]
K_LENS = [5, 1, 200, 150, 300, 40, 0, 77]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 3e-3, torch.bfloat16: 2e-2}


METHODS = ("pbs", "sampled", "peak", "sparge", "bfla", "s2o")


@pytest.mark.parametrize("method, dtype", [(m, torch.float32) for m in METHODS]
                         + [("pbs", torch.float16), ("s2o", torch.float16)], ids=str)
def test_varlen_attention_is_dense_at_keep_all_for_every_method(method, dtype):
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, 6, 2, dtype=dtype)
    config = SparseConfig(method=method, min_seq_len=4, **SMALL).keep_all()
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq, dtype=torch.int32), torch.tensor(ck),
                                          config=config)
    assert out.dtype == dtype and out.shape == (cq[-1], 6, 16)
    assert (out.double() - _reference(q, k, v, cq, ck)).abs().max().item() < TOLERANCE[dtype]
    assert _total() == 6  # every non-empty sequence is one call
    # the prompts run the method; s2o takes only full prefills (Nq == Nk): the chunks run dense, said so
    assert _total("sparse") == (2 if method == "s2o" else 4)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=lambda h: f"gqa{h[0] // h[1]}")
def test_varlen_attention_in_float64_is_exact_and_says_why_dense(heads):
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, *heads, dtype=torch.float64)
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck),
                                          config=SparseConfig(**PBS, min_seq_len=4).keep_all())
    assert out.dtype == torch.float64
    assert (out - _reference(q, k, v, cq, ck)).abs().max().item() < 1e-12
    said = {r for s in sparse_compile.runtime_stats().values() for (p, r) in s.calls}
    assert any(r.startswith("dtype torch.float64 not supported") for r in said) and _total("sparse") == 0


@pytest.mark.parametrize("entry", ["varlen_attention", "kernel"])
def test_strided_inputs_and_a_non_finite_sequence_stay_in_their_sequence(entry, monkeypatch):
    config = SparseConfig(**PBS, min_seq_len=4).keep_all()
    monkeypatch.setenv(serving.CONFIG_VARIABLE, config.to_json())
    q, k, v, cq, ck = _packed([200, 3, 130, 1], [200, 150, 300, 40], 4, 2)
    clean = _reference(q, k, v, cq, ck)
    # (H, T, D) storage seen as (T, H, D): no input contiguous
    q, k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    k[ck[1] + 5, 0, 3] = float("nan")  # in sequence 1
    v[ck[2] + 7, 1, 2] = float("inf")  # in sequence 2

    def run(*tensors):
        if entry == "kernel":
            return serving.flash_attn_varlen_func(*tensors, torch.tensor(cq), torch.tensor(ck), causal=True)
        return sparse_compile.varlen_attention(*tensors, torch.tensor(cq), torch.tensor(ck), config=config)

    out = run(q, k, v)
    for s in (0, 3):  # the sequences without a non-finite value
        rows = slice(cq[s], cq[s + 1])
        assert (out[rows].double() - clean[rows]).abs().max().item() < 1e-5


def test_the_kernel_takes_more_queries_than_keys_as_flash_attention_does(monkeypatch):
    """transformers unpads a q_len-1 call as one query per row and the row's valid keys: a row that is all padding
    so far (a left-padded batch whose chunked prefill reached none of its tokens) is one query over no keys, and
    FlashAttention (bottom-right alignment) gives a query that sees no key zeros. A ValueError here broke the
    whole forward pass."""
    monkeypatch.setenv(serving.CONFIG_VARIABLE, SparseConfig(**PBS, min_seq_len=4).keep_all().to_json())
    q, k, v, cq, ck = _packed([1, 1, 120, 9], [51, 0, 100, 6], 4, 2)
    out = serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq, dtype=torch.int32),
                                         torch.tensor(ck, dtype=torch.int32), causal=True)
    expect = _reference(q, k, v, cq, ck)
    assert (out.double() - expect).abs().max().item() < 1e-5
    assert torch.equal(out[1:2], torch.zeros_like(out[1:2]))  # no keys: zeros
    assert torch.equal(out[2:22], torch.zeros_like(out[2:22]))  # the first 20 of 120 queries over 100 keys
    assert torch.equal(out[122:125], torch.zeros_like(out[122:125]))  # and 3 of 9 over 6
    stats = sparse_compile.runtime_stats()["varlen_attention"].calls
    assert sum(stats.values()) == 3  # the query over no keys computes nothing, recorded nothing
    assert sum(n for (p, _), n in stats.items() if p == "sparse") == 2  # 100 queries over 100 keys, 6 over 6
    # not causal: every key, the dense reference
    out = serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq), torch.tensor(ck), causal=False)
    assert torch.isfinite(out).all() and torch.equal(out[1:2], torch.zeros_like(out[1:2]))


# -- chunked prefill over a DynamicCache ---------------------------------------------------------------------------
def _llama(layers=2):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=4096, intermediate_size=128, num_hidden_layers=layers)).eval()


def _chunked(model, ids, sizes):
    cache = transformers.DynamicCache()
    out, start = [], 0
    for n in sizes:
        out.append(model(ids[:, start:start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1)


def _expected_sparse(sizes, min_seq_len) -> int:
    """Chunks the rules send sparse: more than one query and a prefill length (``rules.prefill_length``) of at
    least ``min_seq_len``."""
    start, n = 0, 0
    for size in sizes:
        n += size > 1 and prefill_length(size, start + size) >= min_seq_len
        start += size
    return n


def _run_chunks(path, sizes, min_seq_len):
    model = _llama()
    ids = torch.randint(1, 128, (1, sum(sizes)), generator=torch.Generator().manual_seed(1))
    config = SparseConfig(**PBS, min_seq_len=min_seq_len).keep_all()
    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        if path == "compiled":
            run = torch.compile(model, backend="sparse_prefill", options=config)
        else:
            run = sparse_compile.enable_transformers_attention(model, config)
        out = _chunked(run, ids, sizes)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    layers = 2
    assert _total() == layers * len(sizes)  # every chunk of every layer is one call
    assert _total("sparse") == layers * _expected_sparse(sizes, min_seq_len), sparse_compile.runtime_stats()


needs_interface = pytest.mark.skipif(not sparse_compile.transformers_attention.register(),
                                     reason="transformers has no AttentionMaskInterface")


@pytest.mark.parametrize("path, sizes, min_seq_len", [
    # chunks that do not divide the prompt, the first two too short (compiled: three Dynamo compiles, 20 s on a CPU;
    # test_serving.py runs chunks compiled)
    pytest.param("front door", [37, 37, 37, 39], 80, marks=needs_interface),
    pytest.param("front door", [1, 1, 1, 40, 1, 56], 40, marks=needs_interface),  # one-token chunks between
])
def test_chunked_prefill_runs_each_chunk_by_the_length_rule(path, sizes, min_seq_len):
    _run_chunks(path, sizes, min_seq_len)


@pytest.mark.parametrize("path", [pytest.param("front door", marks=needs_interface), "compiled"])
def test_a_chunk_after_decode_steps_runs_sparse_on_every_layer(path):
    """A chat's next turn: at Dynamo's third compile the query length is dynamic too, and the mask, built once from
    layer 0's cache, meets each later layer's keys sized by that layer's own cache (masks._prefix_aliases)."""
    _run_chunks(path, [60, 1, 89], 50)


# -- the kernels route under continuous batching, in a subprocess -------------------------------------------------
CHILD = r"""
import json, math, sys, warnings
import torch, transformers
import sparse_compile
from sparse_compile import SparseConfig, serving
from transformers.utils import import_utils

if not import_utils.is_kernels_available():
    print(json.dumps({"skip": f"transformers {transformers.__version__} does not accept the installed kernels"}))
    sys.exit(0)

# every sequence the kernel runs by the package's rules, and every dense reference, checked against float64
# attention of that sequence alone (queries at the last positions, the window where it binds)
seen = {"segments": 0, "references": 0, "error": 0.0}
attend_segments, reference = serving.attend_segments, serving._reference


def exact(q, k, v, scale, window):
    qf, kf, vf = (t.double().transpose(0, 1) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(qf.shape[0] // kf.shape[0], 0) for t in (kf, vf))
    scores = qf @ kf.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    nq, nk = q.shape[0], k.shape[0]
    rel = torch.arange(nq)[:, None] + nk - nq - torch.arange(nk)[None]
    keep = (rel >= 0) & ((rel <= window) if window >= 0 else True)
    return torch.nan_to_num(scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vf).transpose(0, 1)


def checked_segments(q4, k4, v4, scale, config, site, segments, note=""):
    out = attend_segments(q4, k4, v4, scale, config, site, segments, note)
    for q0, q1, k0, k1 in segments:
        seen["segments"] += 1
        want = exact(q4[0, :, q0:q1].transpose(0, 1), k4[0, :, k0:k1].transpose(0, 1),
                     v4[0, :, k0:k1].transpose(0, 1), scale, -1)
        seen["error"] = max(seen["error"], (out[0, :, q0:q1].transpose(0, 1).double() - want).abs().max().item())
    return out


def checked_reference(q, k, v, scale, causal, window, *rest):
    out = reference(q, k, v, scale, causal, window, *rest)
    seen["references"] += 1
    seen["error"] = max(seen["error"], (out.double() - exact(q, k, v, scale, window[0])).abs().max().item())
    return out


serving.attend_segments, serving._reference = checked_segments, checked_reference
PBS = dict(method="pbs", pbs={"block_size": 16, "segment_size": 32})
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16,
             max_position_embeddings=4096, intermediate_size=128, num_hidden_layers=2)


def build(kind, **extra):
    torch.manual_seed(0)
    T = transformers
    config = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig,
              "gemma3": T.Gemma3TextConfig}[kind](**SIZES, **extra)
    model = {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM, "mistral": T.MistralForCausalLM,
             "gemma3": T.Gemma3ForCausalLM}[kind](config)
    return model.eval()


def serve(name, kind, config, max_batch_tokens, lens=(300, 40, 170), new=3, extra={}):
    model = build(kind, **extra)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in lens]
    steps = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    small = transformers.ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=max_batch_tokens)
    ref = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    sparse_compile.serving_attention(model, config)
    sparse_compile.reset_runtime_stats()
    seen.update(segments=0, references=0, error=0.0)
    out = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    result[name] = {
        "same": len(out) == len(ref) and all(out[r].generated_tokens == ref[r].generated_tokens for r in ref),
        "calls": {site: [[p, r, n] for (p, r), n in s.calls.items()]
                  for site, s in sparse_compile.runtime_stats().items()},
        **seen}
    return model, prompts, steps, small, ref


result = {}
keep_all = SparseConfig(**PBS, min_seq_len=64).keep_all()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # prompts of 300 and 170 tokens over steps of at most 128 tokens: each prefill split over steps
    serve("chunked", "llama", keep_all, 128)
    serve("qwen2", "qwen2", keep_all, 512)
    serve("mistral", "mistral", keep_all, 100, extra={"sliding_window": 64})
    serve("gemma3", "gemma3", keep_all, 100,
          extra={"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]})
    # two models, two configurations, one process: each layer runs its own model's
    a = serve("first", "llama", SparseConfig(**PBS, min_seq_len=30).keep_all(), 512, lens=(200, 40), new=2)
    b = serve("second", "qwen2", SparseConfig(method="sampled", min_seq_len=300).keep_all(), 512, lens=(200, 40),
              new=2)
    sparse_compile.reset_runtime_stats()
    out = a[0].generate_batch(a[1], generation_config=a[2], continuous_batching_config=a[3])
    result["first again"] = {
        "same": all(out[r].generated_tokens == a[4][r].generated_tokens for r in a[4]),
        "calls": {site: [[p, r, n] for (p, r), n in s.calls.items()]
                  for site, s in sparse_compile.runtime_stats().items()}}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def route(tmp_path_factory):
    result = run_outside_the_checkout(CHILD, where=tmp_path_factory.mktemp("outside_the_checkout"), timeout=300)
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def _by_site(calls: dict) -> dict:
    """site -> (sparse, dense, decode, windowed) counts."""
    out = {}
    for site, rows in calls.items():
        sparse = sum(n for p, _, n in rows if p == "sparse")
        decode = sum(n for p, r, n in rows if r == "decode step (q_len == 1)")
        windowed = sum(n for p, r, n in rows if r.startswith("sliding window 63 shorter than the"))
        out[site] = (sparse, sum(n for p, _, n in rows) - sparse, decode, windowed)
    return out


LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def test_a_prefill_split_over_batching_steps_is_exact_and_sparse_per_chunk(route):
    run = route["chunked"]
    assert run["same"] and run["error"] < 1e-5, run
    # each layer: the 300-token prompt in 3 steps' chunks and the 170 in 2 (all long enough), the 40-token prompt
    # dense (too short), 2 decode tokens per request: every chunk a call of its own, each checked
    assert run["segments"] == 2 * (5 + 1 + 6) and run["references"] == 0
    assert _by_site(run["calls"]) == {site: (5, 7, 6, 0) for site in LAYERS}, run["calls"]


def test_gqa_without_a_window_runs_sparse(route):
    run = route["qwen2"]
    assert run["same"] and run["error"] < 1e-5, run
    assert _by_site(run["calls"]) == {site: (2, 7, 6, 0) for site in LAYERS}, run["calls"]


@pytest.mark.parametrize("model", ["mistral", "gemma3"])
def test_a_window_that_binds_is_exact_and_counted_per_chunk(route, model):
    run = route[model]
    assert run["same"] and run["error"] < 1e-5, run
    sites = _by_site(run["calls"])
    # steps of 100 tokens: 4 chunks of the 300-token prompt, 2 of the 170, 1 of the 40 (the sliding layer reads
    # the last 63 cached keys and the chunk): 7 prefill calls a layer; a window of 64 binds on 5 of them
    assert sites["model.layers.0.self_attn"] == (0, 13, 6, 5), run["calls"]
    if model == "gemma3":  # layer 1 is full attention: its long chunks run the method
        assert sites["model.layers.1.self_attn"] == (5, 8, 6, 0), run["calls"]
    else:
        assert sites["model.layers.1.self_attn"] == (0, 13, 6, 5), run["calls"]
    assert run["references"] == (2 * 5 if model == "mistral" else 5)


def test_two_models_keep_their_own_configurations(route):
    first, second, again = route["first"], route["second"], route["first again"]
    assert first["same"] and second["same"] and again["same"]
    assert _by_site(first["calls"]) == {site: (2, 2, 2, 0) for site in LAYERS}  # min_seq_len 30: both prompts
    assert _by_site(second["calls"]) == {site: (0, 4, 2, 0) for site in LAYERS}  # min_seq_len 300: neither
    assert _by_site(again["calls"]) == {site: (2, 2, 2, 0) for site in LAYERS}  # the second did not replace it


# -- continuous batching on a model compiled in place ----------------------------------------------------------------
def test_a_packed_step_whose_sequence_is_windowed_is_one_call_per_sequence():
    """Continuous batching's mask for a sliding-window layer: each request's chunk sees its keys causally AND a
    window. A step that a compiled Mistral's generate_batch made (window 64, max_batch_tokens 100): two decode
    tokens over 63 and 40 cached keys, then a 98-token chunk over 157 keys (59 cached) whose window binds."""
    from sparse_compile.runtime_mask import check_runtime_mask

    window, spans = 64, ((1, 64), (1, 41), (98, 157))
    nq, nk = sum(q for q, _ in spans), sum(k for _, k in spans)
    allowed = torch.zeros(nq, nk, dtype=torch.bool)
    q0 = k0 = 0
    for q_len, k_len in spans:
        rel = torch.arange(q_len)[:, None] + (k_len - q_len) - torch.arange(k_len)[None]
        allowed[q0:q0 + q_len, k0:k0 + k_len] = (rel >= 0) & (rel < window)
        q0, k0 = q0 + q_len, k0 + k_len
    mask = torch.zeros(1, 1, nq, nk).masked_fill(~allowed, torch.finfo(torch.float32).min)
    verdict = check_runtime_mask(mask, 1, 4, nq, nk, local=True)
    rows = verdict.segments
    assert rows, verdict.reason
    assert sum(row[1] - row[0] for row in rows) == nq  # every query in some sequence, exact either way
    assert len(rows) == len(spans), rows[:6]  # one call per request
    assert [row[4:] for row in rows] == [(), (), (window,)]  # the chunk whose window binds carries it
    # and run through the op's pipeline: each sequence its own call, equal to dense SDPA with the mask
    q = torch.randn(1, 4, nq, 16, dtype=torch.float64)
    k, v = torch.randn(1, 4, nk, 16, dtype=torch.float64), torch.randn(1, 4, nk, 16, dtype=torch.float64)
    config = SparseConfig(**PBS, min_seq_len=32).keep_all()
    sparse_compile.reset_runtime_stats()
    out = pipeline.attend_segments(q.float(), k.float(), v.float(), None, config, "packed", rows)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    stats = sparse_compile.runtime_stats()["packed"]
    assert sum(stats.calls.values()) == 3, dict(stats.calls)
    assert any("sliding window 64" in reason for (path, reason) in stats.calls if path == "sparse"), dict(stats.calls)



def test_skip_layers_under_continuous_batching_compiled_warn_that_they_cannot_apply():
    """Compiled continuous batching compiles transformers' paged attention function alone (under
    torch.compiler.disable the decoder is not traced): its site has no module path and so no layer. skip_layers
    cannot reach it, and the backend says so rather than run the skipped layer sparse in silence; the kernels route
    (serving_attention) keeps each layer's site and applies them (test_continuous_batching.py)."""
    model = _llama()
    prompts = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(1)).tolist() for n in (90, 70)]
    steps = transformers.GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
        model.compile(backend="sparse_prefill",
                      options=SparseConfig(**PBS, min_seq_len=32, skip_layers=(1,)).keep_all())
        model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    said = [str(w.message) for w in caught if "have no module path" in str(w.message)]
    assert said and "serving_attention" in said[0], [str(w.message) for w in caught]
    assert _total() == 2  # both prompts in one packed step: one call per layer, each counted
