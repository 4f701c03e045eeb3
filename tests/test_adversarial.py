"""Adversarial inputs judged the way trusted attention libraries judge a kernel: a result passes when its largest
error against a float64 reference is at most twice that of PyTorch's own attention run in the same precision
(plus a small rounding allowance). Keep-everything settings of every method through ``sparse_attention`` (the
reference path on CPU) and the Triton kernel (Triton's interpreter on CPU: conftest sets TRITON_INTERPRET=1 before
the package imports); prime and unaligned lengths, 1-token and empty prompts, chunked prefill, GQA 1-16, batches,
head dims 16-80; bitwise determinism; batch invariance; bounded recompiles of the compiled path.

Every sparse claim is checked with ``runtime_stats()``: min_seq_len=2 and the small blocks of ``helpers.SMALL``.
Inputs are drawn from conftest's per-test seed.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.registry import registered_methods

from helpers import BUILT_IN, SMALL, random_qkv

EAGER = "sparse_attention"  # the site of sparse_attention's calls in runtime_stats()
COMPILED = "<scaled_dot_product_attention>"  # the site of a bare F.scaled_dot_product_attention call
#: what may exceed 2x PyTorch's error: rounding (these are far below one unit in the last place of O(1) outputs)
ROUNDING = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
FULL_PREFILL_ONLY = {"s2o"}  # declines q_len < kv_len ("needs a full prefill (Nq == Nk)"): runs dense, exactly

pytestmark = pytest.mark.usefixtures("one_thread")




# ------------------------------------------------------------------------------------------ the error criterion


def visible(nq: int, nk: int, device="cpu") -> torch.Tensor:
    """Causal with the queries at the last ``nq`` of ``nk`` positions: query i sees keys 0 .. nk - nq + i."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)


def reference64(q, k, v, scale=None):
    """Dense causal attention in float64, written out (no SDPA, no package code): GQA by repeating k and v."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(s, -1) @ v


def sdpa_same_precision(q, k, v, scale=None):
    """PyTorch's attention in the inputs' dtype, the queries at the last positions."""
    nq, nk = q.shape[-2], k.shape[-2]
    mask = None if nq == nk else visible(nq, nk, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=nq == nk, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def max_error(out, ref) -> float:
    if out.numel() == 0:
        return 0.0
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max())


def assert_within_sdpa_error(out, q, k, v, scale=None, what=""):
    """FlashAttention's criterion: ``max|out - ref64| <= 2 * max|sdpa(dtype) - ref64| + rounding``."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, (what, out.shape, out.dtype)
    ref = reference64(q, k, v, scale)
    ours, torchs = max_error(out, ref), max_error(sdpa_same_precision(q, k, v, scale), ref)
    bound = 2 * torchs + ROUNDING[q.dtype]
    assert ours <= bound, f"{what}: max error {ours:.3e} > 2 x SDPA's {torchs:.3e} + {ROUNDING[q.dtype]:.0e}"
    return ours, torchs


def keep_all(method: str, **changes) -> SparseConfig:
    return SparseConfig(method=method, **SMALL, **changes).keep_all()


def last(site=EAGER):
    return sparse_compile.runtime_stats()[site]


def path_counts(site=EAGER) -> dict:
    counts = {}
    for (path, _), n in last(site).calls.items():
        counts[path] = counts.get(path, 0) + n
    return counts


def assert_ran(method: str, chunked: bool, what=""):
    """The last call ran sparse, or, for a method that declines chunked prefill, dense with that reason."""
    entry = last()
    if chunked and method in FULL_PREFILL_ONLY:
        assert entry.last_path == "dense" and "full prefill" in entry.last_reason, (what, entry.last_reason)
    else:
        assert entry.last_path == "sparse", (what, entry.last_reason)
        assert entry.last_reason.startswith(f"method {method} ("), (what, entry.last_reason)


def test_every_method_of_the_package_is_covered():
    """The parametrisations below name BUILT_IN (stable test ids whatever other tests register): it must be every
    method the package itself registers."""
    own = {name for name, spec in registered_methods().items() if spec.select.__module__.startswith("sparse_compile.")}
    assert own == set(BUILT_IN)


