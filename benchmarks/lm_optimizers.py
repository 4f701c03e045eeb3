"""The small LMs' optimizers: AdamW, or Muon (orthogonalised momentum) for the blocks' weight matrices and AdamW
for the rest; the warm-up and cosine learning-rate schedule; the optimizer step's measured time, which the
step-count calibration of ``train_small_lm.py`` counts."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch


def orthogonalized(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Each matrix's polar factor U V^T (batched over leading dims), approximately: singular values pushed into
    about [0.7, 1.2] by a quintic Newton-Schulz iteration in bf16 on the wide orientation, whose coefficients
    favour a fast rise of small singular values over exact convergence (Muon, Jordan et al. 2024)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose step for each weight matrix is its Nesterov momentum orthogonalised (every direction
    moves at the same rate), scaled by sqrt(max(1, rows / cols)). ``row_splits`` maps a parameter to the row
    counts of the matrices it stacks (a fused q/k/v projection), orthogonalised one by one. Matrices of one
    shape are orthogonalised as one batch (a few dozen launches per step, not hundreds). Only for 2-D hidden
    weights: embeddings, the output head and norm gains stay with AdamW."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 row_splits: Optional[dict] = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.row_splits = row_splits or {}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p.grad)
                buf = state["momentum"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                start = 0
                for rows in self.row_splits.get(p, (p.shape[0],)):
                    part = update[start:start + rows]
                    by_shape.setdefault(tuple(part.shape), []).append((p, start, part))
                    start += rows
            for (rows, cols), parts in by_shape.items():
                steps = orthogonalized(torch.stack([part for _, _, part in parts]))
                scale = max(1.0, rows / cols) ** 0.5
                for (p, start, _), step in zip(parts, steps):
                    p[start:start + rows].add_(step, alpha=-group["lr"] * scale)


def make_optimizers(model, args, device) -> list:
    """AdamW for everything (``--optimizer adamw``), or Muon for the blocks' weight matrices and AdamW for the
    embedding, the output head and the norm gains (``--optimizer muon``). Each group keeps its peak rate in
    ``peak_lr``; the schedule scales it."""
    def adamw(params: list) -> torch.optim.AdamW:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # norms: decaying their gains only hurts
        return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    if args.optimizer == "adamw":
        opts = [adamw(list(model.parameters()))]
    else:
        hidden, splits = [], {}
        for block in model.layers:
            for name, p in block.named_parameters():
                if p.dim() == 2:
                    hidden.append(p)
                    if name.endswith("wqkv.weight"):
                        attn = block.attention
                        splits[p] = (attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim,
                                     attn.n_kv_heads * attn.head_dim)
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if id(p) not in hidden_ids]
        opts = [Muon(hidden, lr=args.muon_lr, weight_decay=0.0, row_splits=splits), adamw(rest)]
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


def optimizer_step_seconds(model, args, device, sync, repeats: int = 7) -> float:
    """Median time of one step of ``args.optimizer``'s optimizers, on a copy of the model with random gradients.
    On the GPU it is the device's time: in training the host launches a step while the previous one runs, so
    the launches' host time is hidden (timing it with the host clock over-counted Muon's step ~5x)."""
    import copy

    probe = copy.deepcopy(model)
    for p in probe.parameters():
        p.grad = torch.randn_like(p)
    opts = make_optimizers(probe, args, device)
    times = []
    for _ in range(repeats):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU work queued first: the launches below run ahead of it
            start.record()
            for opt in opts:
                opt.step()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            for opt in opts:
                opt.step()
            times.append(time.perf_counter() - t)
    del probe, opts
    return median_after_warmup(times)


def median_after_warmup(times: list, warmup: int = 2) -> float:
    """Median of timings, the first ``warmup`` dropped (allocations, autotuning)."""
    kept = sorted(times[warmup:])
    return kept[len(kept) // 2]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
