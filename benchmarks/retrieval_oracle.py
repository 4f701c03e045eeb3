"""Can any block selection keep retrieval at density 0.1? Exact block-masked attention on the retrieval model.

    python benchmarks/retrieval_oracle.py                      # GPU: 16K, 32K, 64K; ~8 min
    python benchmarks/retrieval_oracle.py --smoke              # CPU: an untrained tiny model, seconds

``bench_retrieval.py`` shows every method losing most of its retrieval at density 0.1, although the needle's tile is
listed for most (layer, head) plans of a missed value. This script asks whether that is the density or the
selectors: it runs the retrieval model (``checkpoints/retrieval_lm.pt``, the same instances as
``bench_retrieval.py``) with every attention replaced by exact attention restricted, per (layer, query head,
query block of ``--block`` rows), to the key tiles a policy picks:

* ``dense``: every causal key (the same code path; it must match the model's own accuracy);
* ``oracle@ρ``: the tiles holding the most true attention mass summed over the block's rows;
* ``rowmax@ρ``: the tiles ranked by the most mass any single row of the block puts in them;
* ``meanpool@ρ``: the tiles ranked by the block's mean query against each tile's mean key (what the methods'
  selectors pool), so the gap between it and the oracles is the pooling's;
* estimators a selector could afford (1/128 to 1/16 of QK^T): ``rowmax-meankeys`` (every row against the tile-mean
  keys, the best row per tile), ``keymax-meanquery`` (the block-mean query against every key, the best key per
  tile), ``sampled-rows`` (the exact mass of every 16th row of the block; ``sampled-rows8`` every 8th, and so on).

Query block i keeps max(1, ⌈ρ(i+1)⌉) of its i+1 causal tiles, its diagonal tile always among them; the softmax runs
over the kept keys only, in float32. Scores are built one chunk of query rows at a time (no N x N matrix).
Rows: ``results/retrieval_oracle.jsonl``; the run's table: ``--out`` (default ``results/runs/``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import retrieval_tasks as rt  # noqa: E402
import train_small_lm as tsl  # noqa: E402
from harness import write_results  # noqa: E402

POLICIES = ("dense", "oracle", "rowmax", "meanpool", "rowmax-meankeys", "keymax-meanquery", "sampled-rows")
SAMPLE_EVERY = 16  # sampled-rows: every 16th row of a query block (its last row included) is scored exactly


def tile_budget(rho: float, blocks: torch.Tensor) -> torch.Tensor:
    """Tiles kept by query block i (of i+1 causal tiles): max(1, ceil(rho (i+1)))."""
    return torch.clamp(torch.ceil(rho * (blocks + 1) - 1e-9), min=1).long()


def sample_every(policy: str) -> int:
    """Rows per scored row of a ``sampled-rows<k>`` policy (``sampled-rows``: ``SAMPLE_EVERY``)."""
    return int(policy[len("sampled-rows"):] or SAMPLE_EVERY)


def tile_scores(policy: str, scores: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, q_mean: torch.Tensor,
                k_mean: torch.Tensor, block: int, scale: float, row0: int) -> torch.Tensor:
    """(query blocks of the chunk, key tiles) ranking scores of ``policy``.

    ``scores`` (rows, keys): the chunk's exact causal logits (rows from ``row0``); ``queries`` its rows, ``keys`` the
    keys it sees;
    ``q_mean`` / ``k_mean`` the chunk's query-block means and every key tile's mean. The oracles read the exact
    probabilities; the others estimate from what a selector could afford (at most 1/16 of QK^T).
    """
    rows, tiles = scores.shape[0], k_mean.shape[0]
    row_blocks = lambda x: torch.nn.functional.pad(x, (0, 0, 0, -rows % block)).view(-1, block, x.shape[-1])  # noqa
    if policy == "meanpool":  # what the methods' selectors pool: block-mean query . tile-mean key
        return q_mean @ k_mean.T
    if policy == "keymax-meanquery":  # the block-mean query against every key, the best key of each tile
        logits = torch.nn.functional.pad(q_mean @ keys.T, (0, tiles * block - keys.shape[0]), value=float("-inf"))
        return logits.view(-1, tiles, block).amax(-1)
    if policy == "rowmax-meankeys":  # every row against the tile-mean keys, softmax per row, the best row per tile
        logits = (queries @ k_mean.T * scale).masked_fill(  # a row's causal tiles only
            torch.arange(tiles, device=keys.device)[None, :] > (torch.arange(rows, device=keys.device)[:, None] + row0)
            // block, float("-inf"))
        return row_blocks(torch.softmax(logits, dim=-1)).amax(1)
    probs = torch.softmax(scores, dim=-1)
    per_row = torch.nn.functional.pad(probs, (0, tiles * block - probs.shape[1])).view(rows, tiles, block).sum(-1)
    per_row = row_blocks(per_row)  # (query blocks, block rows, tiles): each row's mass per tile
    if policy == "oracle":
        return per_row.sum(1)
    if policy == "rowmax":
        return per_row.amax(1)
    every = sample_every(policy)
    return per_row[:, every - 1::every].sum(1)  # sampled-rows


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: str, rho: float, block: int,
                     chunk: int) -> torch.Tensor:
    """Causal attention of q (B, Hq, N, D) over k, v (B, Hkv, N, D), each query block restricted to its policy's
    tiles; float32 inside, ``q.dtype`` out."""
    batch, heads_q, n, dim = q.shape
    group = heads_q // k.shape[1]
    scale = 1.0 / math.sqrt(dim)
    out = torch.empty_like(q)
    tiles = -(-n // block)
    counts = torch.clamp(n - torch.arange(tiles, device=q.device) * block, max=block)[:, None]
    for b in range(batch):
        for h in range(heads_q):
            qh, kh, vh = q[b, h].float(), k[b, h // group].float(), v[b, h // group].float()
            k_mean = torch.nn.functional.pad(kh, (0, 0, 0, tiles * block - n)).view(tiles, block, dim).sum(1) / counts
            q_mean = torch.nn.functional.pad(qh, (0, 0, 0, tiles * block - n)).view(tiles, block, dim).sum(1) / counts
            for r0 in range(0, n, chunk):
                r1 = min(n, r0 + chunk)
                rows = torch.arange(r0, r1, device=q.device)
                scores = (qh[r0:r1] @ kh[:r1].T) * scale
                scores.masked_fill_(torch.arange(r1, device=q.device)[None, :] > rows[:, None], float("-inf"))
                if policy != "dense":
                    b0, b1 = r0 // block, -(-r1 // block)
                    blocks = torch.arange(b0, b1, device=q.device)
                    rank = tile_scores(policy, scores, qh[r0:r1], kh[:r1], q_mean[b0:b1], k_mean[:b1], block,
                                       scale, r0).float()
                    cols = torch.arange(b1, device=q.device)
                    rank = rank.masked_fill(cols[None, :] > blocks[:, None], float("-inf"))
                    rank = rank.masked_fill(cols[None, :] == blocks[:, None], float("inf"))  # the diagonal tile
                    order = rank.argsort(dim=-1, descending=True, stable=True)
                    keep = torch.zeros_like(rank, dtype=torch.bool)
                    keep.scatter_(1, order, cols[None, :] < tile_budget(rho, blocks)[:, None])
                    kept = keep.repeat_interleave(block, dim=1)[:, :r1][(rows // block) - b0]
                    scores = scores.masked_fill(~kept, float("-inf"))
                out[b, h, r0:r1] = (torch.softmax(scores, dim=-1) @ vh[:r1]).to(q.dtype)
    return out


@contextlib.contextmanager
def attention_policy(model, policy: str, rho: float, block: int, chunk: int):
    """Inside the block, the example model's attention calls run ``masked_attention`` (only this model's module
    sees the replacement; it is restored on exit)."""
    module = sys.modules[type(model.layers[0].attention).__module__]
    functional = module.F

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal and attn_mask is None and scale is None, "the example model's call only"
        return masked_attention(q, k, v, policy, rho, block, chunk)

    module.F = types.SimpleNamespace(**{name: getattr(functional, name) for name in dir(functional)
                                        if not name.startswith("__")})
    module.F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        module.F = functional


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--contenders", nargs="+",
                        default=["dense", "oracle@0.05", "oracle@0.1", "rowmax@0.1", "meanpool@0.1",
                                 "rowmax-meankeys@0.1", "keymax-meanquery@0.1", "sampled-rows@0.1"],
                        help="dense, or <policy>@<density> with a policy of POLICIES (sampled-rows<k>: every "
                             "k-th row)")
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024, help="query rows per score matrix")
    parser.add_argument("--checkpoint", default=str(tsl.REPO / "benchmarks" / "checkpoints" / "retrieval_lm.pt"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        mod = tsl.load_model_module()
        torch.manual_seed(0)
        model = mod.Transformer(mod.ModelArgs(**tsl.RETRIEVAL_SMOKE_MODEL, max_seq_len=4096)).to(device).eval()
        args.lengths, args.per_task, args.block, args.chunk = [1024], 1, 32, 256
    else:
        model, _ = tsl.load_checkpoint(args.checkpoint, device=device,
                                       dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    corpus = tsl.build_corpus(1 << 20)
    contenders = []
    for name in args.contenders:
        policy, _, rho = name.partition("@")
        sampled = policy.startswith("sampled-rows") and policy[len("sampled-rows"):].isdigit()
        if (policy not in POLICIES and not sampled) or (policy == "dense") != (rho == ""):
            raise SystemExit(f"--contenders: {name!r} is not 'dense' or <policy>@<density>, policy one of "
                             f"{POLICIES[1:]}")
        contenders.append((policy, float(rho or 1.0)))
    rows = []
    for length in args.lengths:
        rng = random.Random(7_777_777 + length)  # bench_retrieval.py's instances
        instances = [inst for task in rt.TASKS for inst in rt.make_batch([task] * args.per_task, corpus.heldout,
                                                                         length, rng, "vkey")]
        for policy, rho in contenders:
            started = time.perf_counter()
            results = []
            with torch.no_grad(), attention_policy(model, policy, rho, args.block, args.chunk):
                for inst in instances:
                    logits = model(inst.tokens[None].to(device).long())[0]
                    results.extend(rt.score(logits.float(), inst))
            row = {"N": length, "policy": policy if policy == "dense" else f"{policy}@{rho:g}",
                   "exact": sum(r["exact"] for r in results) / len(results), "values": len(results)}
            for task in rt.TASKS:
                mine = [r for r in results if r["task"] == task]
                row[task] = sum(r["exact"] for r in mine) / len(mine)
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(row, flush=True)
    meta = {"checkpoint": None if args.smoke else args.checkpoint, "per_task": args.per_task, "block": args.block,
            "style": "vkey"}
    print(write_results("retrieval_oracle_smoke" if args.smoke else "retrieval_oracle", rows, meta=meta,
                        out_dir=args.out, columns=["N", "policy", "exact", *rt.TASKS, "values", "seconds"],
                        store=None if args.smoke and not args.out else "retrieval_oracle", params=("N",), extra={"block": args.block, "per_task": args.per_task}))


if __name__ == "__main__":
    main()