# --------------------------------------------------------------- keep-all settings: the reference path on CPU

# batch, Hq, Hkv, Nq, Nk, D, dtype: prime and unaligned lengths (blocks of 16 and 32), GQA 1 to 16, chunked prefill
SHAPES = [
    (1, 1, 1, 2, 2, 16, torch.float32),  # the shortest prompt that runs sparse (min_seq_len 2)
    (2, 2, 2, 17, 17, 32, torch.float32),  # GQA 1, batch 2
    (1, 4, 2, 61, 61, 64, torch.float16),  # GQA 2
    (3, 4, 1, 127, 127, 16, torch.float32),  # GQA 4, batch 3
    (1, 8, 1, 131, 131, 40, torch.float32),  # GQA 8, head dim 40: padded on chip
    (1, 16, 1, 61, 61, 80, torch.bfloat16),  # GQA 16, head dim 80
    (2, 8, 2, 17, 61, 32, torch.float32),  # chunked prefill: 17 queries at the end of 61 keys
    (1, 2, 1, 2, 131, 16, torch.float16),  # chunked: 2 queries after 129 cached keys
    (1, 16, 1, 61, 127, 64, torch.float32),  # chunked, GQA 16
]


def _shape_id(shape):
    *dims, dtype = shape
    return "x".join(map(str, dims)) + "-" + str(dtype).split(".")[-1]


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("method", BUILT_IN)
def test_keep_all_is_within_twice_sdpa_error(method, shape):
    B, Hq, Hkv, Nq, Nk, D, dtype = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    out = sparse_compile.sparse_attention(q, k, v, config=keep_all(method))
    assert_ran(method, Nq < Nk, shape)
    assert_within_sdpa_error(out, q, k, v, what=f"{method} {shape}")


def test_keep_all_with_a_custom_scale_is_within_twice_sdpa_error():
    q, k, v = random_qkv(2, 4, 2, 61, 61, 32)
    for method in BUILT_IN:
        out = sparse_compile.sparse_attention(q, k, v, scale=0.37, config=keep_all(method))
        assert_ran(method, False, method)
        assert_within_sdpa_error(out, q, k, v, scale=0.37, what=method)


# ---------------------------------------------------------------------- keep-all settings: the Triton kernel

# kept tiny: each program of the grid runs in Python under the interpreter
TRITON_SHAPES = [
    (1, 2, 1, 40, 40, 16, torch.float32),  # GQA 2, ragged last block
    (1, 4, 1, 17, 33, 40, torch.float16),  # chunked, GQA 4, head dim 40 (padded on chip)
]


@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("method", BUILT_IN)
def test_keep_all_triton_kernel_is_within_twice_sdpa_error(method, shape):
    B, Hq, Hkv, Nq, Nk, D, dtype = shape
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    out = sparse_compile.sparse_attention(q, k, v, config=keep_all(method, kernel="triton"))
    assert_ran(method, Nq < Nk, shape)
    if not (Nq < Nk and method in FULL_PREFILL_ONLY):
        assert last().last_reason == f"method {method} (triton)"
    assert_within_sdpa_error(out, q, k, v, what=f"{method} triton {shape}")


