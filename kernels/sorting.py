"""Stable descending argsort inside segments: one sort along the last dim per program (bitonic sort of packed
64-bit keys in registers); ``host.segmented_argsort_desc`` is the specification and the fallback for segments
longer than 4096."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting, jit_any_length, orderable, pow2
from .reference import segmented_argsort_desc as _segmented_argsort_torch
from .validate import cdiv

__all__ = ["segmented_argsort_desc"]

#: the longest segment sorted in registers
MAX_SEGMENT = 4096


@jit_any_length
def _segmented_argsort_kernel(x_ptr, out_ptr, L, NUM_SEGMENTS, NUM_SEGMENTS_ALL, SEGMENT: tl.constexpr,
                              SEGMENT_PAD: tl.constexpr, SEGMENTS_PER_PROGRAM: tl.constexpr):
    s = tl.program_id(0) * SEGMENTS_PER_PROGRAM + tl.arange(0, SEGMENTS_PER_PROGRAM)
    row = tl.program_id(1)
    loc = tl.arange(0, SEGMENT_PAD)
    pos = s[:, None] * SEGMENT + loc[None, :]
    base = row.to(tl.int64) * L
    live = (loc < SEGMENT)[None, :] & (pos < L) & (s < NUM_SEGMENTS_ALL)[:, None]
    x = tl.load(x_ptr + base + pos, mask=live, other=float("-inf"))
    key = (orderable(x).to(tl.int64) << 32) | (2147483647 - loc).to(tl.int64)[None, :]
    key = tl.where(live, key, -9223372036854775807)  # padding sorts last
    srt = tl.sort(key, descending=True)
    idx = s[:, None] * SEGMENT + (2147483647 - (srt & 0xFFFFFFFF)).to(tl.int32)
    # past the listed segments: identity
    idx = tl.where((s < NUM_SEGMENTS)[:, None], idx, pos)
    tl.store(out_ptr + base + pos, idx, mask=live)


def segmented_argsort_desc(scores: torch.Tensor, segment: int, num_segments: int) -> torch.Tensor:
    """``host.segmented_argsort_desc`` as int32: stable (ties keep the lower index), a last listed segment shorter
    than ``segment`` sorts what it has, entries past ``num_segments * segment`` stay in place."""
    length = scores.shape[-1]
    if segment > MAX_SEGMENT or length == 0:
        return _segmented_argsort_torch(scores, segment, num_segments).to(torch.int32)
    x = scores.float().reshape(-1, length).contiguous()
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    nseg_all = cdiv(length, segment)
    s_pad = max(16, triton.next_power_of_2(segment))
    per_program = max(1, min(pow2(nseg_all), ((1 << 14) if interpreting() else 2048) // s_pad))
    _segmented_argsort_kernel[(triton.cdiv(nseg_all, per_program), x.shape[0])](
        x, out, length, num_segments, nseg_all, SEGMENT=segment, SEGMENT_PAD=s_pad,
        SEGMENTS_PER_PROGRAM=per_program, num_warps=max(1, min(8, per_program * s_pad // 256)))
    return out.view(scores.shape)
