"""Evaluation of the quality benchmarks: the curves (each method's density parameter and its sweeps), and the two
measurements: (a) bits per byte through the compiled backend, (b) operator error against float32 dense attention.

``quality.py`` is the command line and the report; ``quality_data.py`` provides the documents and captured inputs.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_data import capture_attention_inputs, sdpa_replaced  # noqa: E402

import sparse_compile  # noqa: E402
from sparse_compile import SparseConfig, sparsity  # noqa: E402

__all__ = ["METHODS", "PARAM", "PPL_SWEEP", "OP_SWEEP", "SMOKE_SWEEP", "SMOKE_OPTIONS", "BFLA_BLOCK_SCALE", "OP_CURVES",
           "PPL_CURVES", "curve_options", "default_value", "sweep_with_default", "method_config",
           "compile_sparse", "Deadline", "sync", "run_ppl", "run_operator"]

METHODS = ("pbs", "sparge", "bfla", "s2o")
#: the parameter of each method that controls its density
PARAM = {"pbs": "threshold", "sparge": "cdf_threshold", "bfla": "mass_threshold", "s2o": "early_stop"}
PPL_SWEEP = {
    "pbs": [0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0],  # 1.0 keeps every block: must reproduce dense
    "sparge": [0.5, 0.7, 0.8, 0.9, 0.95, 0.98],
    "bfla": [0.5, 0.7, 0.8, 0.9, 0.95, 0.99],
    "s2o": [0.05, 0.02, 0.01, 0.005, 0.002, 0.001],
}
OP_SWEEP = {
    "pbs": [0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99],
    "sparge": [0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99],
    "bfla": [0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999],
    "s2o": [0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0005],
}
BFLA_BLOCK_SCALE = "bfla α=1/(g√C)"


def bfla_block_scale(head_dim: int) -> dict:
    """BFLA with alpha = 1/(g sqrt(C)): flatten-g block logits on the scale of token logits (BFLAParams docstring).

    With the paper's alpha = 1/sqrt(C) a flatten-g score, a sum of g token products, makes the block softmax
    nearly one-hot, so gamma barely moves the density; this variant measures what the method does otherwise."""
    return {"bfla": {"score_scale": 1.0 / (SparseConfig().params_of("bfla").group_size * math.sqrt(head_dim))}}


#: operator-level curves: (label, method, extra options or a function of the head dim giving them). Besides the
#: four methods: PBS's selector without its permutation (the MeanPooling baseline of the PBS paper: what the
#: permutation buys), SpargeAttn with the self-similarity judge off (theta = 0: every block is a candidate for
#: TopCdf, so density follows tau alone) and BFLA with block logits scaled by 1/g.
OP_CURVES = (
    ("pbs", "pbs", {}),
    ("sparge", "sparge", {}),
    ("bfla", "bfla", {}),
    ("s2o", "s2o", {}),
    ("pbs w/o perm", "pbs", {"reorder": "none"}),
    ("sparge θ=0", "sparge", {"sparge": {"similarity_threshold": 0.0}}),
    (BFLA_BLOCK_SCALE, "bfla", bfla_block_scale),
)


#: bits-per-byte curves, same form: the four methods at their paper settings, and BFLA with alpha = 1/(g sqrt(C))
PPL_CURVES = tuple((m, m, {}) for m in METHODS) + ((BFLA_BLOCK_SCALE, "bfla", bfla_block_scale),)


def curve_options(extra, head_dim: int) -> dict:
    return extra(head_dim) if callable(extra) else extra


SMOKE_SWEEP = {"pbs": [0.5], "sparge": [0.5], "bfla": [0.5], "s2o": [0.05]}  # plus each default
SMOKE_OPTIONS = {
    "pbs": {"block_size": 32, "segment_size": 64},
    "sparge": {"block_size_q": 32, "block_size_kv": 32},
    "bfla": {"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32, "local_tiles": 1,
             "stride": 4},
    "s2o": {"segment_size": 128, "block_size_q": 32, "block_size_kv": 32},
}
LN2 = math.log(2.0)


def default_value(method: str) -> float:
    return getattr(SparseConfig().params_of(method), PARAM[method])


def sweep_with_default(values: list[float], method: str) -> list[float]:
    d = default_value(method)
    return values if any(math.isclose(v, d) for v in values) else sorted(values + [d])


def compile_sparse(model, options: dict, notes: list):
    """``torch.compile(model, backend="sparse_prefill", ...)``; the registered name needs the installed entry
    point, so an uninstalled checkout falls back to the backend callable itself (the same function)."""
    try:
        return torch.compile(model, backend="sparse_prefill", options=options, dynamic=True)
    except Exception as exc:  # noqa: BLE001 - torch raises its InvalidBackend here
        notes.append(f"backend name 'sparse_prefill' not registered ({type(exc).__name__}): compiled with "
                     "backend=sparse_compile.sparse_prefill (the same function)")
        return torch.compile(model, backend=sparse_compile.sparse_prefill, options=options, dynamic=True)


class Deadline:
    def __init__(self, seconds: float):
        self.t0 = time.time()
        self.end = self.t0 + seconds

    def left(self) -> float:
        return self.end - time.time()

    def at(self, fraction: float) -> float:
        return self.t0 + fraction * (self.end - self.t0)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def method_config(method: str, value: Optional[float], base: dict, **extra) -> SparseConfig:
    """SparseConfig of ``method`` with its density parameter at ``value`` on top of the base options.

    ``extra``: more SparseConfig fields; a dict value (per-method parameters) is merged into the base's."""
    opts = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, val in extra.items():
        opts[key] = dict(opts.get(key, {}), **val) if isinstance(val, dict) else val
    opts["method"] = method
    if value is not None:
        opts[method] = dict(opts.get(method, {}), **{PARAM[method]: value})
    return SparseConfig.from_options(opts)