# ----------------------------------------------------------------------------------------- adversarial shapes


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_one_token_prompts_run_dense_and_exact(kernel):
    """A 1-token prompt (and one query after cached keys: a decode step) cannot run sparse (min_seq_len >= 2):
    dense, exact, with the reason."""
    for shape in ((1, 4, 2, 1, 1, 16), (2, 4, 2, 1, 61, 32), (1, 16, 1, 1, 17, 64)):
        q, k, v = random_qkv(*shape)
        for method in BUILT_IN:
            out = sparse_compile.sparse_attention(q, k, v, config=keep_all(method, kernel=kernel))
            assert last().last_path == "dense" and "decode step" in last().last_reason, (shape, last().last_reason)
            assert_within_sdpa_error(out, q, k, v, what=f"{method} {shape}")


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_zero_length_prompts_give_sdpas_empty_result(kernel):
    """q and k with no tokens (and no queries after cached keys): an empty result, SDPA's shape and dtype."""
    for (B, Hq, Hkv, Nq, Nk, D) in ((1, 2, 2, 0, 0, 16), (2, 4, 2, 0, 0, 32), (2, 8, 1, 0, 17, 64)):
        for dtype in (torch.float32, torch.float16):
            q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
            for method in BUILT_IN:
                out = sparse_compile.sparse_attention(q, k, v, config=keep_all(method, kernel=kernel))
                assert out.shape == want.shape == (B, Hq, 0, D) and out.dtype == want.dtype == dtype
                assert last().last_path == "dense" and "empty input" in last().last_reason


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_head_dims_the_kernels_do_not_serve_run_dense_with_the_reason(kernel):
    """Head dims must be multiples of 8 in [16, MAX]: 8 and 20 run dense, exactly, saying why."""
    for D in (8, 20):
        q, k, v = random_qkv(1, 4, 2, 33, 33, D)
        for method in BUILT_IN:
            out = sparse_compile.sparse_attention(q, k, v, config=keep_all(method, kernel=kernel))
            assert last().last_path == "dense" and f"head dim {D}" in last().last_reason, last().last_reason
            assert_within_sdpa_error(out, q, k, v, what=f"{method} D={D}")


# ------------------------------------------------------------------------------------------ bitwise determinism


