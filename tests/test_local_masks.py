"""Sliding windows and chunks proven from the graph (``masks.analyse_mask`` -> ``MaskMatch.local``) and checked at run
time (``runtime_mask.check_runtime_mask`` -> ``MaskVerdict.local``).

The property: whatever a mask program computes, a proof names the window W and chunk size C of the mask at every
length the graph runs at, or none (NotProven) -- never a wrong one. Each proven program's mask is evaluated again at
lengths the proof never looked at (well past its widths) with left, right and hole-y padding and compared with
``Local(W, C).visible`` AND the padding. Windows written several ways, transformers' chunks counted from each row's
first valid key, and constructions that are not one window (a window per head, a window OR a sink, a window with a
key cut out, a window that widens at some position, chunks counted from key 0 under left padding, a non-integer chunk)
are generated; the transformers constructions with integer widths must be proven, with their exact widths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparse_compile.local import Local
from sparse_compile.masks import MaskMatch, NotProven
from sparse_compile.rewrite import find_sdpa_calls
from sparse_compile.runtime_mask import check_runtime_mask

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# families proven with an exact width (integer widths); the others must be proven right or not at all
EXACT = {"window_lt": lambda w: Local(window=w), "window_gt": lambda w: Local(window=w),
         "window_le": lambda w: Local(window=w + 1), "band": lambda w: Local(window=w),
         "chunk_hf": lambda w: Local(chunk=w), "window_chunk_hf": lambda w: Local(window=w, chunk=2 * w + 1)}
TRAPS = ("per_head", "window_or_sink", "window_minus_key", "widens", "chunk_raw", "chunk_float", "window_float",
         "window_of_length")
FAMILIES = tuple(EXACT) + TRAPS


@dataclass(frozen=True)
class Program:
    family: str
    width: int
    padded: bool  # reads a (batch, kv_len) attention_mask
    style: str  # bool or float


def first_valid(am: torch.Tensor) -> torch.Tensor:
    """transformers' left_padding: the number of zeros before the first one (create_chunked_causal_mask)."""
    return (am.cumsum(-1) == torch.zeros_like(am)).sum(-1)[:, None, None, None]


