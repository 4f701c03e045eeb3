"""Quality of the four sparse methods on real attention patterns: the small LM of ``train_small_lm.py``.

    PYTHONPATH=. python benchmarks/quality.py                        # GPU: checkpoint in benchmarks/checkpoints
    python benchmarks/quality.py --smoke --checkpoint /tmp/lm/small_lm.pt --out-dir /tmp/q   # CPU, seconds

(a) Language modelling: bits per byte of held-out long documents (8K, 16K, 32K-byte prompts, never trained on)
    with dense attention and with each method at its defaults and along a sweep of the parameter that controls
    its density (pbs ``threshold``, sparge ``cdf_threshold``, bfla ``mass_threshold``, s2o ``early_stop``). It runs
    what a user runs: ``torch.compile(model, backend="sparse_prefill", options=...)`` once, then
    ``sparse_compile.sparsity(method=..., **params)`` per setting (no recompile); the achieved density is the
    backend's own record (``record_density``, ``runtime_stats()``): the fraction of causal tiles each site computed.
(b) Operator level (the comparison of the S2O paper's Fig. 5a): Q/K/V of every layer are captured on long held-out
    inputs (a wrapper around SDPA), each method's threshold is swept through ``sparse_compile.sparse_attention``
    and its output compared with float32 dense attention: relative L1 (sum|O - O'| / sum|O|) and MSE against
    density; the error at matched densities 0.1 / 0.2 / 0.3 is interpolated along each curve (log error, linear in
    density; "-" where a method's curve does not reach that density).

Writes ``quality.json`` (everything, per layer too), ``quality.md`` (the tables) and ``quality.png`` (if matplotlib
is installed) under ``--out-dir`` (default ``benchmarks/results``). A global ``--time-budget`` bounds the run: a
setting that would start after its section's deadline is skipped and listed as such.

The held-out documents are the long held-out files listed in the checkpoint's manifest, re-read from this machine
and checked against their recorded sha1: run this on the machine image the model was trained on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import train_small_lm as tsl  # noqa: E402

import sparse_compile  # noqa: E402
from sparse_compile import SparseConfig, sparsity  # noqa: E402

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
    return {"bfla": {"score_scale": 1.0 / (SparseConfig().bfla.group_size * math.sqrt(head_dim))}}


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
MATCHED_DENSITIES = (0.1, 0.2, 0.3)
# smoke runs use short prompts: small blocks and segments so that they still span many of them
SMOKE_OPTIONS = {
    "pbs": {"block_size": 32, "segment_size": 64},
    "sparge": {"block_size_q": 32, "block_size_kv": 32},
    "bfla": {"coarse_block_size": 64, "group_size": 16, "tile_size_q": 32, "tile_size_kv": 32, "local_tiles": 1,
             "stride": 4},
    "s2o": {"segment_size": 128, "block_size_q": 32, "block_size_kv": 32},
}
LN2 = math.log(2.0)


def default_value(method: str) -> float:
    return getattr(getattr(SparseConfig(), method), PARAM[method])


def sweep_with_default(values: list[float], method: str) -> list[float]:
    d = default_value(method)
    return values if any(math.isclose(v, d) for v in values) else sorted(values + [d])


def ensure_source_checkout_imports() -> None:
    """Make ``sparse_compile.kernels`` importable from a source checkout that is on PYTHONPATH but not installed.

    pip installs the top-level ``kernels/`` folder as ``sparse_compile.kernels`` (pyproject's package-dir); a bare
    checkout (the GPU machine runs one with PYTHONPATH=.) has it only as ``kernels``. Aliasing it keeps the Triton
    path usable there; an installed package is left alone.
    """
    try:
        import sparse_compile.kernels  # noqa: F401
    except ModuleNotFoundError:
        import importlib

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        module = importlib.import_module("kernels")
        sys.modules["sparse_compile.kernels"] = module
        sparse_compile.kernels = module


def cpu_planner(device) -> dict:
    """On the CPU, plans come from the PyTorch reference stages: the "auto" planner would pick the Triton stages
    whenever TRITON_INTERPRET=1 is set (as the test suite sets it), and interpreted they take minutes, not
    seconds. On the GPU the default ("auto": the Triton planner) is what users get and is left alone."""
    if torch.device(device).type == "cuda" or "planner" not in SparseConfig.field_names():
        return {}
    return {"planner": "reference"}


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


# --- kernel choice ----------------------------------------------------------------------------------------------
def choose_kernels(requested: str, device, base: dict, notes: list) -> dict:
    """Per method: the Triton kernel where it runs and matches the PyTorch reference, else the reference.

    On the GPU a short check (keep-everything setting, which must equal the reference to bf16 rounding, and the
    defaults, which must run and be finite) guards against a kernel under construction; the outcome is noted.
    """
    if requested != "auto" or torch.device(device).type != "cuda":
        return {m: (requested if requested != "auto" else "reference") for m in METHODS}
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 4, 2048, 64, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, 2048, 64, device=device, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 2, 2048, 64, device=device, generator=gen).to(torch.bfloat16)
    out = {}
    for m in METHODS:
        try:
            results = {}
            for kernel in ("triton", "reference"):
                cfg = method_config(m, None, base, kernel=kernel, min_seq_len=1024).keep_all()
                results[kernel] = sparse_compile.sparse_attention(q, k, v, config=cfg).float()
            err = float((results["triton"] - results["reference"]).abs().sum() / results["reference"].abs().sum())
            o = sparse_compile.sparse_attention(q, k, v, config=method_config(m, None, base, kernel="triton",
                                                                               min_seq_len=1024))
            ok = err < 2e-2 and bool(torch.isfinite(o).all())
            path = sparse_compile.runtime_stats()["sparse_attention"].last_reason
            out[m] = "triton" if ok else "reference"
            notes.append(f"kernel check {m}: triton vs reference keep-all rel L1 {err:.2e}, defaults finite "
                         f"{bool(torch.isfinite(o).all())} ({path}) -> {out[m]}")
        except Exception as exc:  # noqa: BLE001 - a failing kernel falls back, and the note says why
            out[m] = "reference"
            notes.append(f"kernel check {m}: triton failed ({type(exc).__name__}: {str(exc)[:200]}) -> reference")
    return out


# --- documents ------------------------------------------------------------------------------------------------
def load_documents(manifest: dict, lengths: list[int], counts: list[int], verify: bool) -> dict[int, dict]:
    """For each prompt length L: ``count`` distinct held-out files of >= L bytes, their first L bytes."""
    docs, used = {}, set()
    for length, count in sorted(zip(lengths, counts), reverse=True):  # the scarce long files first
        entries = tsl.heldout_documents(manifest, length, count, exclude=used, verify=verify)
        used.update(e["path"] for e in entries)
        tokens = torch.stack([torch.frombuffer(bytearray(e["data"][:length]), dtype=torch.uint8) for e in entries])
        docs[length] = {"paths": [e["path"] for e in entries], "tokens": tokens.long()}
    return docs


# --- (a) bits per byte through the compiled backend ---------------------------------------------------------------
def bits_per_byte(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document: mean bits per predicted byte, over all positions and over the second half."""
    B, L = tokens.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                         reduction="none").view(B, L - 1) / LN2
    return ce.mean(1), ce[:, L // 2:].mean(1)


@contextlib.contextmanager
def sdpa_routed_to_sparse(base_config: SparseConfig):
    """Eager alternative to the compiled backend: causal SDPA calls go through ``sparse_attention``."""
    orig = F.scaled_dot_product_attention
    inside = []  # sparse_attention's own dense path calls SDPA again: that call must reach the real one

    def routed(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if is_causal and attn_mask is None and dropout_p == 0.0 and not inside:
            inside.append(True)
            try:
                return sparse_compile.sparse_attention(q, k, v, scale=scale, config=base_config)
            finally:
                inside.pop()
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig


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
@contextlib.contextmanager
def capture_attention_inputs(store: list):
    """Record (q, k, v, scale) of every SDPA call of an eager forward (the attention inputs after RoPE)."""
    orig = F.scaled_dot_product_attention

    def capture(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        store.append({"q": q.detach(), "k": k.detach(), "v": v.detach(), "scale": scale, "causal": is_causal,
                      "mask": attn_mask is not None})
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = capture
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig


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


def at_density(points: list, target: float, key: str) -> Optional[float]:
    """``key`` interpolated at ``target`` density along the curve (log-linear; linear if a value is 0)."""
    pts = sorted((p["density"], p[key]) for p in points
                 if p.get("density") is not None and p.get(key) is not None and math.isfinite(p[key]))
    for (d0, e0), (d1, e1) in zip(pts, pts[1:]):
        if d0 <= target <= d1:
            if d1 == d0:
                return min(e0, e1)
            w = (target - d0) / (d1 - d0)
            if e0 > 0 and e1 > 0:
                return math.exp((1 - w) * math.log(e0) + w * math.log(e1))
            return (1 - w) * e0 + w * e1
    if pts and len(pts) == 1 and math.isclose(pts[0][0], target):
        return pts[0][1]
    return None


# --- reporting ----------------------------------------------------------------------------------------------------
def tables(result: dict) -> str:
    parts = []
    ppl = result.get("ppl")
    if ppl:
        rows = [{"L": r["length"], "method": r["method"], "param": f"{r['param']}={r['value']:g}" if r["value"] is not None
                 else "-", "default": "*" if r["default"] else "", "density": r["density"], "bpb": r["bpb"],
                 "Δbpb": r["delta_bpb"], "Δbpb 2nd half": r["delta_2nd_half"],
                 "sparse sites": f"{r['sparse_sites']}/{r['sites']}"} for r in ppl["rows"]]
        parts.append(f"### (a) bits per byte on held-out documents ({ppl['mode']} backend; * = method default)\n\n"
                     + harness.format_table(rows, digits=4))
        matched = []
        lengths = sorted({r["length"] for r in ppl["rows"]})
        for length in lengths:
            for m in dict.fromkeys(r["method"] for r in ppl["rows"] if r["method"] != "dense"):
                pts = [r for r in ppl["rows"] if r["length"] == length and r["method"] == m]
                row = {"L": length, "method": m}
                for t in MATCHED_DENSITIES:
                    row[f"Δbpb @ {t}"] = at_density(pts, t, "delta_bpb_pos")
                matched.append(row)
        parts.append("### (a') Δbpb interpolated at matched density\n\n" + harness.format_table(matched, digits=4))
    op = result.get("operator")
    if op:
        for length, res in sorted(op.items(), key=lambda kv: int(kv[0])):
            rows = []
            for label, method, _ in OP_CURVES:
                if label not in res["curves"]:
                    continue
                pts = res["curves"][label]
                row = {"curve": label, "swept": PARAM[method]}
                for t in MATCHED_DENSITIES:
                    row[f"rel L1 @ {t}"] = at_density(pts, t, "rel_l1")
                for t in MATCHED_DENSITIES:
                    row[f"MSE @ {t}"] = at_density(pts, t, "mse")
                dens = [p["density"] for p in pts if p["density"] is not None]
                row["density range"] = f"{min(dens):.3f}-{max(dens):.3f}" if dens else "-"
                d = next((p for p in pts if p["default"]), None)
                row["default: density / rel L1"] = (f"{d['density']:.3f} / {d['rel_l1']:.4f}"
                                                    if d and d["density"] is not None else "-")
                rows.append(row)
            parts.append(f"### (b) operator error at matched density, L={length}, {res['layers']} layers "
                         f"(dense bf16 floor: rel L1 {res['floor']['rel_l1']:.2e}, MSE {res['floor']['mse']:.2e})\n\n"
                         + harness.format_table(rows, digits=4))
    return "\n\n".join(parts)


def plot(result: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    colors = {"pbs": "tab:red", "sparge": "tab:blue", "bfla": "tab:green", "s2o": "tab:purple",
              "pbs w/o perm": "salmon", "sparge θ=0": "lightskyblue", BFLA_BLOCK_SCALE: "darkseagreen"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    op = result.get("operator") or {}
    styles = ["-", "--", ":", "-."]
    for li, (length, res) in enumerate(sorted(op.items(), key=lambda kv: -int(kv[0]))):
        for m in res["curves"]:
            pts = sorted((p for p in res["curves"].get(m, []) if p["density"] is not None), key=lambda p: p["density"])
            if not pts:
                continue
            for ax, key in ((axes[0], "rel_l1"), (axes[1], "mse")):
                ax.plot([p["density"] for p in pts], [max(p[key], 1e-12) for p in pts], styles[li % 4], marker="o",
                        ms=3, color=colors.get(m, "grey"), label=f"{m} L={length}")
                dflt = [p for p in pts if p["default"]]
                if dflt:
                    ax.plot([dflt[0]["density"]], [max(dflt[0][key], 1e-12)], "*", ms=11, color=colors.get(m, "grey"))
    for ax, name in ((axes[0], "relative L1  Σ|O−O'|/Σ|O|"), (axes[1], "MSE")):
        ax.set_yscale("log")
        ax.set_xlabel("density (fraction of causal tiles computed)")
        ax.set_ylabel(name)
        ax.set_title(f"operator error vs density, all layers (★ = default)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    ppl = result.get("ppl")
    if ppl:
        lengths = sorted({r["length"] for r in ppl["rows"]})
        for li, length in enumerate(lengths):
            for m in dict.fromkeys(r["method"] for r in ppl["rows"] if r["method"] != "dense"):
                pts = sorted((r for r in ppl["rows"] if r["length"] == length and r["method"] == m
                              and r["density"] is not None), key=lambda r: r["density"])
                if pts:
                    axes[2].plot([r["density"] for r in pts], [r["delta_bpb"] for r in pts],
                                 styles[li % 4], marker="o", ms=3, color=colors.get(m, "grey"), label=f"{m} L={length}")
        axes[2].set_yscale("symlog", linthresh=1e-3)  # deltas can be slightly negative; small ones stay visible
        axes[2].set_xlabel("density (backend record)")
        axes[2].set_ylabel("Δ bits per byte vs dense")
        axes[2].set_title(f"held-out bits per byte ({ppl['mode']} path)", fontsize=9)
        axes[2].grid(alpha=0.3, which="both")
        if axes[2].get_legend_handles_labels()[0]:
            axes[2].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=tsl.DEFAULT_CHECKPOINT)
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    parser.add_argument("--name", default="quality")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: short prompts, small blocks, two values")
    parser.add_argument("--device", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths for (a)")
    parser.add_argument("--docs", type=int, nargs="+", default=None, help="documents per length for (a)")
    parser.add_argument("--op-lengths", type=int, nargs="+", default=None, help="input lengths for (b)")
    parser.add_argument("--sections", default="ppl,operator")
    parser.add_argument("--curves", default=None,
                        help="comma-separated curve labels to run (default all: " +
                             ", ".join(dict.fromkeys(c[0] for c in OP_CURVES + PPL_CURVES)) + ")")
    parser.add_argument("--attention", choices=("compiled", "hook"), default="compiled",
                        help="(a) through torch.compile(backend='sparse_prefill') or an SDPA hook (eager)")
    parser.add_argument("--kernel", choices=("auto", "triton", "reference"), default="auto")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds for (a) and (b) together")
    parser.add_argument("--ppl-share", type=float, default=0.5, help="share of the budget (a) may use")
    parser.add_argument("--no-verify", action="store_true", help="skip missing/changed held-out files")
    parser.add_argument("--local-heldout", action="store_true",
                        help="use THIS machine's held-out split (CPU trials of a checkpoint trained elsewhere)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    smoke = args.smoke
    lengths = args.lengths or ([512] if smoke else [8192, 16384, 32768])
    counts = args.docs or ([2] if smoke else [4, 2, 2])
    if len(counts) == 1:
        counts = counts * len(lengths)
    op_lengths = args.op_lengths or ([512] if smoke else [16384, 32768])
    sweeps_ppl = SMOKE_SWEEP if smoke else PPL_SWEEP
    sweeps_op = SMOKE_SWEEP if smoke else OP_SWEEP
    base = {"min_seq_len": 256 if smoke else 1024}
    base.update(cpu_planner(device))
    if smoke:
        base.update({m: dict(v) for m, v in SMOKE_OPTIONS.items()})
    sections = set(args.sections.split(","))
    wanted = None if args.curves is None else {c.strip() for c in args.curves.split(",")}
    known = {c[0] for c in OP_CURVES + PPL_CURVES}
    if wanted is not None and wanted - known:
        parser.error(f"--curves: unknown {sorted(wanted - known)}; known: {sorted(known)}")
    ppl_curves = tuple(c for c in PPL_CURVES if wanted is None or c[0] in wanted)
    op_curves = tuple(c for c in OP_CURVES if wanted is None or c[0] in wanted)
    deadline = Deadline(args.time_budget)
    notes: list[str] = []

    def log(msg):
        print(msg, flush=True)

    ensure_source_checkout_imports()
    model, ckpt = tsl.load_checkpoint(args.checkpoint, device, dtype)
    manifest = tsl.build_corpus(0).manifest if args.local_heldout else ckpt_manifest(args.checkpoint)
    if args.local_heldout:
        notes.append("held-out documents from this machine's split (--local-heldout), not the recorded manifest")
    kernels = choose_kernels(args.kernel, device, base, notes)
    for n in notes:
        log(n)
    result = {"checkpoint": str(args.checkpoint.name), "model_args": ckpt["model_args"], "device": str(device),
              "dtype": str(dtype), "env": harness.env_info(), "base_options": base, "kernels": kernels,
              "notes": notes, "param": PARAM, "matched_densities": MATCHED_DENSITIES}
    torch.manual_seed(0)

    if "ppl" in sections:
        docs = load_documents(manifest, lengths, counts, verify=not args.no_verify)
        result["ppl_documents"] = {str(L): d["paths"] for L, d in docs.items()}
        log(f"(a) bits per byte: lengths {lengths}, documents {counts}, {args.attention} path")
        result["ppl"] = run_ppl(model, docs, base, kernels, sweeps_ppl, args.attention,
                                deadline.at(args.ppl_share), device, log, notes, curves=ppl_curves,
                                head_dim=ckpt["model_args"]["dim"] // ckpt["model_args"]["n_heads"])
        for r in result["ppl"]["rows"]:  # for interpolation on a log scale: gains (negative deltas) count as 0
            r["delta_bpb_pos"] = max(r["delta_bpb"], 0.0)
    if "operator" in sections:
        op_docs = load_documents(manifest, op_lengths, [1] * len(op_lengths), verify=not args.no_verify)
        log(f"(b) operator level: lengths {op_lengths}")
        op = run_operator(model, op_docs, base, kernels, sweeps_op, deadline.end, device, log, curves_to_run=op_curves)
        result["operator"] = {str(k): v for k, v in op.items()}
    result["seconds"] = round(time.time() - deadline.t0, 1)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = tables(result)
    note = plot(result, args.out_dir / f"{args.name}.png")
    if note:
        notes.append(note)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    header = (f"# Sparse attention quality on a trained byte-level LM ({ckpt['model_args']})\n\n"
              f"device {result['env'].get('gpu', 'cpu')}, {dtype}; kernels {kernels}; {result['seconds']} s\n\n"
              + "".join(f"- {n}\n" for n in notes))
    (args.out_dir / f"{args.name}.md").write_text(header + "\n" + text + "\n")
    print(text)
    return result


def ckpt_manifest(path: Path) -> dict:
    """The data manifest recorded next to the checkpoint (``<name>.json``)."""
    return json.loads(path.with_suffix(".json").read_text())["manifest"]


if __name__ == "__main__":
    main()
