"""The mask proof is a proof: a rewritten site never changes a result, whatever constants the mask is built from.

A mask built inside the graph is rewritten only when ``masks.analyse_mask`` establishes it for every length the
graph can run at (static shapes: the traced one; dynamic shapes: all of them). Windows and chunks whose width is a
float, a module attribute, a tensor computed from constants, at static and dynamic shapes, must never run as plain
causal attention wherever the window can bite: dense, or proven with the width they have (``Local``); a padding mask read as ``am > 0`` must not treat -1 as a valid key. The property test
generates a few hundred mask programs and checks, with the keep-everything setting, that the compiled program
equals eager, and that the common causal constructions are still proven.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.local import Local
from sparse_compile.rewrite import rewrite_graph

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")


KEEP_ALL = SparseConfig(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32}).keep_all()


def _recording_compile(fn, dynamic):
    """``fn`` compiled by a backend that rewrites each graph at keep-all and records its sites: (compiled, records)."""
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, KEEP_ALL))
        return gm.forward

    return torch.compile(fn, backend=backend, dynamic=dynamic), records


def sparse_calls() -> int:
    return sum(n for s in sparse_compile.runtime_stats().values() for (path, _), n in s.calls.items()
               if path == "sparse")


# -- the defects, each through the registered backend with Inductor ----------------------------------------------
class Windowed(nn.Module):
    """Sliding-window and chunked masks whose width is not an integer literal."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.W = 64.0
        self.window = 128
        self.C = 64.0

    def forward(self, q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        if self.how == "float_attribute":
            keep = (j <= i) & (j > i - self.W)
        elif self.how == "half_attribute":
            keep = (j <= i) & (j > i - self.window / 2)
        elif self.how == "tensor_width":
            keep = (j <= i) & ((i - j) < torch.ones(()) * 8 * 8)
        else:  # float chunk size
            keep = (j <= i) & (torch.div(i, self.C, rounding_mode="floor") == torch.div(j, self.C,
                                                                                       rounding_mode="floor"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("how", ["float_attribute", "half_attribute", "tensor_width", "float_chunk"])
def test_window_whose_width_is_not_an_int_literal_is_never_run_as_causal(how, dynamic):
    """Never plain causal: dense, or a window / chunks of 64 keys, equal to eager."""
    model = Windowed(how)
    q, k, v = torch.randn(3, 1, 2, 160, 16).unbind(0)
    compiled = torch.compile(model, backend="sparse_prefill", options=KEEP_ALL, dynamic=dynamic)
    with torch.no_grad():
        out = compiled(q, k, v)
        ref = model(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    reasons = [r for s in sparse_compile.runtime_stats().values() for (path, r) in s.calls if path == "sparse"]
    assert all("sliding window 64" in r or "chunks of 64" in r for r in reasons), reasons


class Padded(nn.Module):
    """Causal AND a padding mask derived from the tokenizer's ``attention_mask`` by some test."""

    def __init__(self, test: str):
        super().__init__()
        self.test = test

    def forward(self, q, k, v, am):
        n = q.shape[-2]
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        valid = {"gt0": lambda: am > 0, "ge1": lambda: am >= 1, "ne0": lambda: am != 0,
                 "bool": lambda: am.bool()}[self.test]()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal[None, None] & valid[:, None, None, :])


def padding_with_minus_one(batch: int, n: int) -> torch.Tensor:
    am = torch.ones(batch, n, dtype=torch.long)
    am[0, :5] = 0
    am[0, 20:30] = -1
    am[1, 7] = -1
    am[1, 9] = 2
    return am


@pytest.mark.parametrize("test, dynamic", [("gt0", False), ("ge1", True)])
def test_padding_read_as_greater_than_zero_refuses_minus_one(test, dynamic):
    """``am > 0`` masks the -1 keys, the op would keep them: proven for 0/1 values only, other values an error."""
    model = Padded(test)
    q, k, v = torch.randn(3, 2, 2, 48, 16).unbind(0)
    compiled = torch.compile(model, backend="sparse_prefill", options=KEEP_ALL, dynamic=dynamic)
    ones_and_zeros = torch.ones(2, 48, dtype=torch.long)
    ones_and_zeros[0, :5] = 0
    with torch.no_grad():
        out = compiled(q, k, v, ones_and_zeros)  # 0/1: proven, sparse, equal
        valid = ones_and_zeros.bool()
        ref = model(q, k, v, ones_and_zeros)
        torch.testing.assert_close(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-4, atol=1e-5)
        assert sparse_calls() == 1
        with pytest.raises(ValueError, match="values other than 0 and 1"):
            compiled(q, k, v, padding_with_minus_one(2, 48))


@pytest.mark.parametrize("test, dynamic", [("ne0", False), ("bool", True)])
def test_padding_read_as_nonzero_is_proven_for_every_value(test, dynamic):
    model = Padded(test)
    q, k, v = torch.randn(3, 2, 2, 48, 16).unbind(0)
    am = padding_with_minus_one(2, 48)
    compiled = torch.compile(model, backend="sparse_prefill", options=KEEP_ALL, dynamic=dynamic)
    with torch.no_grad():
        out = compiled(q, k, v, am)
        ref = model(q, k, v, am)
    valid = am != 0
    torch.testing.assert_close(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-4, atol=1e-5)
    assert sparse_calls() == 1


# -- other constructions of the same class: constants hidden in arithmetic, slopes, scalars, mutations ------------
def _grid(n):
    return torch.arange(n)[:, None], torch.arange(n)[None, :]


HOSTILE = {
    "clamp_saturates": lambda i, j, n: (j <= i) & (torch.clamp(i - j, max=64) < 64),
    "window_after_division": lambda i, j, n: (j <= i) & ((i - j) / 64 < 1.5),
    "window_after_scaling": lambda i, j, n: (j <= i) & ((i - j) * 0.5 < 32),
    "per_head_slopes": lambda i, j, n: (j <= i) & ((i - j) * torch.tensor([1.0, 0.25])[:, None, None] < 16),
    "per_head_offsets": lambda i, j, n: (j <= i) & ((i - j) - torch.tensor([0.0, 48.0])[:, None, None] < 16),
    "one_key_masked": lambda i, j, n: (j <= i) & (j != 100),
    "extra_diagonal": lambda i, j, n: (j <= i) | (j == i + 64),
    "length_compared_as_tensor": lambda i, j, n: (j <= i) | ((j < 5) & (torch.ones((), dtype=torch.long) * n >= 64)),
    "constant_from_arange": lambda i, j, n: (j <= i) & ((i - j) <= torch.arange(64).max()),
    "periodic_blocks": lambda i, j, n: (j <= i) & ((i // 64) % 2 == (j // 64) % 2),
    "documents": lambda i, j, n: (j <= i) & ((i < 100) == (j < 100)),
    "constant_via_item": lambda i, j, n: (j <= i) & ((i - j) < (torch.ones(()) * 64).item()),
    "window_min_length": lambda i, j, n: (j <= i) & (i - j < min(n, 64)),
    "window_never_bites": lambda i, j, n: (j <= i) & (i - j < max(n - 64, 1) + 64),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_constants_hidden_in_arithmetic_never_change_a_result(name, dynamic):
    build = HOSTILE[name]

    def attention(q, k, v):
        i, j = _grid(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(i, j, q.shape[-2]))

    compiled, records = _recording_compile(attention, dynamic=dynamic)
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        for n in (150,) if not dynamic else (37, 150):
            q, k, v = torch.randn(3, 1, 2, n, 16).unbind(0)
            ref = attention(q, k, v)
            rows = torch.isfinite(ref).all(-1)
            torch.testing.assert_close(compiled(q, k, v)[rows], ref[rows], rtol=1e-4, atol=1e-5)
    assert records
    if name == "window_never_bites":  # causal at every length: proven
        assert all(r.rewritten for r in records), [r.reason for r in records]


BATCH_READS = {
    "rows_counted": lambda i, j, b, am: (j <= i)[None, None] & (torch.arange(b) < 4)[:, None, None, None],
    "prefix_from_batch": lambda i, j, b, am: ((j <= i) | (j < b - 1))[None, None].expand(b, 1, -1, -1),
    "rows_selecting_padding": lambda i, j, b, am: (j <= i)[None, None] & am[torch.arange(b)[:, None, None, None],
                                                                              j[None, None]].bool(),
}


@pytest.mark.parametrize("name", list(BATCH_READS))
def test_mask_that_reads_a_dynamic_batch_by_value(name):
    """The batch keeps its traced value in every evaluation: a mask whose pattern depends on it stays dense."""
    build = BATCH_READS[name]

    def attention(q, am):
        i, j = _grid(q.shape[-2])
        return F.scaled_dot_product_attention(q, q, q, attn_mask=build(i, j, q.shape[0], am))

    compiled, records = _recording_compile(attention, dynamic=True)
    with torch.no_grad():
        for batch in (2, 6):
            q = torch.randn(batch, 2, 40, 16)
            am = torch.ones(batch, 40, dtype=torch.long)
            am[0, :3] = 0
            rows = am != 0
            torch.testing.assert_close(compiled(q, am).transpose(1, 2)[rows], attention(q, am).transpose(1, 2)[rows],
                                       rtol=1e-4, atol=1e-5)
    assert records and all(r.rewritten == (name == "rows_selecting_padding") for r in records), \
        [r.reason for r in records]


# -- the property test -----------------------------------------------------------------------------------------
FAMILIES = ("causal", "causal", "window", "window_gt", "chunk", "sink", "prefix_lm", "offset")
CAUSAL_STYLES = ("le", "tril", "not_gt", "difference")
WIDTH_KINDS = ("int", "float", "half", "tensor", "tensor_product", "buffer", "size_min")
OUTPUT_STYLES = ("bool", "float_inf", "float_min")
PADDING_TESTS = (None, None, "ne0", "bool", "to_bool", "gt0", "ge1", "eq1", "additive")
ALL_VALUES = {"ne0", "bool", "to_bool"}  # tests that read only "nonzero": every value means what it means to the op


@dataclass(frozen=True)
class Program:
    family: str
    causal: str
    width: float
    width_kind: str
    style: str
    padding: Optional[str]
    dynamic: bool
    lengths: tuple

    def causal_at(self, n: int) -> bool:
        """Whether the mask is the causal mask (AND the padding) at ``n`` tokens."""
        w = self.width
        if self.family == "causal":
            return True
        if self.family in ("window", "window_gt", "chunk"):
            return n - 1 < w  # the window never bites, or everything is one chunk
        if self.family in ("sink", "prefix_lm"):
            return w <= 1
        return w == 0  # offset

    def always_causal(self) -> bool:
        """At every length the graph can run at: the traced one, or every one under dynamic shapes."""
        if self.dynamic:
            return all(self.causal_at(n) for n in range(2, 1000))
        return self.causal_at(self.lengths[0])

    def must_be_proven(self) -> bool:
        """Causal, and built from nothing the proof must refuse: a buffer or (dynamic) a float attribute is a
        graph input whose value can change without a recompile."""
        if not self.always_causal() or (self.family != "causal" and self.width_kind == "buffer"):
            return False
        return not (self.dynamic and self.family != "causal")


class MaskProgram(nn.Module):
    def __init__(self, p: Program, chunked: bool = False):
        super().__init__()
        self.p = p
        self.chunked = chunked  # the queries are the last positions of longer keys (chunked prefill)
        self.width_int = int(p.width)
        self.width_float = float(p.width)
        self.double_width = 2 * p.width
        self.register_buffer("width_buffer", torch.tensor(float(p.width)))

    def width(self, n):
        kind = self.p.width_kind
        if kind == "int":
            return self.width_int
        if kind == "float":
            return self.width_float
        if kind == "half":
            return self.double_width / 2
        if kind == "tensor":
            return torch.ones(()) * self.width_float
        if kind == "tensor_product":
            return torch.ones(()) * 4 * (self.width_float / 4)
        if kind == "buffer":
            return self.width_buffer
        return min(n, self.width_int)  # size_min

    def keep(self, n, am: torch.Tensor, nk=None) -> torch.Tensor:
        """The mask of ``n`` queries at the last positions of ``nk`` keys (``n`` by default)."""
        p = self.p
        nk = n if nk is None else nk
        i = torch.arange(nk - n, nk)[:, None]
        j = torch.arange(nk)[None, :]
        if p.causal == "le":
            keep = j <= i
        elif p.causal == "tril":
            keep = torch.ones(n, nk, dtype=torch.bool).tril(nk - n)
        elif p.causal == "not_gt":
            keep = ~(j > i)
        else:
            keep = (i - j) >= 0
        if p.family != "causal":
            w = self.width(n)
            if p.family == "window":
                keep = keep & ((i - j) < w)
            elif p.family == "window_gt":
                keep = keep & (j > i - w)
            elif p.family == "chunk":
                keep = keep & (torch.div(i, w, rounding_mode="floor") == torch.div(j, w, rounding_mode="floor"))
            elif p.family == "sink":
                keep = keep | (j < w)
            elif p.family == "prefix_lm":
                keep = keep | ((i < w) & (j < w))
            else:  # offset
                keep = j <= i + w
        keep = keep[None, None]
        test = p.padding
        if test is None or test == "additive":
            return keep
        if test == "ne0":
            valid = am != 0
        elif test == "bool":
            valid = am.bool()
        elif test == "to_bool":
            valid = am.to(torch.bool)
        elif test == "gt0":
            valid = am > 0
        elif test == "ge1":
            valid = am >= 1
        else:
            valid = am == 1
        return keep & valid[:, None, None, :]

    def forward(self, q, k, v, am):
        keep = self.keep(q.shape[-2], am, k.shape[-2] if self.chunked else None)
        style = self.p.style
        if self.p.padding == "additive":  # transformers 4.46-4.52: 0/1 padding added to a float causal mask
            low = torch.finfo(q.dtype).min
            mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, low)
            mask = mask.masked_fill((mask + am[:, None, None, :]) == 0, low)
        elif style == "bool":
            mask = keep
        elif style == "float_inf":
            mask = torch.where(keep, 0.0, float("-inf"))
        else:
            mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Programs(nn.Module):
    """Many programs in one graph (one trace for all): each its own attention site, proven on its own."""

    def __init__(self, programs, chunked: bool = False):
        super().__init__()
        self.programs = nn.ModuleList(MaskProgram(p, chunked) for p in programs)

    def forward(self, q, k, v, am):
        return [m(q, k, v, am) for m in self.programs]


@dataclass(frozen=True)
class Group:
    programs: tuple
    dynamic: bool
    lengths: tuple
    odd_values: bool  # the padding holds -1 and 2 as well as 0 and 1


def random_group(rng: random.Random, size: int) -> Group:
    dynamic = rng.random() < 0.5
    n0 = rng.randint(3, 80)
    lengths = (n0, rng.choice([n0 + 1, 2 * n0 + 3, rng.randint(3, 100)])) if dynamic else (n0,)
    programs = []
    for _ in range(size):
        family = rng.choice(FAMILIES)
        kind = rng.choice(WIDTH_KINDS)
        if family == "offset":
            width = float(rng.choice([0, 0, 1, 2, -1, 5]))
        elif family in ("sink", "prefix_lm"):
            width = float(rng.choice([1, 2, 3, 8, 40]))
        else:  # where the window bites at one of the lengths, just not, or not at all
            n = rng.choice(lengths)
            width = float(max(2, rng.choice([n - 2, n - 1, n, n + 1, 2 * n, rng.randint(2, 90)])))
            if kind in ("float", "half", "tensor", "tensor_product", "buffer") and rng.random() < 0.3:
                width += 0.5
        programs.append(Program(family=family, causal=rng.choice(CAUSAL_STYLES), width=width, width_kind=kind,
                                style=rng.choice(OUTPUT_STYLES), padding=rng.choice(PADDING_TESTS),
                                dynamic=dynamic, lengths=lengths))
    return Group(tuple(programs), dynamic, lengths, odd_values=rng.random() < 0.3)


def padding_for(group: Group, batch: int, n: int) -> torch.Tensor:
    am = torch.ones(batch, n, dtype=torch.long)
    am[0, : min(3, n - 1)] = 0  # left padding
    am[1, n - 1] = 0  # right padding
    if group.odd_values:
        am[1, ::3] = -1
        am[0, n - 1] = 2
    return am


def run_group(group: Group, backend, options=None) -> list:
    """Compile the group's programs with ``backend`` and call them at each length: (n, outputs, eager, am, error)."""
    model = Programs(group.programs)
    compiled = torch.compile(model, backend=backend, dynamic=group.dynamic, options=options)
    generator = torch.Generator().manual_seed(zlib.crc32(repr(group).encode()))
    results = []
    for n in group.lengths:
        q, k, v = torch.randn(3, 2, 2, n, 16, generator=generator).unbind(0)
        am = padding_for(group, 2, n)
        with torch.no_grad():
            ref = model(q, k, v, am)
            try:
                out, error = compiled(q, k, v, am), None
            except ValueError as exc:  # the op's refusal of padding values the proof did not cover
                out, error = None, exc
        results.append((n, out, ref, am, error))
    return results


def assert_equal(p: Program, out: torch.Tensor, ref: torch.Tensor, am: torch.Tensor, what: str) -> None:
    # rows compared: eager's row keeps a key (SDPA gives NaN for a fully masked row) and, with padding, the query is
    # a valid token (padded query rows are undefined everywhere)
    rows = torch.isfinite(ref).all(-1).all(1)  # (batch, n)
    if p.padding is not None:
        rows &= am != 0
    torch.testing.assert_close(out.transpose(1, 2)[rows], ref.transpose(1, 2)[rows], rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"{p} {what}: {m}")


GROUPS = [random_group(random.Random(seed), size=20) for seed in range(10)]  # 200 programs


def test_random_mask_programs_never_change_a_result():
    """Every program through the real rewrite pass (the rewritten graph runs without Inductor): compiled equals
    eager; a rewritten mask is causal at every length the graph runs at; the causal constructions are proven."""
    proven = 0
    for group in GROUPS:
        torch._dynamo.reset()
        graphs = []  # one list of records per compiled graph (a guard on min(length, width) compiles two)

        def backend(gm, example_inputs):
            graphs.append(rewrite_graph(gm, KEEP_ALL))
            return gm.forward

        results = run_group(group, backend)
        assert graphs, f"{group}: never compiled"
        records = [r for graph in graphs for r in graph]
        for graph in graphs:
            assert len(graph) == len(group.programs), f"{group}: traced {len(graph)} sites"
            for p, record in zip(group.programs, graph):  # sites in program order
                assert not record.rewritten or p.always_causal() or names_its_window(p, record.reason), \
                    f"{p}: rewritten, not causal ({record.reason})"
                assert record.rewritten or not p.must_be_proven(), f"{p}: a causal mask not proven: {record.reason}"
                if record.rewritten and p.padding is not None:
                    binary = "(0/1 padding values)" in record.reason
                    assert binary == (p.padding not in ALL_VALUES), (p, record.reason)
                proven += record.rewritten
        for n, outs, refs, am, error in results:
            if error is not None:  # only a site proven for 0/1 values may refuse, and only other values
                assert group.odd_values and "values other than 0 and 1" in str(error), (group, error)
                assert any(r.rewritten and "(0/1 padding values)" in r.reason for r in records)
                continue
            for p, out, ref in zip(group.programs, outs, refs):
                assert_equal(p, out, ref, am, f"at {n} tokens")
    assert proven >= sum(len(g.programs) for g in GROUPS) // 3  # the proof is not just refusing


def names_its_window(p: Program, reason: str) -> bool:
    """Whether ``reason`` names the window / chunk size that ``p``'s mask has at every length it runs at (a proof
    of ``Local``; the padding is proven on its own)."""
    window, chunk = re.search(r"sliding window (\d+)", reason), re.search(r"chunks of (\d+)", reason)
    if window is None and chunk is None:
        return False
    local = Local(window=int(window.group(1)) if window else 0, chunk=int(chunk.group(1)) if chunk else 0)
    program = MaskProgram(p)
    for n in (range(2, 300) if p.dynamic else p.lengths[:1]):
        got = program.keep(n, torch.ones(2, n, dtype=torch.long))[0, 0]
        if not torch.equal(got, local.visible(torch.arange(n), torch.arange(n))):
            return False
    return True


def test_names_its_window_reads_the_width():
    p = Program("window_gt", "le", 12.5, "float", "bool", None, True, (20, 41))
    assert names_its_window(p, "causal mask AND sliding window 13 proven from the graph")
    assert not names_its_window(p, "causal mask AND sliding window 12 proven from the graph")
    assert not names_its_window(p, "causal mask proven from the graph")


INDUCTOR_PROGRAMS = [g.programs[i] for i, g in enumerate(GROUPS[:8])]


@pytest.mark.parametrize("p", INDUCTOR_PROGRAMS, ids=lambda p: f"{p.family}-{p.width_kind}-{p.dynamic}")
def test_random_mask_programs_through_inductor(p):
    """A few programs through the registered backend with Inductor; sparse calls counted by ``runtime_stats()``."""
    group = Group((p,), p.dynamic, p.lengths, odd_values=False)
    results = run_group(group, "sparse_prefill", KEEP_ALL)
    for n, outs, refs, am, error in results:
        assert error is None
        assert_equal(p, outs[0], refs[0], am, f"at {n} tokens")
    calls = sparse_calls()
    reasons = [r for s in sparse_compile.runtime_stats().values() for (path, r) in s.calls if path == "sparse"]
    # not causal: dense, or run with the window / chunks its mask has at every length (named where they bind)
    ran_causal = all(p.causal_at(n) for n in p.lengths)
    assert all(ran_causal or names_its_window(p, r) for r in reasons) if not p.always_causal() else \
        (calls == len(p.lengths) or not p.must_be_proven()), (p, sparse_compile.runtime_stats())


# -- chunked prefill: a static chunk of queries over a growing cache -------------------------------------------------
CHUNK_GROUPS = [random_group(random.Random(100 + seed), size=12) for seed in range(4)]


@pytest.mark.parametrize("group", CHUNK_GROUPS, ids=lambda g: f"chunk{g.lengths[0]}")
def test_random_mask_programs_over_a_growing_cache(group):
    """The same programs with a static chunk of queries (the last positions) over a key length Dynamo made
    symbolic: every rewritten mask gives eager's result at cache lengths far from the traced ones, and the plain
    causal constructions are proven."""
    torch._dynamo.reset()
    chunk = group.lengths[0]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(rewrite_graph(gm, KEEP_ALL))
        return gm.forward

    model = Programs(group.programs, chunked=True)
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(zlib.crc32(repr(group).encode()))
    for past in (7, 2, 41, 3 * chunk + 5, 180):
        n = chunk + past
        q = torch.randn(2, 2, chunk, 16, generator=generator)
        k, v = torch.randn(2, 2, 2, n, 16, generator=generator).unbind(0)
        am = padding_for(group, 2, n)
        for tensor, dim in ((k, 2), (v, 2), (am, 1)):
            torch._dynamo.mark_dynamic(tensor, dim)
        with torch.no_grad():
            refs = model(q, k, v, am)
            try:
                outs = compiled(q, k, v, am)
            except ValueError as exc:
                assert group.odd_values and "values other than 0 and 1" in str(exc), (group, exc)
                continue
        for p, out, ref in zip(group.programs, outs, refs):
            assert_equal(p, out, ref, am[:, past:], f"with {past} cached keys")
    records = [r for graph in graphs for r in graph]
    symbolic = [graph for graph in graphs if any("s" in str(r.k_shape[-2]) for r in graph)]
    assert symbolic, "the key length never became symbolic"
    for graph in symbolic:
        for p, record in zip(group.programs, graph):
            plain = p.family == "causal" or (p.family == "offset" and p.width == 0)
            if plain and p.width_kind != "buffer" and not group.odd_values:
                assert record.rewritten, f"{p}: a causal mask over a growing cache not proven: {record.reason}"
    assert records


# -- a mask sized by another cache's length ----------------------------------------------------------------------
def test_mask_sized_by_another_length_of_the_prefix_is_proven_and_guarded():
    """transformers builds the mask once from layer 0's cache; a later layer's keys are sized by its own cache, a
    separate symbol to Dynamo. The mask's key dim (other + q_len) must equal kv_len (past + q_len) for SDPA: the
    proof gives ``other`` the prefix's value, and a call where they differ re-traces and fails as eager does."""
    def attention(q, k, other):
        nq, past = q.shape[-2], other.shape[-1]
        i = torch.arange(nq)[:, None] + past
        j = torch.arange(past + nq)[None, :]
        return F.scaled_dot_product_attention(q, k, k, attn_mask=(j <= i)[None, None])

    compiled, records = _recording_compile(attention, dynamic=True)
    with torch.no_grad():
        for nq, past in ((20, 30), (33, 7), (5, 60)):
            q, k, other = torch.randn(1, 2, nq, 16), torch.randn(1, 2, past + nq, 16), torch.zeros(1, past)
            torch.testing.assert_close(compiled(q, k, other), attention(q, k, other), rtol=1e-4, atol=1e-5)
        assert records and all(r.rewritten for r in records), [r.reason for r in records]
        q, k, other = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 50, 16), torch.zeros(1, 25)
        with pytest.raises(RuntimeError, match="must match the size"):
            attention(q, k, other)
        with pytest.raises(RuntimeError):
            compiled(q, k, other)
