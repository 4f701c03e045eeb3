"""Inputs and call patterns that once gave silent wrong results, each through what users run: the front door on
models whose attention needs the model's own eager function (soft-capping, sinks), masks written in place inside a
compiled function, regions on coroutines and generators and shared between threads, autocast, a mask that
requires grad, a subnormal scale, and the front door's per-request state.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, sparsity

transformers = pytest.importorskip("transformers")

from test_attention_interface import HEADS, SIZES, SUPPORTED, calls, reasons  # noqa: E402

needs_interface = pytest.mark.skipif(not SUPPORTED, reason="transformers has no AttentionMaskInterface")
PBS = dict(method="pbs", min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})
OPTIONS = {"method": "pbs", "min_seq_len": 2, "pbs": {"block_size": 16, "segment_size": 32}}


@pytest.fixture(autouse=True)
def _fresh_stats():
    sparse_compile.reset_runtime_stats()
    yield


def own_attention(name: str):
    """A tiny model with the attention implementation transformers gives it by default (eager where SDPA cannot
    serve it: Gemma-2's soft-capping, gpt-oss's sinks)."""
    T = transformers
    kv1 = {**HEADS, "num_key_value_heads": 1}
    build = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**HEADS, **SIZES)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**HEADS, **SIZES)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**HEADS, **SIZES)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**HEADS, head_dim=16, **SIZES)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**HEADS, pad_token_id=0, **SIZES)),
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**kv1, head_dim=16, query_pre_attn_scalar=20,
                                                                 **SIZES)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**kv1, head_dim=16, **SIZES)),
        "gpt_oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(**HEADS, head_dim=16, num_local_experts=4,
                                                              num_experts_per_tok=2, sliding_window=32,
                                                              rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0}, **SIZES)),
    }
    if name == "gpt_oss" and not hasattr(T, "GptOssForCausalLM"):
        pytest.skip("this transformers has no gpt-oss")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build[name]().eval()
    return model


@needs_interface
# the models whose own attention is SDPA (qwen2, qwen3, mistral, phi3, gemma3) are compared with it the same way in
# test_attention_interface.py; here one of them beside those that ship eager attention
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_front_door_equals_the_models_own_attention(name):
    torch.manual_seed(0)
    model = own_attention(name)
    own = model.config._attn_implementation
    ids = torch.randint(1, 128, (2, 75))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    steps = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model(ids).logits
        ref_padded = model(ids, attention_mask=mask).logits
        ref_tokens = model.generate(ids, attention_mask=mask, **steps)
        sparse_compile.enable_transformers_attention(model, SparseConfig(**PBS).keep_all())
        out = model(ids).logits
        out_padded = model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, **steps)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, scale), own
    valid = mask.bool()
    assert (out_padded[valid] - ref_padded[valid]).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert torch.equal(tokens, ref_tokens)
    if own == "eager":  # soft-capping or sinks: every call the model's own function, said
        assert calls("sparse") == {site: 0 for site in calls("sparse")}
        assert all(r for r in reasons("dense").values())


def _sdpa_twice(q, k, v, mask):
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mask[..., :, :5] = False  # keys 0-4 become padding for every query
    return first, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _padding_twice(q, k, v, padding):
    n = q.shape[-2]
    i = torch.arange(n)
    causal = (i[None, :] <= i[:, None])[None, None]
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & padding[:, None, None, :].bool())
    padding[:, :10] = 0
    return first, F.scaled_dot_product_attention(q, k, v, attn_mask=causal & padding[:, None, None, :].bool())


def test_a_mask_written_in_place_between_two_sites_is_read_again():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        ref = _sdpa_twice(q, k, v, causal.clone())
        out = torch.compile(_sdpa_twice, backend="sparse_prefill", options=OPTIONS)(q, k, v, causal.clone())
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1][:, :, 5:], ref[1][:, :, 5:])  # rows 0-4 see no key: undefined
        pad = torch.ones(1, 64, dtype=torch.long)
        ref = _padding_twice(q, k, v, pad.clone())
        out = torch.compile(_padding_twice, backend="sparse_prefill", options=OPTIONS)(q, k, v, pad.clone())
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1][:, :, 10:], ref[1][:, :, 10:])
    assert sum(calls("sparse").values()) == 4


def _disabled_calls() -> int:
    return sum(n for s in sparse_compile.runtime_stats().values() for (path, reason), n in s.calls.items()
               if path == "dense" and reason == "sparsity disabled in this region")


def _attend(q):
    return sparse_compile.sparse_attention(q, q, q, config=SparseConfig(**PBS))


def test_region_decorates_coroutines_generators_and_async_generators():
    q = torch.randn(1, 2, 48, 16)

    @sparsity(enabled=False)
    async def coroutine():
        await asyncio.sleep(0)
        return _attend(q)

    @sparsity(enabled=False)
    def generator():
        yield _attend(q)
        yield _attend(q)

    @sparsity(enabled=False)
    async def async_generator():
        yield _attend(q)
        await asyncio.sleep(0)
        yield _attend(q)

    async def drain():
        return [x async for x in async_generator()]

    dense = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    outputs = [asyncio.run(coroutine())]
    for out in generator():
        assert _disabled_calls() == len(outputs) + 1
        _attend(q)  # between the generator's steps the caller's region (none) is in force: sparse
        outputs.append(out)
    outputs += asyncio.run(drain())
    assert _disabled_calls() == 5
    for out in outputs:
        torch.testing.assert_close(out, dense)


def test_one_region_object_entered_by_several_threads_and_tasks():
    region = sparsity(enabled=False)
    barrier = threading.Barrier(2)
    seen, errors = [], []

    def work():
        try:
            with region:
                barrier.wait()
                seen.append(_state())
                barrier.wait()
        except Exception as exc:  # pragma: no cover - the defect
            errors.append(exc)
        seen.append(_state())

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(seen, key=str) == [False, False, None, None]

    async def task():
        with region:
            await asyncio.sleep(0.01)
            inside = _state()
        return inside, _state()

    async def main():
        return await asyncio.gather(task(), task())

    assert asyncio.run(main()) == [(False, None), (False, None)]


def _state():
    from sparse_compile.context import current_region

    return current_region().enabled


def test_a_region_inside_compiled_code_warns():
    q = torch.randn(1, 2, 48, 16)

    def inside(q):
        with sparsity(enabled=False):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out * 2

    compiled = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                             backend="sparse_prefill", options=OPTIONS)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with sparsity(enabled=False):  # around the compiled call: the documented use, no warning
                compiled(q)
        with pytest.warns(UserWarning, match="inside a function compiled by torch.compile"):
            torch.compile(inside, backend="sparse_prefill", options=OPTIONS)(q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_compiled_model_runs_sparse_in_autocasts_dtype(dtype):
    torch.manual_seed(0)
    T = transformers
    model = T.LlamaForCausalLM(T.LlamaConfig(**HEADS, **SIZES)).eval()
    ids = torch.randint(1, 128, (1, 70))
    with torch.no_grad():
        exact = model(ids).logits
        with torch.autocast("cpu", dtype=dtype):
            ref = model(ids).logits
            out = torch.compile(model, backend="sparse_prefill",
                                options=SparseConfig(**PBS).keep_all())(ids).logits
    assert out.dtype == ref.dtype
    # keep-all in autocast's precision: as close to the float32 model as eager autocast is (2x plus rounding)
    assert (out.float() - exact).abs().max() <= 2 * (ref.float() - exact).abs().max() + 1e-3
    assert set(calls("sparse").values()) == {1} and len(calls("sparse")) == 2


@needs_interface
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_autocast_front_door(name):
    torch.manual_seed(0)
    model = own_attention(name)
    ids = torch.randint(1, 128, (1, 70))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(ids).logits
        sparse_compile.enable_transformers_attention(model, SparseConfig(**PBS).keep_all())
        out = model(ids).logits
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)
    assert set(calls("sparse").values()) == {1}


def test_autocast_sparse_attention_returns_autocasts_dtype():
    q = torch.randn(1, 2, 64, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sparse_compile.sparse_attention(q, q, q.bfloat16(), config=SparseConfig(**PBS))
        ref = F.scaled_dot_product_attention(q, q, q.bfloat16(), is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert calls("sparse") == {"sparse_attention": 1}


@needs_interface
def test_front_door_keeps_no_mask_after_a_request():
    T = transformers
    model = T.LlamaForCausalLM(T.LlamaConfig(**HEADS, **SIZES)).eval()
    sparse_compile.enable_transformers_attention(model, SparseConfig(**PBS))
    ids = torch.randint(1, 128, (2, 67))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0

    def live_masks() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.bool
                   and tuple(o.shape) == (2, 67))

    with torch.no_grad():
        model(ids, attention_mask=mask)
        before = live_masks()
        for _ in range(10):
            model(ids, attention_mask=mask)
    assert live_masks() <= before


def test_a_mask_that_requires_grad_stays_differentiable():
    n = 48
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    mask = torch.zeros(1, 1, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    mask.requires_grad_(True)
    compiled = torch.compile(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                             backend="sparse_prefill", options=OPTIONS)
    with pytest.warns(UserWarning, match="attn_mask requires grad"):
        out = compiled(q, k, v, mask)
    out.sum().backward()
    grad, mask.grad = mask.grad.clone(), None
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    torch.testing.assert_close(grad, mask.grad)


@pytest.mark.parametrize("min_seq_len", [2, 10**6])
def test_a_subnormal_scale_runs_dense_whatever_the_length_rule(min_seq_len):
    q = torch.randn(1, 2, 64, 16)
    out = sparse_compile.sparse_attention(q, q, q, scale=5e-324,
                                          config=SparseConfig(**{**PBS, "min_seq_len": min_seq_len}))
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True, scale=5e-324)
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert calls("dense") == {"sparse_attention": 1}


def test_pytorch_attention_modules_are_listed_dense():
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    x = torch.randn(1, 40, 64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(40)

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.layer = mha, layer

        def forward(self, x):
            return self.mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0] + \
                self.layer(x, src_mask=causal, is_causal=True)

    with torch.no_grad(), pytest.warns(UserWarning, match="fused call"):
        torch.compile(Both(), backend="sparse_prefill", options=OPTIONS)(x)
    stats = sparse_compile.runtime_stats()
    assert set(stats) == {"mha", "layer"}
    assert all("fused call" in s.last_reason for s in stats.values())


@pytest.mark.parametrize("shape", [(1, 4, 1, 130), (2, 8, 2, 515)])
def test_an_exact_plan_with_reordered_queries_reads_density_one(shape):
    batch, heads, kv_heads, n = shape
    q, k = torch.randn(batch, heads, n, 16), torch.randn(batch, kv_heads, n, 16)
    config = SparseConfig(method="s2o", min_seq_len=2, record_density=True, s2o={"early_stop": 0.0})
    out = sparse_compile.sparse_attention(q, k, k, config=config)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    stats = sparse_compile.runtime_stats()["sparse_attention"]
    assert stats.last_density_per_head == [1.0] * heads


@needs_interface
def test_front_door_says_it_returns_no_attention_weights():
    T = transformers
    model = T.LlamaForCausalLM(T.LlamaConfig(**HEADS, **SIZES)).eval()
    sparse_compile.enable_transformers_attention(model, SparseConfig(**PBS))
    with torch.no_grad(), pytest.warns(UserWarning, match="does not return attention weights"):
        model(torch.randint(1, 128, (1, 20)), output_attentions=True)
