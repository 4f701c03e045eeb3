"""Hostile inputs, generated: over a thousand cases (shapes, dtypes, strides and views, devices, masks of every
construction the proof accepts and refuses, empty and one-token prompts, huge batches of short prompts) through
``sparse_attention`` and compiled functions, against eager attention. Every method runs with its keep-everything
setting, so the sparse path must be exact: a difference is a silent wrong result. A refused input is an error whose
message names the argument."""

import random

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile.registry import registered_methods
from helpers import BUILT_IN, SMALL, dense_reference

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

EAGER_CASES = 700
COMPILED_CASES = 80  # per compiled function (five)
OPTIONS = dict(SMALL, kernel="reference", planner="reference")
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}




def _tensor(rng, shape, dtype, layout):
    """A (B, H, N, D) tensor of random values in one of the layouts callers pass."""
    b, h, n, d = shape
    if layout == "heads_inner":  # projections viewed (B, N, H, D) and transposed
        return torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2)
    if layout == "sliced":  # a window of a larger buffer: an offset and padded strides
        return torch.randn(b, h, n + 3, d + 8, dtype=dtype)[:, :, 3:, :d]
    if layout == "expanded" and b > 0:  # one row broadcast over the batch: stride 0
        return torch.randn(1, h, n, d, dtype=dtype).expand(b, h, n, d)
    if layout == "strided_last":  # every other element of the last dimension
        return torch.randn(b, h, n, 2 * d, dtype=dtype)[..., ::2]
    if layout == "column_major":
        return torch.randn(b, h, d, n, dtype=dtype).transpose(2, 3)
    return torch.randn(b, h, n, d, dtype=dtype)


LAYOUTS = ("contiguous", "heads_inner", "sliced", "expanded", "strided_last", "column_major")


