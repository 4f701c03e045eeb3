"""How finely must FP8 (e4m3) attention scale its operands to stay within 3% of float32 on a real model?

    python benchmarks/research/fp8_attention_error.py                   # CPU, ~10 min: SmolLM2 at 4K, random inputs
    python benchmarks/research/fp8_attention_error.py --length 2048 --layers 10 --out OUT   # quicker

An emulation, not a kernel: each variant rounds Q, K, P and V to e4m3 as a kernel would (scaled into +-448, cast,
scaled back) and sums in float32; the output of causal attention is compared with float32 attention on the same
inputs (relative L2 over the rows of one head; the largest and the mean over the heads measured). Inputs: the
(q, k, v) of ``--layers`` of SmolLM2-135M (the real-weights model of ``bench_real_weights.py``, float32 on the
CPU) on one prose window of ``--length`` tokens, every ``--head-every``-th query head; and Gaussian q, k, v at head
dims 64 and 128. ``bf16`` (operands rounded to bfloat16) is the yardstick.

Variants (a name lists what differs from the first):

* ``block``: a scale per 128 query rows and per 128-key tile, K smoothed (its per-channel mean over the sequence
  subtracted: exact for the softmax, q.mean(k) is the same for every key of a row), P scaled by 448 into e4m3,
  V a scale per channel;
* ``token``: a scale per query row and per key (they multiply the rows and columns of the score tile);
* ``hadamard``: q and k rotated by the same random-sign Hadamard matrix first (exact for q.k);
* ``token+qsmooth``: per token, and each 128-row block's mean query subtracted before rounding, its product with
  the keys added back unrounded (a rank-one term per block and tile);
* ``... p-float``: P and V left in float32 (only QK^T in FP8);
* ``qk-float``: QK^T in float32, only P and V in FP8 (as ``block``);
* ``block+qsmooth-head``: as ``block+qsmooth`` but the mean query of the whole sequence (per head) subtracted, so the
  term added back (its product with the unrounded keys, float32) is one value per key, the same for every query block:
  what a kernel can add to each score column cheaply;
* ``head-scales``: the design of the FP8 kernel measured in docs/kernels.md: Q a scale per 128 rows, K smoothed and
  ONE scale per head, V per channel, P scaled by 256 (not 448) before rounding;
* ``head-scales+qsmooth-head``: ``head-scales`` with the per-head mean query subtracted (as ``block+qsmooth-head``).

With ``--nll-windows W`` it also scores the model's next-token loss on W prose windows (the last quarter of each)
with every layer's attention replaced by each ``--nll-variants`` emulation (and ``bf16``), against float32
attention: the loss an FP8 kernel would add, before any sparsity.

Rows go to the store ``benchmarks/results/fp8_attention_error.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import write_results  # noqa: E402

E4M3_MAX = 448.0
BLOCK = 128

VARIANTS = {
    "block": {},
    "block, K not smoothed": {"smooth_k": False},
    "token": {"per_token": True},
    "hadamard": {"hadamard": True},
    "hadamard+token": {"hadamard": True, "per_token": True},
    "block+qsmooth": {"smooth_q": True},
    "token+qsmooth": {"per_token": True, "smooth_q": True},
    "token+qsmooth, p-float": {"per_token": True, "smooth_q": True, "p_float": True},
    "qk-float": {"qk_float": True},
    "block+qsmooth-head": {"smooth_q": "head"},
    "head-scales": {"k_per_head": True, "p_scale": 256.0},
    "head-scales+qsmooth-head": {"k_per_head": True, "p_scale": 256.0, "smooth_q": "head"},
}


def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 at ``scale`` (x / scale within +-448), back in float32 units of x."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def scale_of(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(N, 1) scales, one per ``rows`` consecutive rows of x (N, D): their largest magnitude maps to 448."""
    n, d = x.shape
    per = x.view(n // rows, rows * d).abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    return per.repeat_interleave(rows)[:, None]


def random_hadamard(d: int, seed: int = 1) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return h * signs[None, :] / math.sqrt(d)


def causal_softmax_out(s: torch.Tensor, v: torch.Tensor, p_round: bool, p_scale: float = E4M3_MAX) -> torch.Tensor:
    n = s.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    total = p.sum(-1, keepdim=True)  # from P before rounding, as a kernel sums its row in float32
    if p_round:
        p = rounded(p, torch.full((), 1.0 / p_scale))
    return (p @ v) / total


def fp8_attention(q, k, v, scale, *, per_token=False, smooth_k=True, smooth_q=False, hadamard=False, p_float=False,
                  qk_float=False, k_per_head=False, p_scale=E4M3_MAX):
    """Causal attention of one head, q/k/v (N, D) float32 with N a multiple of 128, rounded as the variant says.

    ``smooth_q``: False, True (each 128-row block's mean query subtracted) or ``"head"`` (the mean of all N query
    rows); the mean's product with the unrounded (smoothed) keys is added back in float32. ``k_per_head``: one K scale
    for all N keys (after smoothing). ``p_scale``: P (in [0, 1]) is multiplied by it before rounding to e4m3."""
    n, d = q.shape
    if smooth_k:
        k = k - k.mean(0, keepdim=True)
    if hadamard:
        r = random_hadamard(d)
        q, k = q @ r, k @ r
    bias = 0.0
    if smooth_q:  # "head": one mean, so one (1, N) row of per-key terms for every query row
        mean = q.mean(0, keepdim=True) if smooth_q == "head" else \
            q.view(n // BLOCK, BLOCK, d).mean(1, keepdim=True).expand(-1, BLOCK, -1).reshape(n, d)
        bias, q = (mean @ k.T) * scale, q - mean
    rows = 1 if per_token else BLOCK
    if not qk_float:  # scales from the operands as rounded: Q after smoothing, K after smoothing
        q, k = rounded(q, scale_of(q, rows)), rounded(k, scale_of(k, n if k_per_head else rows))
    s = (q @ k.T) * scale + bias
    if not p_float:
        v = rounded(v, v.abs().amax(0, keepdim=True).clamp(min=1e-12) / E4M3_MAX)
    return causal_softmax_out(s, v, p_round=not p_float, p_scale=p_scale)


def float_attention(q, k, v, scale):
    return causal_softmax_out((q @ k.T) * scale, v, p_round=False)


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def captured_heads(length: int, layers: list, head_every: int):
    """{layer: [(q, k, v, scale) per measured query head]} of SmolLM2 on one prose window of ``length`` tokens."""
    from transformers import AttentionInterface

    from bench_real_weights import prose_model

    model, windows = prose_model(length, 1)
    captured, seen = {}, [0]

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = seen[0]
        seen[0] += 1
        if layer in layers:
            group = query.shape[1] // key.shape[1]
            captured[layer] = [(query[0, h].clone(), key[0, h // group].clone(), value[0, h // group].clone(),
                                scaling) for h in range(0, query.shape[1], head_every)]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("fp8_error_capture", capture)
    model.set_attn_implementation("fp8_error_capture")
    with torch.no_grad():
        model(windows[0][None], logits_to_keep=1, use_cache=False)
    return captured


def loss_rows(length: int, windows: int, variants: list) -> list:
    """Δ NLL against float32 attention of each variant's attention in every layer."""
    from transformers import AttentionInterface

    from bench_real_weights import last_token_losses, prose_model

    model, texts = prose_model(length, windows)
    state = {"variant": None}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        name = state["variant"]
        if name is None or name == "bf16":
            dtype = torch.bfloat16 if name else query.dtype
            out = F.scaled_dot_product_attention(query.to(dtype), key.to(dtype), value.to(dtype), is_causal=True,
                                                 scale=scaling, enable_gqa=True).float()
        else:
            n, group, pad = query.shape[2], query.shape[1] // key.shape[1], -query.shape[2] % BLOCK
            out = torch.stack([torch.stack([fp8_attention(*(F.pad(x, (0, 0, 0, pad)) for x in (
                query[b, h], key[b, h // group], value[b, h // group])), scaling, **VARIANTS[name])[:n]
                for h in range(query.shape[1])]) for b in range(query.shape[0])])
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("fp8_error_loss", attention)
    model.set_attn_implementation("fp8_error_loss")
    scored = length // 4
    rows, reference = [], None
    for name in [None, "bf16", *variants]:
        state["variant"] = name
        losses = last_token_losses(model, texts, scored)
        reference = reference or losses
        delta = sum(a - b for a, b in zip(losses, reference)) / len(losses)
        if name is not None:
            rows.append({"inputs": f"loss, {windows} prose windows", "variant": name, "delta_nll": delta})
            print(f"loss {name:<24} delta {delta:+.4f} nats per token", flush=True)
    return rows


def measure(inputs: str, heads: list) -> list:
    rows = []
    exacts = [float_attention(q, k, v, scale) for q, k, v, scale in heads]
    for name, options in {"bf16": None, **VARIANTS}.items():
        errors = []
        for (q, k, v, scale), exact in zip(heads, exacts):
            if options is None:
                q16, k16, v16 = (x.bfloat16().float() for x in (q, k, v))
                errors.append(relative_l2(float_attention(q16, k16, v16, scale), exact))
            else:
                errors.append(relative_l2(fp8_attention(q, k, v, scale, **options), exact))
        rows.append({"inputs": inputs, "variant": name, "rel_l2_max": max(errors),
                     "rel_l2_mean": sum(errors) / len(errors), "heads": len(errors)})
        print(f"{inputs:>14} {name:<24} max {max(errors):.4f} mean {sum(errors) / len(errors):.4f}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens of the prose window (a multiple of 128)")
    parser.add_argument("--layers", type=int, nargs="*", default=[3, 10, 17, 24, 29], help="none: no capture")
    parser.add_argument("--head-every", type=int, default=2, help="measure every n-th query head")
    parser.add_argument("--random-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--nll-windows", type=int, default=0, help="also score the loss on this many windows")
    parser.add_argument("--nll-variants", nargs="+", default=["token+qsmooth", "qk-float"], choices=list(VARIANTS))
    parser.add_argument("--out", default=None, help="the run's table and the store go here")
    args = parser.parse_args(argv)
    if args.length % BLOCK:
        parser.error(f"--length must be a multiple of {BLOCK}, got {args.length}")
    torch.manual_seed(0)
    rows = []
    if args.layers:
        for layer, heads in sorted(captured_heads(args.length, args.layers, args.head_every).items()):
            rows += measure(f"layer {layer}", heads)
    generator = torch.Generator().manual_seed(0)
    for d in args.random_dims:
        q, k, v = (torch.randn(args.length, d, generator=generator) for _ in range(3))
        rows += measure(f"random D={d}", [(q, k, v, d ** -0.5)])
    if args.nll_windows:
        rows += loss_rows(args.length, args.nll_windows, args.nll_variants)
    for row in rows:
        row["length"] = args.length
    print(write_results("fp8_attention_error", rows, meta={"length": args.length, "layers": args.layers},
                        out_dir=args.out, store="fp8_attention_error", params=("inputs", "variant", "length")))


if __name__ == "__main__":
    main()