def program_mask(p: Program, nq: int, nk: int, am: torch.Tensor) -> torch.Tensor:
    """The (batch, heads or 1, nq, nk) bool mask of ``p``, queries at the last positions."""
    w = p.width
    i = torch.arange(nk - nq, nk)[:, None]
    j = torch.arange(nk)[None, :]
    causal = j <= i
    f = p.family
    if f == "window_lt":
        keep = causal & (i - j < w)
    elif f == "window_gt":  # transformers' sliding_window_overlay
        keep = causal & (j > i - w)
    elif f == "window_le":  # a window of w + 1 keys, written with <=
        keep = causal & (i - j <= w)
    elif f == "band":  # tril/triu (transformers 4.46-4.52 style)
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq).triu(nk - nq - w + 1)
    elif f in ("chunk_hf", "window_chunk_hf"):
        lp = first_valid(am) if p.padded else 0
        c = w if f == "chunk_hf" else 2 * w + 1
        keep = causal & (torch.div(j - lp, c, rounding_mode="floor") == torch.div(i - lp, c, rounding_mode="floor"))
        if f == "window_chunk_hf":
            keep = keep & (j > i - w)
    elif f == "per_head":
        widths = torch.tensor([w, w + 3])[:, None, None]
        keep = causal & (i - j < widths)
    elif f == "window_or_sink":
        keep = (causal & (i - j < w)) | (j < 2)
    elif f == "window_minus_key":
        keep = causal & (i - j < w) & (j != w + 5)
    elif f == "widens":  # one more key from position 3w on
        keep = causal & (i - j < w + (i >= 3 * w).long())
    elif f == "chunk_raw":  # chunks from key 0 (older transformers): differ under left padding
        keep = causal & (i // w == j // w)
    elif f == "chunk_float":
        keep = causal & (torch.div(i, w + 0.5, rounding_mode="floor") == torch.div(j, w + 0.5, rounding_mode="floor"))
    elif f == "window_float":  # i - j < w + 0.5 is a window of w + 1
        keep = causal & (i - j < w + 0.5)
    else:  # window_of_length: the width grows with the length
        keep = causal & (i - j < nk // 3 + 1)
    while keep.dim() < 4:
        keep = keep[None]
    if p.padded:
        keep = keep & (am != 0)[:, None, None, :]
    return keep


class MaskPrograms(nn.Module):
    def __init__(self, programs):
        super().__init__()
        self.programs = programs

    def forward(self, q, k, v, am):
        outs = []
        for p in self.programs:
            keep = program_mask(p, q.shape[-2], k.shape[-2], am)
            mask = keep if p.style == "bool" else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(
                ~keep, torch.finfo(q.dtype).min)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return outs


def proofs(programs, q, k, am, dynamic, mark_keys=False) -> list:
    """What ``analyse_mask`` says of each program's mask, traced once for all."""
    found = []

    def backend(gm, example_inputs):
        found.extend(call.mask for call in find_sdpa_calls(gm))
        return gm.forward

    if mark_keys:
        for tensor, dim in ((k, 2), (am, 1)):
            torch._dynamo.mark_dynamic(tensor, dim)
    with torch.no_grad():
        torch.compile(MaskPrograms(programs), backend=backend, dynamic=dynamic)(q, k, k, am)
    assert len(found) == len(programs), found
    return found


def paddings(batch: int, nk: int) -> list:
    """All valid, left, right and hole-y padding (0/1)."""
    ones = torch.ones(batch, nk, dtype=torch.long)
    left, right, holes = ones.clone(), ones.clone(), ones.clone()
    left[0, :3], left[1, :nk // 3] = 0, 0
    right[0, nk - 2:], right[1, nk - nk // 4:] = 0, 0
    holes[0, 5:9], holes[1, ::4] = 0, 0
    holes[1, 0] = 0
    return [ones, left, right, holes]


def expected_mask(local: Local, nq: int, nk: int, am: torch.Tensor) -> torch.Tensor:
    """``Local`` in the keys' positions, chunks from each row's first valid key, AND the padding."""
    keys = torch.arange(nk)
    first = torch.where(am != 0, keys, nk).amin(-1)[:, None]
    seen = local.visible(torch.arange(nk - nq, nk)[None] - first, keys[None] - first)
    return (seen & (am != 0)[:, None, :])[:, None]


def assert_right_or_not_proven(p: Program, proof, lengths) -> Optional[Local]:
    """A proof's local structure holds at ``lengths`` (queries, keys) for every padding; returns it."""
    if isinstance(proof, NotProven):
        return None
    assert isinstance(proof, MaskMatch), proof
    local = proof.local
    for nq, nk in lengths:
        for am in paddings(2, nk) if p.padded else [torch.ones(2, nk, dtype=torch.long)]:
            got = program_mask(p, nq, nk, am).expand(2, -1, nq, nk)
            want = expected_mask(local, nq, nk, am)
            rows = want.any(-1, keepdim=True)  # rows that see no key are undefined everywhere
            bad = ((got != want) & rows).nonzero()
            assert not len(bad), f"{p}: proven {local} ({proof.reason}) but at {nq}x{nk} {am.tolist()[1][:12]}... " \
                                 f"differs at {bad[0].tolist()}"
    return local


def random_programs(rng: random.Random, size: int, padded: Optional[bool] = None) -> list:
    return [Program(rng.choice(FAMILIES), rng.randint(2, 12), rng.random() < 0.6 if padded is None else padded,
                    rng.choice(["bool", "float"])) for _ in range(size)]


@pytest.mark.parametrize("seed", range(3))
def test_random_local_masks_proven_with_the_right_widths_or_not_at_all(seed):
    """Dynamic lengths: every proof holds far past where it evaluated; the integer transformers constructions are
    proven with their exact widths."""
    rng = random.Random(seed)
    programs = random_programs(rng, 14) + [Program(f, rng.randint(2, 12), rng.random() < 0.5, "bool")
                                           for f in TRAPS[seed::3]]
    n = rng.randint(20, 60)
    q = torch.randn(2, 2, n, 8)
    am = torch.ones(2, n, dtype=torch.long)
    found = proofs(programs, q, q, am, dynamic=True)
    for p, proof in zip(programs, found):
        far = max(p.width * 7, 60) + 3
        local = assert_right_or_not_proven(p, proof, [(m, m) for m in (2, 7, n, far, far + 1)] + [(5, far)])
        if p.family in EXACT:
            assert local == EXACT[p.family](p.width), (p, proof)
            assert local.describe() in proof.reason, proof.reason
        elif p.family in ("per_head", "window_or_sink", "window_minus_key", "widens", "chunk_float",
                          "window_of_length") or (p.family == "chunk_raw" and p.padded):
            assert local is None, (p, proof)


def test_random_local_masks_at_a_static_length():
    """Static shapes run at the traced length only: proven there, with the widths the mask has there (a window
    wider than the prompt is plain causal)."""
    rng = random.Random(10)
    programs = random_programs(rng, 24)
    n = 23
    q = torch.randn(2, 2, n, 8)
    found = proofs(programs, q, q, torch.ones(2, n, dtype=torch.long), dynamic=False)
    for p, proof in zip(programs, found):
        assert_right_or_not_proven(p, proof, [(n, n)])
        if p.family in EXACT:
            assert isinstance(proof, MaskMatch), (p, proof)


def test_local_masks_over_a_growing_cache():
    """Chunked prefill: a static chunk of queries over a symbolic key length (every cached prefix)."""
    rng = random.Random(20)
    programs = [Program(f, rng.randint(3, 9), rng.random() < 0.5, "bool") for f in EXACT] + random_programs(rng, 6)
    chunk, past = 6, 17
    q = torch.randn(2, 2, chunk, 8)
    k = torch.randn(2, 2, chunk + past, 8)
    am = torch.ones(2, chunk + past, dtype=torch.long)
    found = proofs(programs, q, k, am, dynamic=None, mark_keys=True)
    for p, proof in zip(programs, found):
        local = assert_right_or_not_proven(p, proof, [(chunk, chunk + m) for m in (0, 1, 5, 40, 97)])
        if p.family in EXACT:
            assert local == EXACT[p.family](p.width), (p, proof)


def test_transformers_sliding_window_and_chunked_masks_are_proven():
    """transformers' own mask functions (sdpa_mask with sliding_window_causal_mask_function and
    chunked_causal_mask_function, left padding counted as it counts it), traced as a model traces them. Versions
    that count chunks from key 0 (no left_padding) give another mask under left padding: not proven."""
    import inspect

    masking = pytest.importorskip("transformers.masking_utils")
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    by_position = "cache_position" in inspect.signature(sdpa_mask).parameters  # before 5.0
    from_first_valid = len(inspect.signature(masking.chunked_overlay).parameters) >= 2

    class Model(nn.Module):
        def forward(self, q, am):
            n = q.shape[-2]
            valid = am.bool()  # as _preprocess_mask_arguments passes it
            sizes = dict(cache_position=torch.arange(n)) if by_position else dict(q_length=n, q_offset=0)
            window = sdpa_mask(batch_size=q.shape[0], kv_length=n, kv_offset=0,
                               mask_function=sliding_window_causal_mask_function(7), attention_mask=valid,
                               allow_is_causal_skip=False, local_size=7, **sizes)
            left = (am.cumsum(dim=-1) == torch.zeros_like(am)).sum(dim=-1)
            chunked = chunked_causal_mask_function(5, left) if from_first_valid else chunked_causal_mask_function(5)
            chunks = sdpa_mask(batch_size=q.shape[0], kv_length=n, kv_offset=0, mask_function=chunked,
                               attention_mask=valid, allow_is_causal_skip=False, local_size=5, **sizes)
            return [F.scaled_dot_product_attention(q, q, q, attn_mask=m) for m in (window, chunks)]

    found = []

    def backend(gm, example_inputs):
        found.extend(call.mask for call in find_sdpa_calls(gm))
        return gm.forward

    q, am = torch.randn(2, 2, 30, 8), torch.ones(2, 30, dtype=torch.long)
    am[0, :4] = 0
    with torch.no_grad():
        torch.compile(Model(), backend=backend, dynamic=True)(q, am)
    window, chunks = found
    assert isinstance(window, MaskMatch) and window.local == Local(window=7), window
    assert "causal mask AND sliding window 7 AND key padding proven from the graph" in window.reason, window.reason
    if from_first_valid:
        assert isinstance(chunks, MaskMatch) and chunks.local == Local(chunk=5), chunks
        assert chunks.binary_padding  # cumsum reads the values: 0/1 only
    else:
        assert isinstance(chunks, NotProven) and "with a padding mask" in chunks.reason, chunks


def test_window_too_wide_to_evaluate_past_is_not_proven():
    """The proof evaluates past twice every width; one beyond its limit stays dense, with the reason."""
    class Wide(nn.Module):
        def forward(self, q):
            n = q.shape[-2]
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            return F.scaled_dot_product_attention(q, q, q, attn_mask=(j <= i) & (j > i - 5000))

    found = []

    def backend(gm, example_inputs):
        found.extend(call.mask for call in find_sdpa_calls(gm))
        return gm.forward

    with torch.no_grad():
        torch.compile(Wide(), backend=backend, dynamic=True)(torch.randn(1, 1, 20, 8))
    assert isinstance(found[0], NotProven) and "limit" in found[0].reason, found[0]


# -- the check at run time -----------------------------------------------------------------------------------------
def as_given(keep: torch.Tensor, style: str) -> torch.Tensor:
    return keep if style == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("style", ["bool", "float"])
def test_runtime_check_reads_windows_and_chunks(style):
    """Graph-input masks (a static cache's): causal AND a window / chunks AND padding -> the verdict names them;
    traps -> not causal, or causal with the widths that hold."""
    rng = random.Random(30 if style == "bool" else 31)
    local = exact = 0
    for _ in range(60):
        p = Program(rng.choice(FAMILIES), rng.randint(2, 6), rng.random() < 0.7, style)
        nk = rng.randint(3, 80)
        nq = rng.choice([nk, max(1, nk - rng.randint(0, nk - 1))])
        contiguous = rng.random() < 0.6
        am = rng.choice(paddings(2, nk)[:3] if contiguous else paddings(2, nk))
        keep = program_mask(p, nq, nk, am).expand(2, 2 if p.family == "per_head" else 1, nq, nk)
        verdict = check_runtime_mask(as_given(keep, style), 2, 2, nq, nk, local=True)
        if not verdict.causal:
            continue
        kept = verdict.num_keys
        want = expected_mask(verdict.local, nq, kept, verdict.key_valid.long())
        assert kept == nk or not keep[..., kept:].any(), (p, verdict)
        got = keep[..., :kept]
        rows = want.any(-1, keepdim=True)
        assert not ((got != want) & rows).any(), (p, nq, nk, am, verdict)
        local += not verdict.local.is_causal
        if p.family in EXACT and nq >= 6 * p.width + 6 and contiguous:  # every width shows among the rows
            assert verdict.local == EXACT[p.family](p.width), (p, verdict)
            assert verdict.local.describe() in verdict.reason, verdict.reason
            exact += 1
    assert local >= 15 and exact >= 3, (local, exact)  # not just refusing


def test_runtime_check_window_with_static_cache_slots():
    """A static cache: trailing empty slots masked for every row, queries at the last filled keys, a window."""
    nq, filled, slots = 4, 20, 32
    am = torch.zeros(2, slots, dtype=torch.long)
    am[:, :filled] = 1
    am[0, :2] = 0
    keep = program_mask(Program("window_gt", 6, True, "bool"), nq, filled, am[:, :filled])
    full = torch.zeros(2, 1, nq, slots, dtype=torch.bool)
    full[..., :filled] = keep
    verdict = check_runtime_mask(full, 2, 4, nq, slots, local=True)
    assert verdict.causal and verdict.num_keys == filled and verdict.local == Local(window=6), verdict
    assert "sliding window 6" in verdict.reason


def test_runtime_check_one_query_row_of_a_chunk():
    """One query row (decode) in a chunk: the keys before its chunk are masked for it, as padding would be."""
    am = torch.ones(1, 40, dtype=torch.long)
    keep = program_mask(Program("chunk_hf", 8, False, "bool"), 1, 40, am)
    verdict = check_runtime_mask(keep, 1, 1, 1, 40, local=True)
    assert verdict.causal and verdict.num_keys == 40, verdict
    assert expected_mask(verdict.local, 1, 40, verdict.key_valid.long()).equal(keep), verdict


def test_runtime_check_without_local_names_the_window():
    """A caller that runs causal attention only gets "not causal", with the structure it could have run."""
    keep = program_mask(Program("window_gt", 6, False, "bool"), 30, 30, torch.ones(1, 30, dtype=torch.long))
    verdict = check_runtime_mask(keep, 1, 1, 30, 30)
    assert not verdict.causal and "not causal: causal AND sliding window 6 AND key padding" in verdict.reason, verdict


@pytest.mark.parametrize("family", ["window_gt", "chunk_hf", "window_chunk_hf"])
def test_proven_local_masks_run_equal_to_eager_with_every_padding(family):
    """Through the rewrite and the op: left, right and hole-y padding (a row with holes has its window in raw
    positions), at two lengths of one dynamic graph."""
    from sparse_compile import SparseConfig
    from sparse_compile.rewrite import rewrite_graph

    p = Program(family, 5, True, "bool")
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, SparseConfig(min_seq_len=2, pbs={"block_size": 16,
                                                                           "segment_size": 32}).keep_all()))
        return gm.forward

    model = MaskPrograms([p])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for n in (40, 61):
        q, k, v = torch.randn(3, 2, 2, n, 16).unbind(0)
        for am in paddings(2, n):
            with torch.no_grad():
                (out,), (ref,) = compiled(q, k, v, am), model(q, k, v, am)
            rows = torch.isfinite(ref).all(-1).all(1) & (am != 0)  # padded and keyless query rows: undefined
            torch.testing.assert_close(out.transpose(1, 2)[rows], ref.transpose(1, 2)[rows], rtol=1e-4, atol=1e-5)
    assert records and all(r.rewritten and EXACT[family](5).describe() in r.reason for r in records), records


# -- over a sliding cache: positions from a count of tokens seen, keys sized by the cache's window ------------------
SLIDING_EXACT = {"window_lt": lambda w: Local(window=w), "window_gt": lambda w: Local(window=w),
                 "window_le": lambda w: Local(window=w + 1), "causal": lambda w: Local()}
# a window or chunks in absolute positions, gone past a count of tokens seen, on its parity, as wide as the cache
SLIDING_TRAPS = ("chunk_abs", "sink_abs", "window_until", "window_parity", "window_of_cache", "window_from_seen")


@dataclass(frozen=True)
class SlidingProgram:
    family: str
    width: int
    limit: int  # window_until's count of tokens seen


def sliding_mask(p: SlidingProgram, nq: int, seen: int, window: int) -> torch.Tensor:
    """transformers' DynamicSlidingWindowLayer: once full (seen >= window) it holds window - 1 keys before the chunk
    and the mask's keys start at seen - window + 1; queries at seen + i."""
    if seen >= window:
        offset, nk = max(seen - window + 1, 0), window - 1 + nq
    else:
        offset, nk = 0, seen + nq
    i = torch.arange(nq)[:, None] + seen
    j = torch.arange(nk)[None, :] + offset
    w, causal = p.width, j <= i
    count = i - i + seen  # the count as a tensor: compared by value inside the mask, never guarded on
    keep = {"window_lt": lambda: causal & (i - j < w), "window_gt": lambda: causal & (j > i - w),
            "window_le": lambda: causal & (i - j <= w), "causal": lambda: causal,
            "chunk_abs": lambda: causal & (i // w == j // w), "sink_abs": lambda: causal & ((i - j < w) | (j < 2)),
            "window_until": lambda: causal & ((i - j < w) | (count > p.limit)),
            "window_parity": lambda: causal & ((i - j < w) | (count % 2 == 1)),
            "window_of_cache": lambda: causal & (i - j < window),
            "window_from_seen": lambda: causal & (i - j < w + (count > p.limit).long())}[p.family]()
    return keep[None, None]


class SlidingPrograms(nn.Module):
    def __init__(self, programs):
        super().__init__()
        self.programs = programs

    def forward(self, q, cached, seen, window):
        k = torch.cat([cached, q], dim=-2)  # the cache's keys, then the chunk's
        return [F.scaled_dot_product_attention(q, k, k, attn_mask=sliding_mask(p, q.shape[-2], seen, window))
                for p in self.programs]


def _sliding_programs(rng: random.Random) -> list:
    programs = [SlidingProgram(f, rng.randint(2, 12), rng.randint(10, 90)) for f in SLIDING_EXACT for _ in range(2)]
    return programs + [SlidingProgram(f, rng.randint(2, 12), rng.randint(10, 90)) for f in SLIDING_TRAPS
                       for _ in range(2)]


@pytest.mark.parametrize("seed", range(2))
def test_masks_over_a_sliding_cache_proven_with_the_right_widths_or_not_at_all(seed):
    """The count of tokens seen is a size Dynamo traced (no tensor has it) and the mask's keys ``window - 1 +
    q_len`` a symbol that only the shape guard ``window - 1 == cached`` ties to k. Every proof must hold at counts,
    chunks and cache sizes it never evaluated; the windows must be proven with their widths, and the compiled
    programs give eager's result at every call."""
    rng = random.Random(seed)
    programs = _sliding_programs(rng)
    found = []

    def backend(gm, example_inputs):
        found.extend(call.mask for call in find_sdpa_calls(gm))
        return gm.forward

    model = SlidingPrograms(programs)
    nq, window, seen = rng.randint(5, 30), rng.randint(3, 20), rng.randint(25, 60)
    q = torch.randn(1, 2, nq, 16)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(q, torch.randn(1, 2, window - 1, 16), seen, window)
    assert len(found) == len(programs), found
    grid = [(m, w, s) for m in (2, 3, 17, 64) for w in (3, 4, 9, 33) for s in (w, w + 1, w + 5, 2 * w + 3, 97, 400)]
    for p, proof in zip(programs, found):
        if isinstance(proof, NotProven):
            assert p.family not in SLIDING_EXACT, (p, proof.reason)
            continue
        for m, w, s in grid:
            got = sliding_mask(p, m, s, w).expand(1, 1, m, w - 1 + m)
            want = expected_mask(proof.local, m, w - 1 + m, torch.ones(1, w - 1 + m, dtype=torch.long))
            bad = ((got != want) & want.any(-1, keepdim=True)).nonzero()
            assert not len(bad), f"{p}: proven {proof.local} but at q {m}, window {w}, seen {s} differs at {bad[0]}"
        if p.family in SLIDING_EXACT:
            assert proof.local == SLIDING_EXACT[p.family](p.width), (p, proof)
    assert sum(isinstance(f, MaskMatch) for f in found) >= len(SLIDING_EXACT) * 2


def test_masks_over_a_sliding_cache_compiled_equal_eager():
    """The rewritten graph (keep-all) at counts, chunks and windows other than the traced ones: eager's result, a
    trap dense; a count below the window takes the other branch (another graph) and stays exact too."""
    from sparse_compile.rewrite import rewrite_graph
    from helpers import SMALL
    from sparse_compile import SparseConfig

    programs = _sliding_programs(random.Random(5))
    records = []

    def backend(gm, example_inputs):
        records.extend(rewrite_graph(gm, SparseConfig(method="pbs", **SMALL).keep_all()))
        return gm.forward

    model = SlidingPrograms(programs)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for nq, window, seen in ((20, 8, 20), (7, 8, 41), (33, 5, 300), (3, 12, 12), (9, 8, 4)):
            q = torch.randn(1, 2, nq, 16)
            cached = torch.randn(1, 2, window - 1 if seen >= window else seen, 16)
            for dim in (0, 1, 3):
                torch._dynamo.mark_static(q, dim)
                torch._dynamo.mark_static(cached, dim)
            for p, out, ref in zip(programs, compiled(q, cached, seen, window), model(q, cached, seen, window)):
                rows = torch.isfinite(ref).all(-1)
                torch.testing.assert_close(out[rows], ref[rows], rtol=1e-4, atol=1e-5, msg=lambda m: f"{p}: {m}")
    proven = {p.family for p, r in zip(programs, records) if r.rewritten}
    assert set(SLIDING_EXACT) <= proven, [(p, r.reason) for p, r in zip(programs, records) if not r.rewritten]