def _refusals():
    """(what is wrong, the call, the error type, words the message must hold: the argument's name)."""
    q, k, v = torch.randn(1, 4, 16, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    return [
        ("q 3-D", lambda: (q[0], k, v, {}), ValueError, "q must be 4-D"),
        ("k 5-D", lambda: (q, k[None], v, {}), ValueError, "k must be 4-D"),
        ("v a list", lambda: (q, k, v.tolist(), {}), TypeError, "v must be a torch.Tensor"),
        ("int dtype", lambda: (q.int(), k.int(), v.int(), {}), ValueError, "q, k, v: unsupported dtype"),
        ("bool dtype", lambda: (q.bool(), k.bool(), v.bool(), {}), ValueError, "q, k, v: unsupported dtype"),
        ("mixed dtypes", lambda: (q.half(), k, v, {}), ValueError, "q, k, v must share a dtype"),
        ("batch", lambda: (q.expand(2, -1, -1, -1), k, v, {}), ValueError, "batch sizes differ: q 2, k 1"),
        ("head dims", lambda: (torch.randn(1, 4, 16, 32), k, v, {}), ValueError, "head dims differ: q 32, k 16"),
        ("heads", lambda: (torch.randn(1, 3, 16, 16), k, v, {}), ValueError, "q's heads (3) must be a multiple"),
        ("k, v shapes", lambda: (q, k, v[:, :, :8], {}), ValueError, "k and v shapes differ"),
        ("more queries", lambda: (torch.randn(1, 4, 20, 16), k, v, {}), ValueError, "q_len 20 > kv_len 16"),
        ("devices", lambda: (q, k.to("meta"), v, {}), ValueError, "q, k, v must be on one device"),
        ("sparse layout", lambda: (q.to_sparse(), k, v, {}), ValueError, "q must be a dense (strided) tensor"),
        ("scale a string", lambda: (q, k, v, {"scale": "0.5"}), TypeError, "scale must be a float"),
        ("scale a tensor", lambda: (q, k, v, {"scale": torch.tensor(0.5)}), TypeError, "scale must be a float"),
        ("config a dict", lambda: (q, k, v, {"config": {"method": "pbs"}}), TypeError,
         "config must be a SparseConfig"),
    ]


def _eager_case(rng, configs):
    """One generated call of ``sparse_attention``: (q, k, v, scale, config)."""
    dtype = rng.choice((torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16))
    heads_kv, group = rng.choice((1, 2)), rng.choice((1, 2, 3))
    dim = rng.choice((8, 16, 16, 32, 12))  # 12: no kernel serves it (dense)
    shape_kind = rng.random()
    if shape_kind < 0.1:  # a huge batch of short prompts
        batch, num_keys = rng.choice((64, 256)), rng.randint(1, 6)
    elif shape_kind < 0.2:  # empty and one-token prompts
        batch, num_keys = rng.choice((0, 1, 2)), rng.choice((0, 1, 1))
    else:
        batch, num_keys = rng.choice((1, 1, 2, 3)), rng.randint(2, 80)
    num_queries = num_keys if rng.random() < 0.7 or num_keys == 0 else rng.randint(1, num_keys)  # chunked prefill
    layouts = [rng.choice(LAYOUTS) for _ in range(3)]
    q = _tensor(rng, (batch, heads_kv * group, num_queries, dim), dtype, layouts[0])
    k = _tensor(rng, (batch, heads_kv, num_keys, dim), dtype, layouts[1])
    v = _tensor(rng, (batch, heads_kv, num_keys, dim), dtype, layouts[2])
    scale = rng.choice((None, None, 0.05, 1.0, 2.5))
    return q, k, v, scale, rng.choice(configs)


def test_generated_sparse_attention_calls_are_exact_or_refused_by_name():
    rng = random.Random(torch.initial_seed())
    configs = [sparse_compile.SparseConfig.from_options({**OPTIONS, "method": m}).keep_all() for m in BUILT_IN]
    refusals, cases, wrong = _refusals(), 0, []
    for i in range(EAGER_CASES):
        if i % 10 == 0:  # one case in ten is refused
            what, make, error, words = refusals[(i // 10) % len(refusals)]
            q, k, v, kwargs = make()
            with pytest.raises(error) as raised:
                sparse_compile.sparse_attention(q, k, v, **kwargs)
            assert words in str(raised.value), (what, str(raised.value))
            cases += 1
            continue
        q, k, v, scale, config = _eager_case(rng, configs)
        if i % 50 == 1:  # tensors without data (shape propagation): shapes only
            q, k, v = (t.to("meta") for t in (q, k, v))
        out = sparse_compile.sparse_attention(q, k, v, scale=scale, config=config)
        assert out.shape == q.shape and out.dtype == q.dtype, (q.shape, out.shape)
        cases += 1
        if out.numel() == 0 or q.is_meta:
            assert out.device == q.device
            continue
        want = dense_reference(q, k, v, scale)
        err = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        if not err <= TOLERANCE[q.dtype]:
            wrong.append((config.method, tuple(q.shape), tuple(k.shape), q.dtype, q.stride(), scale, err))
    assert cases == EAGER_CASES and not wrong, wrong[:5]
    entry = sparse_compile.runtime_stats()["sparse_attention"]
    sparse = sum(n for (path, _), n in entry.calls.items() if path == "sparse")
    assert sparse > EAGER_CASES // 3  # the sparse path ran, exactly, on a good share of them


# -- compiled functions ----------------------------------------------------------------------------------------
def _causal(q, k, v):  # (B, N, H, D) inputs, as projections give them
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _padded(q, k, v, attention_mask):  # the causal mask AND a tokenizer's padding mask, built in the graph
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = causal[None, None] & attention_mask[:, None, None, :].bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _float_padded(q, k, v, attention_mask):  # the same as an additive float mask (0 / -inf), as many models do
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    keep = causal[None, None] & (attention_mask[:, None, None, :] > 0)
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _window(q, k, v):  # a sliding window of 8 keys built in the graph: not causal, the proof refuses it
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 8)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _given_mask(q, k, v, mask):  # a mask from outside the graph: checked at run time
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


FUNCTIONS = (_causal, _padded, _float_padded, _window, _given_mask)


def _padding(rng, batch, n):
    mask = torch.ones(batch, n, dtype=torch.int64)
    for row in range(batch):
        kind = rng.choice(("none", "left", "right", "holes", "none"))
        cut = rng.randint(1, n - 1) if n > 1 else 0
        if kind == "left":
            mask[row, :cut] = 0
        elif kind == "right":
            mask[row, cut:] = 0
        elif kind == "holes":
            mask[row] = (torch.rand(n) < 0.7).long()
            mask[row, -1] = 1
    return mask


def _attention_mask(rng, batch, n):
    """A 4-D bool mask of one of the constructions users pass: causal ones the op runs sparse, the rest dense."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    kind = rng.choice(("causal", "causal_padded", "window", "bidirectional", "random", "causal_minus_one",
                       "top_left_shifted", "broadcast_causal"))
    if kind == "broadcast_causal":
        return kind, causal[None, None].expand(batch, 1, n, n)
    if kind == "causal":
        return kind, causal.expand(batch, 1, n, n).clone()
    if kind == "causal_padded":
        return kind, causal[None, None] & _padding(rng, batch, n)[:, None, None, :].bool()
    if kind == "window":
        return kind, (causal & ~torch.ones(n, n, dtype=torch.bool).tril(-3)).expand(batch, 1, n, n).clone()
    if kind == "bidirectional":
        return kind, torch.ones(batch, 1, n, n, dtype=torch.bool)
    if kind == "random":
        return kind, torch.rand(batch, 1, n, n) < 0.6
    if kind == "causal_minus_one":  # causal but one visible key hidden: not causal
        mask = causal.expand(batch, 1, n, n).clone()
        mask[0, 0, n - 1, 0] = False
        return kind, mask
    return kind, torch.ones(n, n, dtype=torch.bool).tril(1).expand(batch, 1, n, n).clone()


def _compare(out, want, valid_rows, case):
    """Rows eager attention defines (finite): equal; rows it leaves undefined (no visible key): NaN or zeros."""
    out, want = out.transpose(1, 2), want.transpose(1, 2)  # (B, N, H, D): rows first
    finite = torch.isfinite(want).all(-1).all(-1)
    if valid_rows is not None:
        finite &= valid_rows
    torch.testing.assert_close(out[finite], want[finite], rtol=1e-4, atol=2e-5, msg=lambda m: f"{case}: {m}")
    rest = out[~finite]
    assert bool(((rest == 0) | ~torch.isfinite(rest)).all()), f"{case}: rows without a visible key"


def test_generated_calls_of_compiled_functions_match_eager():
    rng = random.Random(torch.initial_seed())
    keep_all = [dict(method=name, **registered_methods()[name].keep_all) for name in BUILT_IN]
    compiled = {fn: torch.compile(fn, backend="sparse_prefill", options=OPTIONS, dynamic=True)
                for fn in FUNCTIONS}
    cases = 0
    with torch.no_grad():
        for i in range(len(FUNCTIONS) * COMPILED_CASES):
            fn = FUNCTIONS[i % len(FUNCTIONS)]
            if rng.random() < 0.15:  # a huge batch of short prompts
                batch, n = 48, rng.randint(2, 6)
            else:
                batch, n = rng.choice((2, 3, 4)), rng.randint(2, 70)
            if fn is _causal and rng.random() < 0.1:
                n = 1  # one-token prompts
            q, k, v = (torch.randn(batch, n, heads, 16) for heads in (4, 2, 2))
            extra, valid_rows, case = (), None, (fn.__name__, batch, n)
            if fn in (_padded, _float_padded):
                padding = _padding(rng, batch, n)
                extra, valid_rows = (padding,), padding.bool()
            elif fn is _given_mask:
                kind, mask = _attention_mask(rng, batch, n)
                extra, case = (mask,), case + (kind,)
                if kind == "causal_padded":  # the padded query rows: zeros by contract (docs/design.md)
                    valid_rows = mask[:, 0].diagonal(dim1=-2, dim2=-1)
            with sparse_compile.sparsity(**rng.choice(keep_all)):
                out = compiled[fn](q, k, v, *extra)
            _compare(out, fn(q, k, v, *extra), valid_rows, case)
            cases += 1
    assert cases >= len(FUNCTIONS) * COMPILED_CASES
    stats = sparse_compile.runtime_stats()
    sparse = sum(n for entry in stats.values() for (path, _), n in entry.calls.items() if path == "sparse")
    assert sparse > COMPILED_CASES  # rewritten sites ran sparse (exactly) on many of them
