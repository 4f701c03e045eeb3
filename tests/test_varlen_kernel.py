"""The packed launch of varlen calls (``sparse_compile/packed.py``): every sequence of a call decided on its own, the
joinable ones run in one launch of the attention kernel over (plan block, query head).

Under the Triton interpreter (``kernel="triton"``) and in the PyTorch reference (the CPU default): against a
per-sequence float64 reference (zero-length and one-token sequences, sequences shorter than a tile, chunks over a
cache, GQA, lengths from 1 to 300), against today's per-sequence path (``attend_segments(..., joined=False)``: the
same outputs, records and densities), a method's joined selection equal to its per-sequence plans, the exact tail's
rows, keep-all judged against a same-precision SDPA's error, and the fallbacks (S2O's executor, a window, float64 on
the kernels). The serving kernel end to end. GPU tests marked.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, breakeven, kernels, methods, packed, pipeline, serving
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.rules import prefill_length

from helpers import gpu, rel_error
from method_helpers import SMALL

# an empty sequence with keys, a decode token, a prompt, a 3-token chunk over 120 keys, a chunk over a cache, a
# decode token over 33 keys, an empty one, a prompt shorter than a tile, 9 queries over 300 keys
Q_LENS = [0, 1, 150, 3, 70, 1, 0, 9, 9]
K_LENS = [4, 1, 150, 120, 200, 33, 0, 9, 300]
MIN_LEN = 64
JOINED = ("sampled", "peak", "antidiag", "bfla")  # methods whose plans the packed launch takes


@pytest.fixture(autouse=True)
def _fresh_stats():
    sparse_compile.reset_runtime_stats()
    yield


@pytest.fixture
def launches(monkeypatch):
    """How many times the attention kernel's host wrapper ran."""
    run, count = kernels.block_sparse_attention, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(kernels, "block_sparse_attention", counted)
    return count


def _packed(q_lens, k_lens, hq, hkv, d=16, dtype=torch.float32, device="cpu"):
    cq = list(itertools.accumulate([0] + q_lens))
    ck = list(itertools.accumulate([0] + k_lens))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(device, dtype) for n, h in ((cq[-1], hq), (ck[-1], hkv),
                                                                             (ck[-1], hkv)))
    return q, k, v, cq, ck


