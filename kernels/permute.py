"""The permuted K/V copy: K and V rows in the order of a key index, contiguous (PBS's and S2O's "copy" key mode).

Shared by the Triton attention kernel (``attention.py``) and the Hopper kernel (``hopper.py``), which read the copy
like ordinary keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import jit_any_length

__all__ = ["permute_keys"]


@jit_any_length
def _permute_rows_kernel(
    K, V, KP, VP, KeyIndex,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kib, stride_kih, stride_kip,
    H, LENGTH, N_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """KP[b, h, p] = K[b, h, key_index[b, h, p]] (padding entries copy row 0; they are masked anyway).

    Row blocks run on grid axis 0 (up to 2^31 - 1 programs): S2O's key list at 128K has millions of entries,
    past the 65,535 limit of axis 1, which holds the (batch, head) pairs instead.
    """
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = p < LENGTH
    idx = tl.load(KeyIndex + b * stride_kib + h * stride_kih + p * stride_kip, mask=ok, other=0)
    idx = tl.where((idx >= 0) & (idx < N_K), idx, 0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    dst = pid_bh.to(tl.int64) * LENGTH * HEAD_DIM + p[:, None] * HEAD_DIM + offs_d[None, :]
    kv = tl.load(K + b * stride_kb + h * stride_kh + idx[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                 mask=mask)
    tl.store(KP + dst, kv, mask=mask)
    vv = tl.load(V + b * stride_vb + h * stride_vh + idx[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                 mask=mask)
    tl.store(VP + dst, vv, mask=mask)


def permute_keys(k: torch.Tensor, v: torch.Tensor, key_index: torch.Tensor, head_dim_pad: int):
    """Contiguous K/V in the order of ``key_index`` (Hkv heads): one pass over K and V, no host sync."""
    B, H, Nk, D = k.shape
    L = key_index.shape[-1]
    kp = torch.empty(B, H, L, D, dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    if L == 0:
        return kp, vp
    block = 64
    _permute_rows_kernel[(triton.cdiv(L, block), B * H)](
        k, v, kp, vp, key_index, *k.stride(), *v.stride(), *key_index.stride(), H, L, Nk,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, BLOCK=block, num_warps=4)
    return kp, vp
