"""FP8 (e4m3) operands for score-only matmuls: Hopper and Ada multiply FP8 on the tensor cores at twice the bf16
rate, and a selector that ranks tiles by their best score needs the scores' order, not their last bits.

The format is e4m3 (3 mantissa bits, largest finite 448). A tensor is quantized per (batch, head) with one scale,
its largest finite magnitude over 448, so every finite element keeps its sign and 3 mantissa bits (round to
nearest even); elements below 2^-9 of the scale flush towards zero, which moves a score by less than its largest
term's rounding. NaN and +-inf elements become NaN, so a score that would have been non-finite stays non-finite.
Query rows are quantized inside the scoring kernels with one scale per row (``quantize_rows``).

GPU only: the Triton interpreter has no FP8 (``fp8_tensor_cores`` says where the kernels run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting, is_finite, jit_any_length
from .validate import cdiv

__all__ = ["FP8_MAX", "fp8_tensor_cores", "quantize_heads", "quantize_rows"]

#: the largest finite e4m3 value
FP8_MAX = 448.0


def fp8_tensor_cores(device: torch.device) -> bool:
    """True where the scoring kernels can multiply FP8: a CUDA device of compute capability 8.9 or later (Ada,
    Hopper and newer), outside the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _scale_of(amax, MAX: tl.constexpr):
    """The scale that maps the largest finite magnitude ``amax`` to MAX (1 where there is none)."""
    return tl.where(amax > 0, amax / MAX, 1.0)


@triton.jit
def _to_e4m3(x, scale, MAX: tl.constexpr):
    """float32 ``x`` / ``scale``, saturated to +-MAX, in e4m3; NaN and inf elements become NaN."""
    y = tl.minimum(tl.maximum(x / scale, -MAX), MAX)
    return tl.where(is_finite(x), y, float("nan")).to(tl.float8e4nv)


@triton.jit
def _finite_amax(x, axis):
    return tl.max(tl.where(is_finite(x), tl.abs(x), 0.0), axis)


@triton.jit
def quantize_rows(x):
    """(M, D) float -> ((M, D) e4m3, (M,) float32 scale): each row over its largest finite magnitude / 448 (1 for a
    zero row); NaN and inf elements become NaN."""
    MAX: tl.constexpr = 448.0  # FP8_MAX (a jit function reads no module globals)
    xf = x.to(tl.float32)
    scale = _scale_of(_finite_amax(xf, 1), MAX)
    return _to_e4m3(xf, scale[:, None], MAX), scale


@triton.jit
def _head_rows(x_ptr, stride_b, stride_h, stride_n, stride_d, H, N, D: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK: tl.constexpr):
    """This program's BLOCK rows of head ``bh`` (float32, 0 outside), their offsets in a contiguous (B, H, N, D)
    tensor and their mask; and ``bh``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    inside = (rows < N)[:, None] & (d < D)[None, :]
    base = x_ptr + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    x = tl.load(base + rows.to(tl.int64)[:, None] * stride_n + d[None, :] * stride_d, mask=inside,
                other=0.0).to(tl.float32)
    return x, bh.to(tl.int64) * N * D + rows.to(tl.int64)[:, None] * D + d[None, :], inside, bh


@jit_any_length
def _amax_kernel(x_ptr, stride_b, stride_h, stride_n, stride_d, amax_ptr, H, N,
                 D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    x, _, _, bh = _head_rows(x_ptr, stride_b, stride_h, stride_n, stride_d, H, N, D, D_PAD, BLOCK)
    tl.atomic_max(amax_ptr + bh, tl.max(_finite_amax(x, 1), 0))


@jit_any_length
def _quantize_kernel(x_ptr, stride_b, stride_h, stride_n, stride_d, amax_ptr, out_ptr, scale_ptr, H, N,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, MAX: tl.constexpr):
    x, offsets, inside, bh = _head_rows(x_ptr, stride_b, stride_h, stride_n, stride_d, H, N, D, D_PAD, BLOCK)
    scale = _scale_of(tl.load(amax_ptr + bh), MAX)
    tl.store(out_ptr + offsets, _to_e4m3(x, scale, MAX), mask=inside)
    if tl.program_id(0) == 0:  # the scale the values were divided by, once per head
        tl.store(scale_ptr + bh, scale)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) float on a CUDA device with FP8 -> (contiguous (B, H, N, D) ``float8_e4m3fn``, (B, H) float32
    scales): x ~= q8 * scale per (batch, head), the scale its largest finite magnitude / 448 (1 if none)."""
    if not fp8_tensor_cores(x.device):
        raise ValueError(f"quantize_heads: FP8 needs a CUDA device of compute capability 8.9+, got {x.device}")
    if x.dim() != 4:
        raise ValueError(f"quantize_heads: x must be (B, H, N, D), got shape {tuple(x.shape)}")
    B, H, N, D = x.shape
    amax = torch.zeros(B * H, dtype=torch.float32, device=x.device)
    out = torch.empty(B, H, N, D, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(B, H, dtype=torch.float32, device=x.device)
    block = 64
    d_pad = triton.next_power_of_2(D)
    grid = (cdiv(N, block), B * H)
    _amax_kernel[grid](x, *x.stride(), amax, H, N, D=D, D_PAD=d_pad, BLOCK=block)
    _quantize_kernel[grid](x, *x.stride(), amax, out, scale, H, N, D=D, D_PAD=d_pad, BLOCK=block, MAX=FP8_MAX)
    return out, scale
