"""A small gpt-fast-style decoder (RoPE, GQA, SDPA): the tests' model, and the benchmarks' small LM.

Attention is a plain ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`` call: exactly the
pattern ``sparse_prefill`` rewrites. Nothing here knows about sparse_compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    intermediate_size: int = 512
    rope_base: float = 10000.0
    max_seq_len: int = 1 << 17
    # > 0: a depthwise causal convolution over the last ``conv_width`` positions mixes each attention input with
    # its predecessors (0: none), so a byte-level key such as ``_vkey_402913 = "`` can reach attention as one
    # vector; attention's shapes are unchanged. Tried for the retrieval model: not better at its training budget
    # (docs/results.md, the retrieval model).
    conv_width: int = 0
    # > 0: long-context attention temperature (Llama 4's): queries at position t are scaled by
    # 1 + attn_temperature_scale * ln(floor((t + 1) / attn_temperature_floor) + 1), so a lookup's logits grow with the
    # context it searches; attention's call and shapes are unchanged (0: none). Tried for the retrieval model (run 6):
    # not better at its training budget.
    attn_temperature_floor: int = 0
    attn_temperature_scale: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(seq_len: int, head_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                query_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.wqkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, N, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if query_scale is not None:
            q = (q * query_scale[:, None]).type_as(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, N, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class CausalConv(nn.Module):
    """Depthwise causal convolution, added to its input: y[t] = x[t] + sum_j w[j] * x[t - j]."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(dim, dim, width, groups=dim, bias=False)
        nn.init.zeros_(self.conv.weight)  # starts as the identity: training decides how much to mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x.transpose(1, 2), (self.width - 1, 0))
        return x + self.conv(h).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.mix = CausalConv(args.dim, args.conv_width) if args.conv_width > 0 else nn.Identity()
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, query_scale=None):
        x = x + self.attention(self.mix(self.attention_norm(x)), cos, sin, query_scale)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs = ModelArgs()):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.args.head_dim, self.args.rope_base, tokens.device)
        query_scale = None
        if self.args.attn_temperature_floor > 0:
            t = torch.arange(tokens.shape[1], device=tokens.device)
            query_scale = 1 + self.args.attn_temperature_scale * torch.log(
                torch.floor((t + 1) / self.args.attn_temperature_floor) + 1)
        for layer in self.layers:
            x = layer(x, cos, sin, query_scale)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        return self.output(x)
