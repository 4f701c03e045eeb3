"""Does a per-block mass target lose less than a fixed share of tiles, at the same density, on a real model?

    python benchmarks/research/share_rules.py --length 8192 --rules share:0.1 share:0.2 topp:0.97 --out OUT  # CPU
    python benchmarks/research/share_rules.py --length 2048 --windows 1 --rules share:0.1 summaries:0.1      # quick

The next-token loss of SmolLM2-135M (the model of ``bench_real_weights.py``, float32 on the CPU, its native rope up
to 8,192 tokens) on ``--windows`` prose windows (the last ``length / 4`` tokens, at most 2,048, of each), with
every layer's attention replaced by a block-sparse attention computed here in PyTorch (exact on the kept tiles,
N x N never built: one 128-row block at a time). The selection is `sampled`'s at its defaults (the package's tile
masses of every 8th row of each 128-row block; the diagonal tile, tile 0 and the 8 tiles before the diagonal
forced; the last 128 rows exact), with the rule for the other tiles:

* ``share:b``: the ceil(b x visible tiles) of highest sampled mass (the `sampled` rule; ``share:0.1`` is its
  default and gives the package's loss);
* ``topp:t``: the fewest highest tiles whose sampled mass, with the forced tiles', reaches t of the block's, at
  least ``--floor`` and at most ``--cap`` x visible tiles (`sampled`'s default: t 0.95, floor 0.05, cap 0.2);
* ``pool:t``: ``topp:t`` within a head's total of ``share:--pool-share``: each block wants the tiles that reach t
  (at least ``--floor``), blocks wanting fewer than the share give the rest to the head's blocks wanting more, each
  of those getting the same fraction of its extra (so no head keeps more tiles than the share would);
* ``summaries:b``: ``share:b``, plus every dropped tile as one summary key (logit log(128) + s q.mean(k), value
  mean(v)) in the row's softmax.

Printed and stored per rule: the loss against dense attention's on the same windows and the density (kept tiles
over causal tiles, mean over layers and calls). Rows go to the store ``benchmarks/results/share_rules.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import write_results  # noqa: E402

from sparse_compile.methods.sampled import sampled_tile_logits  # noqa: E402

BLOCK = 128
EVERY = 8
LOCAL_TILES = 8
RULES = ("share", "topp", "pool", "summaries")


def rule_of(text: str) -> tuple:
    name, _, value = text.partition(":")
    if name not in RULES or not value:
        raise argparse.ArgumentTypeError(f"a rule is one of {RULES} with a value, like share:0.1; got {text!r}")
    return name, float(value)


def select(q: torch.Tensor, k: torch.Tensor, scale: float, rule: tuple, floor: float, pool_share: float = 0.1,
           cap: float = 1.0, every: int = EVERY) -> torch.Tensor:
    """Kept tiles (B, H, nqb, nkt) bool of q (B, H, N, D) and k (B, H, N, D), N a multiple of BLOCK."""
    batch, heads, n, _ = q.shape
    nqb = n // BLOCK
    qi, kj = torch.arange(nqb)[:, None], torch.arange(nqb)[None, :]
    visible, full = kj <= qi, kj < qi
    mass = sampled_tile_logits(q, k, scale, BLOCK, every, local=LOCAL_TILES).exp() * visible  # the package's
    mass = mass / mass.sum(-1, keepdim=True)  # each tile's share of its block's sampled mass
    forced = (visible & ~full) | (full & (kj >= qi - LOCAL_TILES)) | (visible & (kj == 0))
    candidate = full & ~forced
    ranked = mass.masked_fill(~candidate, -1.0)
    order = ranked.argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(nqb).expand_as(order))
    tiles = visible.sum(1).float()
    if rule[0] in ("topp", "pool"):
        reached = (mass * forced).sum(-1, keepdim=True) + ranked.gather(-1, order).clamp(min=0).cumsum(-1)
        allowed = torch.maximum((reached < rule[1]).sum(-1) + 1.0, torch.ceil(floor * tiles - 1e-9))
        allowed = torch.minimum(allowed, torch.clamp(torch.ceil(cap * tiles - 1e-9), min=1))
        if rule[0] == "pool":
            share = torch.clamp(torch.ceil(pool_share * tiles - 1e-9), min=1).expand_as(allowed)
            allowed = torch.minimum(allowed, candidate.sum(-1).clamp(min=1).float())
            give = (share - allowed).clamp(min=0).sum(-1, keepdim=True)
            take = (allowed - share).clamp(min=0).sum(-1, keepdim=True)
            fraction = torch.where(take > 0, (give / take.clamp(min=1)).clamp(max=1), torch.ones_like(take))
            allowed = torch.where(allowed <= share, allowed, share + torch.floor((allowed - share) * fraction))
    else:
        allowed = torch.clamp(torch.ceil(rule[1] * tiles - 1e-9), min=1).expand(batch, heads, nqb)
    return forced | (candidate & (rank < allowed[..., None]))


def sparse_attention(q, k, v, scale: float, rule: tuple, densities: list, **options) -> torch.Tensor:
    batch, heads, n, d = q.shape
    group = heads // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    q = q.float()
    pad = -n % BLOCK
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    keep = select(qp, kp, scale, rule, **options)
    nqb = keep.shape[2]
    densities.append(float(keep.float().sum() / (batch * heads * nqb * (nqb + 1) / 2)))
    tiles_k, tiles_v = kp.view(batch, heads, nqb, BLOCK, d).mean(3), vp.view(batch, heads, nqb, BLOCK, d).mean(3)
    out = torch.empty_like(q)
    exact_from = n - BLOCK
    for i in range(nqb):
        r0, r1 = i * BLOCK, min((i + 1) * BLOCK, n)
        s = (q[:, :, r0:r1] @ k[:, :, :r1].transpose(-1, -2)) * scale
        exact = torch.arange(r0, r1)[:, None] >= exact_from
        kept = keep[:, :, i].repeat_interleave(BLOCK, -1)[..., None, :r1] | exact
        seen = torch.arange(r1)[None, :] <= torch.arange(r0, r1)[:, None]
        s = s.masked_fill(~(kept & seen), float("-inf"))
        if rule[0] != "summaries" or i == 0:
            out[:, :, r0:r1] = torch.softmax(s, -1) @ v[:, :, :r1]
            continue
        z = (q[:, :, r0:r1] @ tiles_k[:, :, :i].transpose(-1, -2)) * scale + math.log(BLOCK)
        z = z.masked_fill(keep[:, :, i, None, :i] | exact, float("-inf"))
        p = torch.softmax(torch.cat([s, z], -1), -1)
        out[:, :, r0:r1] = p[..., :r1] @ v[:, :, :r1] + p[..., r1:] @ tiles_v[:, :, :i]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--rules", type=rule_of, nargs="+", default=[rule_of("share:0.1"), rule_of("topp:0.97")])
    parser.add_argument("--floor", type=float, default=0.05, help="the least share a topp or pool rule keeps")
    parser.add_argument("--pool-share", type=float, default=0.1, help="the share whose total a pool rule keeps")
    parser.add_argument("--cap", type=float, default=1.0, help="the most a topp rule keeps (sampled's budget)")
    parser.add_argument("--every", type=int, default=EVERY, help="every k-th row of a block scored")
    parser.add_argument("--out", default=None, help="the run's table and the store go here")
    args = parser.parse_args(argv)
    if args.length > 8192:
        parser.error("--length: up to 8,192 (the model's native context; longer needs rope extension)")
    from transformers import AttentionInterface

    from bench_real_weights import last_token_losses, prose_model

    torch.manual_seed(0)
    model, windows = prose_model(args.length, args.windows)  # native rope up to 8,192 tokens
    state = {"rule": None, "densities": []}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if state["rule"] is None or query.shape[2] < 2 * BLOCK:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            out = sparse_attention(query, key, value, scaling, state["rule"], state["densities"], floor=args.floor,
                                   pool_share=args.pool_share, cap=args.cap, every=args.every)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("share_rules", attention)
    model.set_attn_implementation("share_rules")
    scored = min(2048, args.length // 4)
    rows, dense = [], None
    for rule in [None, *args.rules]:
        state["rule"], state["densities"] = rule, []
        started = time.time()
        losses = last_token_losses(model, windows, scored)
        dense = dense or losses
        name = "dense" if rule is None else f"{rule[0]}:{rule[1]:g}"
        delta = sum(a - b for a, b in zip(losses, dense)) / len(losses)
        density = sum(state["densities"]) / len(state["densities"]) if state["densities"] else 1.0
        rows.append({"rule": name, "length": args.length, "windows": args.windows, "floor": args.floor,
                     **({"cap": args.cap} if args.cap < 1.0 else {}),
                     **({"every": args.every} if args.every != EVERY else {}),
                     **({"pool_share": args.pool_share} if rule and rule[0] == "pool" else {}),
                     "nll": sum(losses) / len(losses), "delta_nll": delta, "density": density})
        print(f"{name}: loss {sum(losses) / len(losses):.4f} delta {delta:+.4f} density {density:.3f} "
              f"({time.time() - started:.0f} s)", flush=True)
    print(write_results("share_rules", rows, meta={"length": args.length, "windows": args.windows},
                        out_dir=args.out, store="share_rules",
                        params=("rule", "length", "windows", "floor", "pool_share", "cap", "every")))


if __name__ == "__main__":
    main()