# --- (a) bits per byte through the compiled backend ---------------------------------------------------------------
def bits_per_byte(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document: mean bits per predicted byte, over all positions and over the second half."""
    B, L = tokens.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                         reduction="none").view(B, L - 1) / LN2
    return ce.mean(1), ce[:, L // 2:].mean(1)


def sdpa_routed_to_sparse(base_config: SparseConfig):
    """Eager alternative to the compiled backend: causal SDPA calls go through ``sparse_attention``."""
    inside = []  # sparse_attention's own dense path calls SDPA again: that call must reach the real one

    def routed(real, q, k, v, **kwargs):
        if kwargs["is_causal"] and kwargs["attn_mask"] is None and kwargs["dropout_p"] == 0.0 and not inside:
            inside.append(True)
            try:
                return sparse_compile.sparse_attention(q, k, v, scale=kwargs["scale"], config=base_config)
            finally:
                inside.pop()
        return real(q, k, v, **kwargs)

    return sdpa_replaced(routed)


def site_summary() -> tuple[Optional[float], int, int, list[str]]:
    """(mean density over sparse sites, sparse sites, all sites, distinct dense reasons) from runtime_stats."""
    densities, sparse_sites, reasons = [], 0, set()
    stats = sparse_compile.runtime_stats()
    for site, s in stats.items():
        for (path, reason), _ in s.calls.items():
            if path == "dense":
                reasons.add(reason)
        if s.mean_density is not None:
            densities.append(s.mean_density)
            sparse_sites += 1
    return (sum(densities) / len(densities) if densities else None), sparse_sites, len(stats), sorted(reasons)


def run_ppl(model, docs, base: dict, kernels: dict, sweeps: dict, mode: str, deadline: float, device, log,
            notes: list, curves: tuple = PPL_CURVES, head_dim: int = 64) -> dict:
    rows, skipped = [], []
    base_cfg = SparseConfig.from_options(dict(base, record_density=True))
    t = time.time()
    if mode == "compiled":
        # dynamic=True: one graph serves every prompt length and batch size (no recompiles inside the sweep)
        compiled = compile_sparse(model, dict(base, record_density=True), notes)
        forward, route = compiled, contextlib.nullcontext()
    else:
        forward, route = model, sdpa_routed_to_sparse(base_cfg)
    with route, torch.no_grad():
        dense = {}
        for length, d in sorted(docs.items()):
            tokens = d["tokens"].to(device)
            sparse_compile.reset_runtime_stats()
            t1 = time.time()
            with sparsity(enabled=False):
                bpb, tail = bits_per_byte(forward(tokens), tokens)
            sync(device)
            dense[length] = (bpb, tail)
            _, _, n_sites, reasons = site_summary()
            rows.append({"length": length, "method": "dense", "param": "-", "value": None, "default": False,
                         "density": 1.0, "bpb": float(bpb.mean()), "delta_bpb": 0.0,
                         "bpb_2nd_half": float(tail.mean()), "delta_2nd_half": 0.0, "sparse_sites": 0,
                         "sites": n_sites, "kernel": "sdpa", "seconds": round(time.time() - t1, 2),
                         "per_doc_bpb": [round(float(x), 4) for x in bpb]})
            log(f"  dense L={length}: {float(bpb.mean()):.4f} bpb ({n_sites} sites; first call includes compile: "
                f"{time.time() - t1:.1f} s)")
        compile_seconds = time.time() - t
        for label, method, extra in curves:
            # the region takes the method's own parameters flat (sparsity(method="bfla", score_scale=...))
            params = curve_options(extra, head_dim).get(method, {})
            for value in sweep_with_default(sweeps[method], method):
                for length, d in sorted(docs.items()):
                    if time.time() > deadline:
                        skipped.append({"length": length, "method": label, "value": value})
                        continue
                    tokens = d["tokens"].to(device)
                    sparse_compile.reset_runtime_stats()
                    t1 = time.time()
                    with sparsity(method=method, kernel=kernels[method], **params, **{PARAM[method]: value}):
                        bpb, tail = bits_per_byte(forward(tokens), tokens)
                    sync(device)
                    density, n_sparse, n_sites, reasons = site_summary()
                    ref, ref_tail = dense[length]
                    rows.append({
                        "length": length, "method": label, "param": PARAM[method], "value": value,
                        "default": math.isclose(value, default_value(method)), "density": density,
                        "bpb": float(bpb.mean()), "delta_bpb": float((bpb - ref).mean()),
                        "bpb_2nd_half": float(tail.mean()), "delta_2nd_half": float((tail - ref_tail).mean()),
                        "sparse_sites": n_sparse, "sites": n_sites, "kernel": kernels[method],
                        "seconds": round(time.time() - t1, 2), "per_doc_bpb": [round(float(x), 4) for x in bpb],
                        "dense_reasons": reasons,
                    })
                    log(f"  {label:6s} {PARAM[method]}={value:<7g} L={length:6d} density "
                        f"{density if density is None else round(density, 3)} bpb {float(bpb.mean()):.4f} "
                        f"(+{float((bpb - ref).mean()):.4f}) sparse sites {n_sparse}/{n_sites} {time.time() - t1:.1f} s")
    return {"mode": mode, "rows": rows, "skipped": skipped, "compile_and_dense_seconds": round(compile_seconds, 1)}


# --- (b) operator level -------------------------------------------------------------------------------------------
def dense_fp32(q, k, v, scale) -> torch.Tensor:
    """The reference: causal attention in float32 (K/V repeated for GQA: the reference kernel then never needs
    an (N x N) matrix, the fused SDPA backends handle float32 with repeated heads)."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(g, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q.float(), kf, vf, is_causal=True, scale=scale)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref
    return {"abs_err": float(diff.abs().sum()), "abs_ref": float(ref.abs().sum()),
            "sq_err": float((diff * diff).sum()), "count": ref.numel()}


def run_operator(model, docs, base: dict, kernels: dict, sweeps: dict, deadline: float, device, log,
                 curves_to_run: tuple = OP_CURVES) -> dict:
    results = {}
    for length, d in sorted(docs.items()):
        tokens = d["tokens"][:1].to(device)
        captured: list = []
        with torch.no_grad(), capture_attention_inputs(captured):
            model(tokens)
        layers = [c for c in captured if c["causal"] and not c["mask"]]
        refs = [dense_fp32(c["q"], c["k"], c["v"], c["scale"]) for c in layers]
        # the floor: dense attention in the model's own precision against the float32 reference
        floor = [errors(F.scaled_dot_product_attention(c["q"], c["k"], c["v"], is_causal=True, scale=c["scale"],
                                                       enable_gqa=True), r) for c, r in zip(layers, refs)]
        curves, skipped = {}, []
        for label, method, extra in curves_to_run:
            extra = curve_options(extra, layers[0]["q"].shape[-1])
            points = []
            for value in sweep_with_default(sweeps[method], method):
                if time.time() > deadline:
                    skipped.append({"curve": label, "value": value})
                    continue
                cfg = method_config(method, value, base, kernel=kernels[method], record_density=True, **extra)
                per_layer = []
                t1 = time.time()
                for li, (c, r) in enumerate(zip(layers, refs)):
                    sparse_compile.reset_runtime_stats()
                    with torch.no_grad():
                        o = sparse_compile.sparse_attention(c["q"], c["k"], c["v"], scale=c["scale"], config=cfg)
                    st = sparse_compile.runtime_stats()["sparse_attention"]
                    dens = st.last_density_per_head if st.last_path == "sparse" else None
                    e = errors(o, r)
                    per_layer.append({"layer": li, "path": st.last_path, "reason": st.last_reason,
                                      "density": (sum(dens) / len(dens)) if dens else None,
                                      "density_per_head": dens, **e,
                                      "rel_l1": e["abs_err"] / e["abs_ref"], "mse": e["sq_err"] / e["count"]})
                sync(device)
                dens_all = [p["density"] for p in per_layer if p["density"] is not None]
                point = {
                    "value": value, "default": math.isclose(value, default_value(method)),
                    "density": sum(dens_all) / len(dens_all) if dens_all else None,
                    # sums over every layer: layers weigh by their output magnitude / element count
                    "rel_l1": sum(p["abs_err"] for p in per_layer) / sum(p["abs_ref"] for p in per_layer),
                    "mse": sum(p["sq_err"] for p in per_layer) / sum(p["count"] for p in per_layer),
                    "sparse_layers": sum(p["path"] == "sparse" for p in per_layer),
                    "seconds": round(time.time() - t1, 2), "layers": per_layer,
                }
                points.append(point)
                log(f"  op L={length} {label:12s} {PARAM[method]}={value:<7g} density "
                    f"{point['density'] if point['density'] is None else round(point['density'], 3)} rel L1 "
                    f"{point['rel_l1']:.4f} MSE {point['mse']:.3e} ({point['seconds']} s)")
            curves[label] = points
        results[length] = {
            "document": d["paths"][0], "layers": len(layers),
            "floor": {"rel_l1": sum(f["abs_err"] for f in floor) / sum(f["abs_ref"] for f in floor),
                      "mse": sum(f["sq_err"] for f in floor) / sum(f["count"] for f in floor)},
            "curves": curves, "skipped": skipped,
        }
    return results
