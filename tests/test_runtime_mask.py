"""Masks that arrive as graph inputs, checked at run time: static cache, graph breaks, changing batch sizes.

A mask built outside the compiled graph (transformers' static cache) or before a graph break cannot be proven from
the graph; the op checks its values once per forward pass. Causal AND key padding runs sparse (and must equal
eager with the keep-everything setting), and so does that AND a sliding window where the op runs windows; anything
else (packed documents, a bias) runs dense SDPA with the mask, exactly, and says so. Everything runs through the registered ``sparse_prefill`` backend with Inductor, as users call it.
"""

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.runtime_mask import CHECKED
from sparse_compile.site import SiteSpec

from test_transformers_calls import SMALL, padded, sparse_calls, tiny

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

KEEP_ALL = SparseConfig(**SMALL).keep_all()
OPTIONS = KEEP_ALL.to_dict()


def reasons() -> dict:
    return {site: dict(s.calls) for site, s in sparse_compile.runtime_stats().items()}


def prefill_sparse_checked() -> dict:
    """Sparse calls whose reason says the mask was checked at run time, per site."""
    return {site: sum(n for (path, why), n in s.calls.items() if path == "sparse" and CHECKED in why)
            for site, s in sparse_compile.runtime_stats().items()}


# -- a mask built before a graph break ---------------------------------------------------------------------------
class BreakBeforeAttention(torch.nn.Module):
    """Builds causal AND padding (optionally a sliding window), breaks the graph, then attends with the mask."""

    def __init__(self, as_float: bool, window: int = 0):
        super().__init__()
        self.as_float, self.window = as_float, window

    def forward(self, q, k, v, padding):
        n = q.shape[2]
        i = torch.arange(n)
        allowed = i[None, :] <= i[:, None]
        if self.window:
            allowed = allowed & (i[None, :] > i[:, None] - self.window)
        allowed = allowed[None, None] & padding[:, None, None, :].bool()
        if self.as_float:
            allowed = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
        torch._dynamo.graph_break()  # the mask reaches attention as a graph input
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _qkv(batch=2, heads=4, n=48, dim=16):
    torch.manual_seed(0)
    return tuple(torch.randn(batch, heads, n, dim) for _ in range(3))