def _per_sequence(q, k, v, cq, ck, dtype=torch.float64):
    """Each sequence alone, queries at the last positions of its keys, by SDPA in ``dtype`` (float64: the
    reference; the inputs' dtype: what a same-precision dense attention errs by)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dtype, device=q.device)
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 > q0:
            qs, ks, vs = (t.to(dtype).transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            seen = torch.arange(k1 - k0, device=q.device)[None] <= torch.arange(q1 - q0, device=q.device)[:, None] + (
                k1 - k0 - (q1 - q0))
            out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, enable_gqa=True)[0].transpose(0, 1)
    return out


def _both_paths(q, k, v, cq, ck, config):
    """(joined output, its records, per-sequence output, its records) of one varlen call."""
    segments = tuple((a, b, c, d) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]) if b > a)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = {}
    for joined in (True, False):
        sparse_compile.reset_runtime_stats()
        breakeven.HISTORY.clear()  # each path decides from the same (empty) density history
        result = pipeline.attend_segments(q4, k4, v4, None, config, "varlen", segments, joined=joined)
        stats = sparse_compile.runtime_stats()["varlen"]
        out[joined] = (result[0].transpose(0, 1), dict(stats.calls), (stats.density_sum, stats.density_count))
    return out[True], out[False]


def _long(q_lens, k_lens) -> int:
    return sum(1 for a, b in zip(q_lens, k_lens) if a > 1 and prefill_length(a, b) >= MIN_LEN)


@pytest.mark.parametrize("heads, dtype", [((4, 4), torch.float32), ((4, 1), torch.float16), ((6, 2), torch.float32)],
                         ids=["gqa1-float32", "gqa4-float16", "gqa3-float32"])
def test_keep_all_in_one_launch_is_dense_to_rounding(heads, dtype, launches):
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, *heads, dtype=dtype)
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", **SMALL).keep_all()
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck, dtype=torch.int32),
                                          config=config)
    assert launches[0] == 1
    exact = _per_sequence(q, k, v, cq, ck)
    same_precision = _per_sequence(q, k, v, cq, ck, dtype)
    assert rel_error(out, exact) <= 2 * rel_error(same_precision, exact) + 1e-7
    assert torch.equal(out[cq[6]:cq[7]], torch.zeros_like(out[cq[6]:cq[7]]))
    calls = sparse_compile.runtime_stats()["varlen_attention"].calls
    assert sum(calls.values()) == sum(1 for n in Q_LENS if n)  # every sequence a call of its own
    assert sum(n for (path, _), n in calls.items() if path == "sparse") == _long(Q_LENS, K_LENS) == 3
    assert calls[("dense", "decode step (q_len == 1)")] == 2


@pytest.mark.parametrize("method", JOINED + ("pbs", "sparge", "s2o"))
def test_one_launch_gives_what_the_per_sequence_path_gives(method, launches):
    """Sparse selections, not keep-all: the same outputs, the same records (path, reason, count), the same
    densities; the methods the launch cannot take (PBS's key order, Sparge's P.V skip, S2O's executor) run alone."""
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, 4, 2)
    config = SparseConfig(method=method, min_seq_len=MIN_LEN, kernel="triton", record_density=True, **SMALL)
    (joined, joined_calls, joined_density), (alone, alone_calls, alone_density) = _both_paths(q, k, v, cq, ck, config)
    torch.testing.assert_close(joined, alone, rtol=2e-6, atol=2e-6)
    assert joined_calls == alone_calls and joined_density == pytest.approx(alone_density)
    assert any(path == "sparse" for path, _ in joined_calls)
    if method in JOINED:
        # the joined launch; the per-sequence path: one launch per sparse sequence (its dense ones run SDPA)
        assert launches[0] == 1 + _long(Q_LENS, K_LENS)


def test_the_joined_selection_is_each_sequences_own(monkeypatch):
    """The tiles the launch lists for a sequence's blocks are its method's plan for it alone, shifted to its keys."""
    q, k, v, cq, ck = _packed([150, 3, 70, 9], [150, 120, 200, 300], 4, 2)
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", **SMALL)
    made, pack = [], packed.pack

    def kept(segments, *args):
        made.append((segments, pack(segments, *args)))
        return made[-1][1]

    monkeypatch.setattr(packed, "pack", kept)
    sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck), config=config)
    (segments, joined), = made
    rows = joined.block_rows.tolist()
    for index, s in enumerate(segments):
        if s.plan is None:
            continue
        qs, ks = (t.transpose(0, 1)[None] for t in (q[s.q0:s.q1], k[s.k0:s.k1]))
        own = methods.build_plan(qs, ks, None, config)
        heads = own.tile_offsets.shape[1]
        for block, at in enumerate(joined.positions[index]):
            assert rows[at][:2] == [s.q0 + block * own.block_m, min(s.q0 + (block + 1) * own.block_m, s.q1)]
            assert rows[at][2:] == [s.k1, s.k1 - s.q1]
            for h in range(heads):
                n = int(own.tile_counts[0, h, block])
                got = expand_heads(joined.tile_offsets, heads)[0, h, at]
                assert int(expand_heads(joined.tile_counts, heads)[0, h, at]) == n
                assert int(expand_heads(joined.masked_counts, heads)[0, h, at]) == int(own.masked_counts[0, h, block])
                assert (got[:n] - s.k0).tolist() == own.tile_offsets[0, h, block, :n].tolist()
    # the blocks of 16 rows of the prompt, the chunk over a cache and the 9 queries over 300 keys (sparse too)
    assert sum(len(p) for p in joined.positions) == 10 + 5 + 1


