"""Methods named on the command line (``name`` or ``name:field=value,...``), the density and dispatch a run
recorded, and the calibration of a method's density knob to a target share of the causal tiles (bisection on
captured ``(q, k)`` pairs): for ``bench_e2e.py`` and the benchmarks that run the methods at a fixed density."""

from __future__ import annotations

import argparse
import json
import math

import torch

import sparse_compile

METHODS = tuple(sparse_compile.registry.registered_methods())  # the four papers' and the sampled selector
# parameters held fixed while calibrating, so that the target densities are reachable on random weights:
# SpargeAttn's self-similarity judge flags every block of a random-weight model as not self-similar (always
# computed), so TopCdf never applies unless the judge is switched off (theta = -1); BFLA's flatten-g block softmax
# with alpha = 1/sqrt(C) is nearly one-hot, which caps its density near 0.34, so alpha = 1/(g sqrt(C)) is used.
def budget_fixed(method: str, base: "sparse_compile.SparseConfig", head_dim: int) -> dict:
    if method == "sparge":
        return {"similarity_threshold": -1.0}
    if method == "bfla":
        return {"score_scale": 1.0 / (base.params_of("bfla").group_size * math.sqrt(head_dim))}
    return {}


def method_spec(spec: str) -> str:
    """``name`` or ``name:field=value,...`` (checked here: an unknown method or field fails at the command line)."""
    name, extra = split_spec(spec)
    if name not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
    sparse_compile.SparseConfig(method=name, **({name: extra} if extra else {}))
    return spec


def split_spec(spec: str) -> tuple[str, dict]:
    """(method, parameters) of ``name:field=value,...`` (values parsed as JSON: numbers, true/false)."""
    name, _, fields = spec.partition(":")
    params = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        params[key] = json.loads(value.lower() if value in ("True", "False") else value)
    return name, params


def recorded_density(fn, ids, method: str, params: dict) -> tuple[float, int]:
    """(mean density over sites and heads, number of sparse attention calls) of one run.

    Density recording costs syncs, so this run is not timed. The call count checks that every layer went sparse:
    a layer that fell back to eager (e.g. past Dynamo's recompile limit) runs dense and is not counted.
    """
    sparse_compile.reset_runtime_stats()
    with torch.no_grad(), sparse_compile.sparsity(method=method, record_density=True, **params):
        fn(ids)
    stats = sparse_compile.runtime_stats().values()
    values = [s.mean_density for s in stats if s.mean_density is not None]
    calls = sum(n for s in stats for (path, _), n in s.calls.items() if path == "sparse")
    return (sum(values) / len(values) if values else float("nan")), calls


def dispatch_summary(stats: dict) -> str:
    """``"32 sparse"`` or ``"4 sparse, 28 dense (plan density 0.91 above break-even 0.58 ...)"`` for one run."""
    counts: dict = {}
    reasons: dict = {}
    for site in stats.values():
        for (path, reason), n in site.calls.items():
            counts[path] = counts.get(path, 0) + n
            if path == "dense":
                short = reason.split(" (")[0]
                reasons[short] = reasons.get(short, 0) + n
    text = ", ".join(f"{counts[p]} {p}" for p in ("sparse", "dense") if counts.get(p))
    if reasons:
        text += f" ({max(reasons, key=reasons.get)})"
    return text


def calibrate(method: str, target: float, layers: list, base: sparse_compile.SparseConfig, steps: int = 10,
              reorder: str | None = None):
    """The method's density parameter that keeps about ``target`` of the causal tiles, on average over the captured
    ``(q, k)`` pairs of ``layers`` (bisection). ``reorder`` replaces the method's reorder stage (``"none"``: its
    selector without its permutation). Returns (parameters, achieved density)."""
    from sparse_compile.methods import build_plan
    from sparse_compile.plan import execute_plan
    from sparse_compile.report import density_from_visits

    spec = sparse_compile.registry.method_spec(method).density  # the knob that sets the method's density
    knob, increasing, low, high = spec.name, spec.higher_keeps_more, spec.low, spec.high
    fixed = budget_fixed(method, base, layers[0][0].shape[-1])

    def density(value):
        config = base.with_overrides(method, {**fixed, knob: value})
        if reorder is not None:
            config = config.replace(reorder=reorder)
        values = []
        for q, k in layers:
            scale = 1.0 / math.sqrt(q.shape[-1])
            plan = build_plan(q, k, scale, config)
            if plan.early_stop > 0:  # early stop decides at run time: count the tiles actually visited
                _, visited = execute_plan(q, k, k, plan, scale, return_visited=True)
                d = density_from_visits(visited, plan, q.shape[-2], k.shape[-2], q.shape[1])
                values.append(sum(d) / len(d))
            else:
                values.append(float(plan.density(q.shape[-2], k.shape[-2]).mean()))
        return sum(values) / len(values)

    best = None
    for _ in range(steps):
        mid = (low + high) / 2
        d = density(mid)
        if best is None or abs(d - target) < abs(best[1] - target):
            best = (mid, d)
        if (d < target) == increasing:
            low = mid
        else:
            high = mid
    return {**fixed, knob: best[0]}, best[1]
