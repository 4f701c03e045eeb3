"""How servers call attention: chunked prefill over a growing cache (compiled and through the front door),
transformers' continuous batching (``generate_batch``: packed sequences behind a block-diagonal mask), the varlen
entry, and regions that do not reach a serving thread. Keep-all settings must give dense results exactly, long
sequences must be counted sparse, and every attention call counted once.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.runtime_mask import check_runtime_mask

transformers = pytest.importorskip("transformers")

from test_attention_interface import HEADS, SUPPORTED, calls, reasons  # noqa: E402

PBS = dict(method="pbs", pbs={"block_size": 16, "segment_size": 32})
SIZES = dict(vocab_size=128, max_position_embeddings=4096, intermediate_size=128, num_hidden_layers=2)
needs_interface = pytest.mark.skipif(not SUPPORTED, reason="transformers has no AttentionMaskInterface")
needs_batching = pytest.mark.skipif(not hasattr(transformers.LlamaForCausalLM, "generate_batch"),
                                    reason="this transformers has no continuous batching")


@pytest.fixture(autouse=True)
def _fresh_stats():
    sparse_compile.reset_runtime_stats()
    yield


def llama():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HEADS, **SIZES)).eval()


def chunked_logits(model, ids, chunk):
    cache = transformers.DynamicCache()
    out = [model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
           for s in range(0, ids.shape[1], chunk)]
    return torch.cat(out, 1)


@pytest.mark.parametrize("path", ["compiled", pytest.param("front door", marks=needs_interface)])
def test_every_chunk_of_a_chunked_prefill_runs_sparse(path):
    model = llama()
    ids = torch.randint(1, 128, (1, 640))
    config = SparseConfig(**PBS, min_seq_len=2).keep_all()
    with torch.no_grad():
        ref = model(ids).logits
        if path == "compiled":
            run = torch.compile(model, backend="sparse_prefill", options=config)
        else:
            run = sparse_compile.enable_transformers_attention(model, config)
        out = chunked_logits(run, ids, 128)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls("sparse") == {site: 5 for site in calls("sparse")} and len(calls("sparse")) == 2
    assert sum(calls("dense").values()) == 0


def test_the_length_rule_weighs_the_context_a_chunk_attends_to():
    model = llama()
    ids = torch.randint(1, 128, (1, 512))
    # 128-token chunks: 128, then 128 over 256 keys (the work of a 221-token prefill), 128 over 384 (271), ...
    config = SparseConfig(**PBS, min_seq_len=250).keep_all()
    with torch.no_grad():
        ref = model(ids).logits
        out = chunked_logits(torch.compile(model, backend="sparse_prefill", options=config), ids, 128)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert set(calls("sparse").values()) == {2} and set(calls("dense").values()) == {2}
    said = set().union(*reasons("dense").values())
    assert "q_len 128 over 256 keys computes as much as a 221-token prefill < min_seq_len 250" in said


def _segment_reference(q, k, v, cq, ck):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 == q0:
            continue
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=lambda h: f"gqa{h[0] // h[1]}")
def test_varlen_attention_equals_each_sequence_alone(heads):
    # zero-length, one-token (a decode step), shorter than a tile, q_len < kv_len, and very different lengths
    q_lens = [0, 1, 5, 3, 200, 37, 1, 64]
    k_lens = [0, 1, 5, 60, 200, 90, 300, 64]
    cq = list(itertools.accumulate([0] + q_lens))
    ck = list(itertools.accumulate([0] + k_lens))
    hq, hkv = heads
    q = torch.randn(cq[-1], hq, 16)
    k, v = torch.randn(ck[-1], hkv, 16), torch.randn(ck[-1], hkv, 16)
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck, dtype=torch.int32),
                                          config=SparseConfig(**PBS, min_seq_len=4).keep_all())
    torch.testing.assert_close(out, _segment_reference(q, k, v, cq, ck), rtol=1e-5, atol=1e-5)
    stats = sparse_compile.runtime_stats()["varlen_attention"]
    assert sum(stats.calls.values()) == 7  # every non-empty sequence is a call
    assert stats.calls[("dense", "decode step (q_len == 1)")] == 2
    assert sum(n for (path, _), n in stats.calls.items() if path == "sparse") == 5  # all but the decode steps


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(cu_q=torch.tensor([0, 5, 3, 10])), "cu_seqlens_q must start at 0 and never decrease"),
    (lambda a: a.update(cu_q=torch.tensor([0, 5, 9])), "cu_seqlens_q ends at 9, but q holds 10 tokens"),
    (lambda a: a.update(cu_k=torch.tensor([0, 5.0, 20])), "cu_seqlens_k must hold integers"),
    (lambda a: a.update(cu_k=torch.tensor([0, 4, 20])), "sequence 0 has 5 queries but 4 keys"),
    (lambda a: a.update(cu_k=torch.tensor([0, 20])), "describe 2 and 1 sequences"),
    (lambda a: a.update(cu_q=torch.tensor([0, 5, 10], device="meta")), "cu_seqlens_q is on meta"),
    (lambda a: a.update(q=torch.randn(1, 10, 4, 16)), "q must be 3-D"),
])
def test_varlen_attention_names_bad_input(change, message):
    args = dict(q=torch.randn(10, 4, 16), k=torch.randn(20, 2, 16), v=torch.randn(20, 2, 16),
                cu_q=torch.tensor([0, 5, 10]), cu_k=torch.tensor([0, 5, 20]))
    change(args)
    with pytest.raises(ValueError, match=message):
        sparse_compile.varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"])


def _packed_mask(q_lens, k_lens, padding_rows=0, dtype=torch.float32):
    """Continuous batching's mask: each request's new tokens see its own keys causally (queries last)."""
    total_q, total_k = sum(q_lens) + padding_rows, sum(k_lens)
    allowed = torch.zeros(total_q, total_k, dtype=torch.bool)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        allowed[q0:q0 + nq, k0:k0 + nk] = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        q0, k0 = q0 + nq, k0 + nk
    if dtype == torch.bool:
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_checked_mask_of_packed_sequences_names_each(dtype):
    mask = _packed_mask([3, 40, 1, 7], [3, 50, 9, 7], padding_rows=2, dtype=dtype)
    verdict = check_runtime_mask(mask, 1, 4, mask.shape[-2], mask.shape[-1])
    assert verdict.segments == ((0, 3, 0, 3), (3, 43, 3, 53), (43, 44, 53, 62), (44, 51, 62, 69))
    holes = mask.clone()
    holes[..., 10, 5] = torch.finfo(torch.float32).min if dtype != torch.bool else False  # a key hidden mid-row
    assert not check_runtime_mask(holes, 1, 4, mask.shape[-2], mask.shape[-1]).segments


@needs_batching
def test_generate_batch_runs_long_sequences_sparse_and_counts_every_call():
    model = llama()
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (60, 150, 250)]
    steps = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a small paged cache: by default continuous batching sizes it by the free memory (gigabytes on a CPU)
        small = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=512)
        ref = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
        model.compile(backend="sparse_prefill", options=SparseConfig(**PBS, min_seq_len=100).keep_all())
        out = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    for request in ref:
        assert out[request].generated_tokens == ref[request].generated_tokens
    counted = sum(n for s in sparse_compile.runtime_stats().values() for n in s.calls.values())
    layers = SIZES["num_hidden_layers"]
    assert counted == layers * (len(prompts) + len(prompts) * 1)  # each prompt once, then one decode token each
    said = {r: n for s in sparse_compile.runtime_stats().values() for (p, r), n in s.calls.items()}
    assert sum(n for r, n in said.items() if r.startswith("method pbs")) == 2 * layers  # the 150 and 250 prompts
    assert sum(n for r, n in said.items() if r.startswith("q_len 60 < min_seq_len 100")) == layers


def test_a_region_open_in_another_thread_is_warned_about():
    import threading

    q = torch.randn(1, 2, 32, 16)
    result = {}

    def serve():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sparse_compile.sparse_attention(q, q, q)
        result["warned"] = any("no sparsity(...) region is open while another thread" in str(w.message)
                               for w in seen)

    with sparse_compile.sparsity(enabled=False):
        worker = threading.Thread(target=serve)
        worker.start()
        worker.join()
    assert result["warned"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparse_compile.sparse_attention(q, q, q)  # no region open anywhere: nothing to say


@pytest.mark.parametrize("path", ["compiled", pytest.param("front door", marks=needs_interface)])
def test_documents_packed_in_rows_run_each_on_its_own(path):
    model = llama()
    ids = torch.randint(1, 128, (2, 200))
    positions = torch.stack([torch.cat([torch.arange(70), torch.arange(130)]),
                             torch.cat([torch.arange(30), torch.arange(90), torch.arange(80)])])
    config = SparseConfig(**PBS, min_seq_len=2).keep_all()
    with torch.no_grad():
        ref = model(ids, position_ids=positions, use_cache=False).logits
        alone = model(ids[:1, :70], use_cache=False).logits
        if path == "compiled":
            run = torch.compile(model, backend="sparse_prefill", options=config)
        else:
            run = sparse_compile.enable_transformers_attention(model, config)
        out = run(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:1, :70], alone, rtol=1e-5, atol=1e-5)  # a document sees nothing before it
    assert calls("sparse") == {site: 5 for site in calls("sparse")} and len(calls("sparse")) == 2


def test_one_document_with_arange_positions_runs_sparse_compiled():
    model = llama()
    ids = torch.randint(1, 128, (1, 150))
    config = SparseConfig(**PBS, min_seq_len=2).keep_all()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = torch.compile(model, backend="sparse_prefill", options=config)(
            ids, position_ids=torch.arange(150)[None], use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls("sparse") == {site: 1 for site in calls("sparse")} and len(calls("sparse")) == 2


def test_a_padded_call_whose_rows_took_different_paths_counts_each_row():
    model = llama()
    ids = torch.randint(1, 128, (2, 80))
    mask = torch.ones_like(ids)
    mask[1, :70] = 0  # a 10-token prompt beside an 80-token one
    config = SparseConfig(**PBS, min_seq_len=40).keep_all()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        out = torch.compile(model, backend="sparse_prefill", options=config)(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-5)
    for site, stats in sparse_compile.runtime_stats().items():
        assert sum(stats.calls.values()) == 1, site  # one call
        by_path = {path: n for (path, _), n in stats.rows.items()}
        assert by_path == {"sparse": 1, "dense": 1}, stats.rows  # each row on its own path
    table = str(sparse_compile.runtime_stats())
    assert "1 rows of padded calls: q_len 10 < min_seq_len 40" in table