@pytest.mark.parametrize("as_float", [False, True], ids=["bool", "float"])
def test_graph_break_before_attention_runs_sparse_and_exact(as_float):
    q, k, v = _qkv()
    model = BreakBeforeAttention(as_float)
    compiled = torch.compile(model, backend="sparse_prefill", options=OPTIONS)
    for side in ("left", "right", "none"):
        padding = torch.ones(2, q.shape[2], dtype=torch.long) if side == "none" else padded(q[:, 0, :, 0], side)
        with torch.no_grad():
            ref, out = model(q, k, v, padding), compiled(q, k, v, padding)
        valid = padding.bool()[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert list(prefill_sparse_checked().values()) == [3], reasons()


def test_sliding_window_graph_input_is_read_with_its_width():
    """Causal AND a window of 8 AND left padding, checked at run time: sparse, named with its width."""
    q, k, v = _qkv()
    model = BreakBeforeAttention(as_float=False, window=8)
    padding = padded(q[:, 0, :, 0], "left")
    with torch.no_grad():
        ref = model(q, k, v, padding)
        out = torch.compile(model, backend="sparse_prefill", options=OPTIONS)(q, k, v, padding)
    (calls,) = reasons().values()
    assert len(calls) == 1
    (path, why), = calls
    assert "causal AND sliding window 8 AND key padding" in why, why
    valid = padding.bool()[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert path == "sparse", why


def test_op_checks_the_mask_opcheck_static_slots_and_chunked_prefill():
    """The op with a run-time mask: opcheck, a static cache's empty slots (keys past the prompt masked everywhere)
    and a chunked prefill (queries at the last positions of the filled keys)."""
    q, k, v = _qkv(n=32)
    cache = torch.randn(2, 4, 48, 16), torch.randn(2, 4, 48, 16)
    op = torch.ops.sparse_compile.causal_attention.default
    spec = SiteSpec("site", KEEP_ALL, queries_last=True).to_json()
    for offset, filled in ((0, 32), (10, 42), (16, 48)):  # (first query position, keys holding tokens)
        keys = torch.arange(48)
        rows = torch.arange(32)[:, None] + offset
        mask = ((keys[None, :] <= rows) & (keys[None, :] < filled))[None, None].expand(2, 1, 32, 48).clone()
        mask[0, :, :, :3] = False  # left padding in row 0
        args = (q, *cache, None, spec, None, None, mask)
        with torch.no_grad():
            out = op(*args)
        ref = F.scaled_dot_product_attention(q, *cache, attn_mask=mask)
        seen = mask.any(-1, keepdim=True).expand_as(out)
        torch.testing.assert_close(out[seen], ref[seen], rtol=1e-5, atol=1e-5)
        torch.library.opcheck(op, args)
    assert sum(n for (path, _), n in sparse_compile.runtime_stats()["site"].calls.items() if path == "sparse") >= 3


# -- transformers, as users call it --------------------------------------------------------------------------------
# llama through Inductor; the front door's static cache on several models is in test_attention_interface.py
@pytest.mark.parametrize("name", ["llama"])
def test_static_cache_generate_prefill_sparse_same_tokens(name):
    model = tiny(name)
    ids = torch.randint(1, 128, (2, 40))
    mask = padded(ids, "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        model.compile(backend="sparse_prefill", options=OPTIONS)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert set(prefill_sparse_checked().values()) == {1} and len(prefill_sparse_checked()) == 2, reasons()


def test_dynamic_ntk_rope_graph_break_runs_sparse_exact():
    T = transformers
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             vocab_size=128, intermediate_size=128, num_hidden_layers=2,
                                             max_position_embeddings=32,
                                             rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    model.config._attn_implementation = "sdpa"
    model.eval()
    ids = torch.randint(1, 128, (2, 40))
    mask = padded(ids, "right")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        out = torch.compile(model, backend="sparse_prefill", options=OPTIONS)(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert sparse_calls() and set(sparse_calls().values()) == {1}, reasons()


def test_batch_change_then_generate_prefill_sparse():
    """``model.compile``, a call with batch 1, one with batch 2, then ``generate()``: every prefill sparse."""
    model = tiny("llama")
    ids = torch.randint(1, 128, (2, 40))
    mask = padded(ids, "left")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        model.compile(backend="sparse_prefill", options=OPTIONS)
        model(ids[:1], attention_mask=mask[:1])
        model(ids, attention_mask=mask)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert set(sparse_calls().values()) == {3}, reasons()
    plain = [why for s in sparse_compile.runtime_stats().values() for why in s.plain_sdpa]
    assert all("decode step" in why for why in plain), plain


def test_run_time_mask_refused_inside_sequence_parallel():
    """Each rank's mask covers its chunk only: the op refuses before any collective (every rank runs the same
    graph, so every rank raises). The block's group is set directly: nothing distributed runs."""
    from sparse_compile.parallel import _SEQUENCE_GROUP

    q, k, v = _qkv(n=16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    spec = SiteSpec("s", KEEP_ALL, queries_last=True).to_json()
    token = _SEQUENCE_GROUP.set(object())
    try:
        with pytest.raises(RuntimeError, match="graph input.*sequence_parallel"):
            torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, None, None, mask)
    finally:
        _SEQUENCE_GROUP.reset(token)


def test_rows_the_form_leaves_empty_must_see_nothing_or_everything():
    """A padded query row is undefined (zeros here); a row that sees some keys but not all is a real row: dense."""
    q, k, v = _qkv(n=16)
    spec = SiteSpec("s", KEEP_ALL, queries_last=True).to_json()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[0, :, :, :4] = False  # left padding: rows 0-3 of batch 0 see nothing
    for row, path in ((torch.ones(16, dtype=torch.bool), "sparse"), (torch.arange(16) == 9, "dense")):
        mask[0, 0, 2] = row
        sparse_compile.reset_runtime_stats()
        with torch.no_grad():
            out = torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, None, None, mask)
        (stats,) = sparse_compile.runtime_stats().values()
        assert stats.last_path == path, stats.last_reason
        if path == "dense":
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), equal_nan=True)