def test_the_exact_tail_runs_inside_the_launch():
    """A method's exact tail (the last block_size rows attend to every key) as rows of their own in the launch:
    the per-sequence path's output and density, a sequence shorter than the tail included."""
    q, k, v, cq, ck = _packed([150, 10, 70, 1, 40], [150, 200, 200, 80, 40], 4, 2)
    small = {**SMALL, "sampled": SMALL["sampled"].updated({"exact_tail_blocks": 1, "budget": 0.2})}
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", record_density=True, **small)
    (joined, joined_calls, joined_density), (alone, alone_calls, alone_density) = _both_paths(q, k, v, cq, ck, config)
    torch.testing.assert_close(joined, alone, rtol=2e-6, atol=2e-6)
    assert joined_calls == alone_calls and joined_density == pytest.approx(alone_density)
    exact = _per_sequence(q, k, v, cq, ck)
    for q0, q1 in zip(cq, cq[1:]):  # every sequence's last 16 rows exact
        torch.testing.assert_close(joined[max(q0, q1 - 16):q1].double(), exact[max(q0, q1 - 16):q1], rtol=2e-5,
                                   atol=2e-5)


def test_decode_tokens_beside_larger_blocks_take_a_launch_of_their_own(launches):
    """Method blocks of 32 rows: the decode tokens and short chunks (at most 16 queries) run in 16-row blocks, a
    second launch; the rest of the dense sequences join the method's."""
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, 4, 2)
    small = {**SMALL, "sampled": SMALL["sampled"].updated({"block_size": 32})}
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", record_density=True, **small)
    (joined, joined_calls, joined_density), (alone, alone_calls, alone_density) = _both_paths(q, k, v, cq, ck, config)
    assert launches[0] == 2 + _long(Q_LENS, K_LENS)
    torch.testing.assert_close(joined, alone, rtol=2e-6, atol=2e-6)
    assert joined_calls == alone_calls and joined_density == pytest.approx(alone_density)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_reference_runs_the_joined_plan_on_the_cpu(dtype, launches):
    q, k, v, cq, ck = _packed(Q_LENS, K_LENS, 6, 2, dtype=dtype)
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, **SMALL)
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck), config=config.keep_all())
    assert launches[0] == 0  # the PyTorch reference, no kernel
    assert (out.double() - _per_sequence(q, k, v, cq, ck)).abs().max().item() < (1e-12 if dtype == torch.float64
                                                                                   else 2e-6)
    (joined, joined_calls, _), (alone, alone_calls, _) = _both_paths(q, k, v, cq, ck, config)
    torch.testing.assert_close(joined, alone, rtol=1e-5, atol=1e-5)
    assert joined_calls == alone_calls


def test_a_window_and_float64_on_the_kernels_run_per_sequence(launches):
    q, k, v, cq, ck = _packed([150, 70, 1], [150, 200, 40], 4, 2)
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", **SMALL).keep_all()
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    segments = ((cq[0], cq[1], ck[0], ck[1], 50), (cq[1], cq[2], ck[1], ck[2]), (cq[2], cq[3], ck[2], ck[3]))
    out = pipeline.attend_segments(q4, k4, v4, None, config, "varlen", segments)[0].transpose(0, 1)
    assert launches[0] == 2  # the windowed prompt alone (its exact band plan), then the other two together
    torch.testing.assert_close(out[cq[1]:].double(), _per_sequence(q, k, v, cq, ck)[cq[1]:], rtol=2e-5, atol=2e-5)
    q, k, v = (t.double() for t in (q, k, v))
    out = sparse_compile.varlen_attention(q, k, v, torch.tensor(cq), torch.tensor(ck), config=config)
    assert launches[0] == 2 and (out - _per_sequence(q, k, v, cq, ck)).abs().max().item() < 1e-12