#: settings that drop tiles at these lengths (the defaults keep nearly everything below a few hundred tokens:
#: local windows of 8 tiles): a plan that pooled across the batch would show here
SPARSE_SETTINGS = {
    "pbs": dict(threshold=0.5),
    "sparge": dict(cdf_threshold=0.5, similarity_threshold=0.0),
    "bfla": dict(mass_threshold=0.5, local_tiles=1),
    "s2o": dict(early_stop=0.3),
    "sampled": dict(budget=0.1, local_tiles=1, min_budget=0.001, mass_target=0.5),
    "antidiag": dict(budget=0.1, local_tiles=1),
    "peak": dict(budget=0.1, local_tiles=1),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("method", BUILT_IN)
def test_default_settings_are_bitwise_deterministic(method):
    """The same call three times: the same bits, every call sparse. The method's defaults (small blocks) on the
    reference path and the Triton kernel (tiny), and a setting that really drops tiles (``SPARSE_SETTINGS``: the
    defaults keep nearly every tile at these lengths)."""
    defaults = SparseConfig(method=method, **SMALL)
    for config, shape, dtype in ((defaults, (2, 4, 2, 131, 131, 32), torch.float32),
                                 (defaults.replace(kernel="triton"), (1, 2, 1, 24, 24, 16), torch.float16),
                                 (defaults.with_overrides(params=SPARSE_SETTINGS[method]), (2, 4, 2, 131, 131, 32),
                                  torch.float32)):
        q, k, v = random_qkv(*shape, dtype=dtype)
        sparse_compile.reset_runtime_stats()
        outs = [sparse_compile.sparse_attention(q, k, v, config=config) for _ in range(3)]
        assert path_counts() == {"sparse": 3}, last().calls
        assert all(torch.equal(_bits(out), _bits(outs[0])) for out in outs[1:]), f"{method} {config.kernel}"


# ---------------------------------------------------------------------------------------------- batch invariance

def _alone_and_in_batch(config, shape, dtype=torch.float32):
    """The output of one prompt alone and of the same prompt as row 1 of a batch of 3 (rows 0 and 2 random)."""
    q, k, v = random_qkv(3, *shape, dtype=dtype)
    in_batch = sparse_compile.sparse_attention(q, k, v, config=config)[1:2]
    alone = sparse_compile.sparse_attention(q[1:2].clone(), k[1:2].clone(), v[1:2].clone(), config=config)
    assert path_counts() == {"sparse": 2}, last().calls
    return alone, in_batch, (q[1:2], k[1:2], v[1:2])


@pytest.mark.parametrize("method", BUILT_IN)
def test_a_prompt_alone_equals_the_same_prompt_in_a_batch(method):
    """Keep-all: to rounding, on the reference path and the Triton kernel. Sparse settings too: no method pools its
    planning across the batch (PBS and S2O pool over a GQA group's query heads, not over rows), so the same tiles
    are kept alone and in a batch and the outputs agree to rounding (batched and single matmuls may round
    differently: a few float32 ulps, often none). A plan changed by the other rows would differ by ~1e-1. The sparse
    setting must really drop tiles, else the claim is empty."""
    shape = (4, 2, 61, 61, 32)  # Hq, Hkv, Nq, Nk, D
    alone, in_batch, _ = _alone_and_in_batch(keep_all(method), shape)
    torch.testing.assert_close(in_batch, alone, rtol=0, atol=ROUNDING[torch.float32])

    sparse_compile.reset_runtime_stats()
    alone, in_batch, _ = _alone_and_in_batch(keep_all(method, kernel="triton"), (1, 1, 20, 20, 16))
    torch.testing.assert_close(in_batch, alone, rtol=0, atol=ROUNDING[torch.float32])

    sparse_compile.reset_runtime_stats()
    config = SparseConfig(method=method, **SMALL).with_overrides(params=SPARSE_SETTINGS[method])
    alone, in_batch, (q, k, v) = _alone_and_in_batch(config, (4, 2, 131, 131, 32))
    torch.testing.assert_close(in_batch, alone, rtol=0, atol=ROUNDING[torch.float32])
    ref = reference64(q, k, v)
    assert float((alone.double() - ref).norm() / ref.norm()) > 1e-2, f"{method}: the sparse setting kept every tile"


# ------------------------------------------------------------------------------------ the compiled path: recompiles


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


LENGTHS = (17, 31, 61, 64, 100, 131, 2)  # primes, a multiple of the block, the shortest sparse prompt


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_compiled_path_compiles_a_bounded_number_of_graphs_and_runs_every_length_sparse(how, fresh_compile_state):
    """One compiled function over many lengths (and batch sizes, with dynamic=True): the graphs compiled after the
    first two lengths stay the same (no recompile per length), at most 2 in all; every call runs sparse (the
    method's keep-all setting: each within twice SDPA's error). Compiles are counted twice: by a backend that
    wraps ``sparse_prefill`` and by Dynamo's ``unique_graphs``."""
    from sparse_compile.backend import sparse_prefill
    from torch._dynamo.utils import counters

    options = dict(SMALL, method="sampled", budget=1.0)  # sampled's keep-all setting
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(tuple(example_inputs))
        return sparse_prefill(gm, example_inputs, options=options)

    compiled = torch.compile(_attention, backend=counting, dynamic=True if how == "dynamic=True" else None)
    graphs_before = counters["stats"]["unique_graphs"]
    after_two = None
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            batch = 2 + i % 2 if how == "dynamic=True" else 2  # batch sizes of 1 are specialised: 2 and 3
            q, k, v = random_qkv(batch, 4, 2, n, n, 16)
            if how == "mark_dynamic":
                for t in (q, k, v):
                    torch._dynamo.mark_dynamic(t, 2)
            out = compiled(q, k, v)
            assert_within_sdpa_error(out, q, k, v, what=f"length {n}")
            if i == 1:
                after_two = len(compiles)
    assert 1 <= len(compiles) == after_two <= 2, f"{len(compiles)} compiles over lengths {LENGTHS}"
    assert counters["stats"]["unique_graphs"] - graphs_before == len(compiles)
    assert path_counts(COMPILED) == {"sparse": len(LENGTHS)}, last(COMPILED).calls
    assert last(COMPILED).last_reason.startswith("method sampled (")

    # a zero-length prompt through the same function (Dynamo specialises size 0: it may compile once more): SDPA's
    # empty result, the call dense with its reason, not a crash
    with torch.no_grad():
        q, k, v = random_qkv(2, 4, 2, 0, 0, 16)
        out = compiled(q, k, v)
    assert out.shape == (2, 4, 0, 16) and out.dtype == torch.float32
    assert last(COMPILED).last_path == "dense" and "empty input" in last(COMPILED).last_reason, last(COMPILED).calls