def test_the_serving_kernel_runs_one_launch(monkeypatch, launches):
    """``flash_attn_varlen_func`` as continuous batching calls it: rows past the last offset (padding), more
    queries than keys (the first see none), decode tokens; one launch, each sequence recorded."""
    config = SparseConfig(method="sampled", min_seq_len=MIN_LEN, kernel="triton", **SMALL).keep_all()
    monkeypatch.setenv(serving.CONFIG_VARIABLE, config.to_json())
    q, k, v, cq, ck = _packed([130, 1, 12, 1, 4], [130, 60, 5, 90, 0], 4, 2)
    q = torch.cat([q, torch.randn(3, 4, 16)])  # a batch padded to a fixed size
    out = serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq, dtype=torch.int32),
                                         torch.tensor(ck, dtype=torch.int32), causal=True)
    assert launches[0] == 1
    want = _per_sequence(q, k, v, cq + [q.shape[0]], ck + [ck[-1]])
    want[cq[2]:cq[2] + 7] = 0  # 12 queries over 5 keys: the first 7 see none
    want[cq[4]:] = 0  # no keys; padding
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    calls = sparse_compile.runtime_stats()["varlen_attention"].calls
    assert sum(calls.values()) == 4 and calls[("dense", "decode step (q_len == 1)")] == 2


def test_the_packed_table_is_checked(launches):
    from sparse_compile.kernels.attention import block_sparse_attention

    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    offs, counts = torch.zeros(1, 2, 2, 1, dtype=torch.int32), torch.ones(1, 2, 2, dtype=torch.int32)
    rows = torch.tensor([[0, 32, 40, 0], [32, 40, 40, 0]], dtype=torch.int32)
    for bad, said in ((rows.long(), "block_rows must be a contiguous int32"), (rows[:1], "expected"),
                      (rows.T.contiguous().T, "block_rows must be a contiguous int32")):
        with pytest.raises(ValueError, match=said):
            block_sparse_attention(q, k, v, offs, counts, counts, block_m=32, block_n=32, block_rows=bad)
    with pytest.raises(ValueError, match="chunk"):
        block_sparse_attention(q, k, v, offs, counts, counts, block_m=32, block_n=32, block_rows=rows, chunk=8)
    with pytest.raises(ValueError, match="packed sequences"):
        block_sparse_attention(q, k, v, offs, counts, counts, block_m=32, block_n=32, block_rows=rows,
                               backend="hopper")


@gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("method", ["sampled", "pbs"])
def test_gpu_one_launch_matches_the_per_sequence_path_in_bfloat16(method, backend, monkeypatch):
    """bf16 at serving sizes; ``auto`` on sm_90 leaves the long prompts to the Hopper kernel, ``triton`` joins them."""
    monkeypatch.setenv("SPARSE_COMPILE_ATTENTION_BACKEND", backend)
    q_lens = [0, 1, 4096, 3, 1000, 1, 77, 2048, 1]
    k_lens = [9, 1, 4096, 5000, 3000, 300, 77, 8192, 16000]
    q, k, v, cq, ck = _packed(q_lens, k_lens, 32, 8, d=128, dtype=torch.bfloat16, device="cuda")
    config = SparseConfig(method=method, min_seq_len=1024, record_density=True)
    (joined, joined_calls, joined_density), (alone, alone_calls, alone_density) = _both_paths(q, k, v, cq, ck, config)
    assert joined_calls == alone_calls and joined_density == pytest.approx(alone_density, abs=1e-6)
    exact = _per_sequence(q, k, v, cq, ck)
    assert rel_error(joined, exact) <= 2 * rel_error(alone, exact) + 1e-3
    (keep, _, _), _ = _both_paths(q, k, v, cq, ck, config.keep_all())
    assert rel_error(keep, exact) <= 2 * rel_error(_per_sequence(q, k, v, cq, ck, torch.bfloat16), exact)
    assert math.isfinite(rel_error(keep, exact))
