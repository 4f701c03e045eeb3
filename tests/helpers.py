"""Test helpers: float64 references and error metrics, small configurations, and the attention core's test inputs,
plans and tolerances (``test_kernel*.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_compile.dense import dense_causal_attention
from sparse_compile.kernels.validate import expand_heads
from sparse_compile.plan import VISIBLE_NONE, block_visibility, execute_plan, plan_from_block_mask, reference_attention


def dense_reference(q, k, v, scale=None):
    """Dense causal attention in float64 (queries at the last positions), GQA native."""
    return dense_causal_attention(q.double(), k.double(), v.double(), scale=scale)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere gives inf, so it never passes."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def random_qkv(batch, heads_q, heads_kv, n_q, n_k, dim, dtype=torch.float32, device="cpu"):
    q = torch.randn(batch, heads_q, n_q, dim, dtype=dtype, device=device)
    k = torch.randn(batch, heads_kv, n_k, dim, dtype=dtype, device=device)
    v = torch.randn(batch, heads_kv, n_k, dim, dtype=dtype, device=device)
    return q, k, v


def op_spec(site: str, config, **flags) -> str:
    """The op's ``spec`` argument: a ``SiteSpec`` as the rewrite writes it (JSON)."""
    from sparse_compile.site import SiteSpec

    return SiteSpec(site, config, **flags).to_json()


#: small blocks and segments for every built-in method: their kernels and plans at test lengths (tens of tokens)
SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16},
             sampled={"block_size": 16, "sample_every": 4},
             antidiag={"block_size": 16, "score_stride": 4, "row_stride": 2},
             peak={"block_size": 16, "sample_every": 4})
SMALL_PBS = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})
BUILT_IN = ("pbs", "sparge", "bfla", "s2o", "sampled", "antidiag", "peak")


def causal_sdpa(q, k, v):
    """The attention every compiled test function runs: causal SDPA (is_causal=True)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def compile_small(fn, **options):
    """``fn`` compiled by the backend with ``SMALL`` and ``options``."""
    return torch.compile(fn, backend="sparse_prefill", options={**SMALL, **options})


def small_model(layers=2):
    """The tests' decoder (``models.py``), small: 64 tokens, 4 heads over 2 key/value heads."""
    from models import ModelArgs, Transformer

    return Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                                 intermediate_size=128)).eval()


# ---------------------------------------------------------------------- the attention core (test_kernel*.py)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _perm(batch, heads, n, device=DEV):
    return torch.stack([torch.randperm(n) for _ in range(batch * heads)]).view(batch, heads, n).to(torch.int32).to(device)


def _kernel(q, k, v, plan, scale=None, **options):
    """The Triton kernel on ``plan`` (through the package's adapter)."""
    return execute_plan(q, k, v, plan, scale, kernel="triton", **options)


def _ref(q, k, v, plan, scale=None):
    """Float64 execution of the same plan on the same (rounded) inputs."""
    return reference_attention(q.double(), k.double(), v.double(), plan, scale, return_visited=True)


def _sink_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, strength=1.5, device=DEV):
    """Inputs whose first 16 keys attract every query: early stop and P.V skip then trigger."""
    q, k, v = random_qkv(B, Hq, Hkv, Nq, Nk, D, device=device)
    c = torch.randn(D, device=device)
    c = c / c.norm() * math.sqrt(D)
    q, k = q + strength * c, k.clone()
    k[:, :, :16] += strength * c
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _stop_ratio(q, k, plan, b, h, i, t_stop, scale=None):
    """Float64 ``max_r g_r / l_r`` at tile ``t_stop`` of block (b, h, i): the early-stop decision there (the walk
    goes on iff it is >= tau). Same semantics as plan.py; used to tell a bf16 rounding flip at the threshold
    from a real disagreement."""
    Hq, Nq, D = q.shape[1], q.shape[2], q.shape[3]
    Nk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bm, bn = plan.block_m, plan.block_n
    ht = h // (Hq // plan.tile_offsets.shape[1])
    rows = torch.arange(i * bm, min((i + 1) * bm, Nq), device=q.device)
    if plan.query_index is not None:
        rows = plan.query_index[b, h // (Hq // plan.query_index.shape[1]), rows].long()
    qpos = rows + (Nk - Nq)
    qb = q[b, h, rows].double()
    kh = h // (Hq // k.shape[1])
    masked = int(plan.masked_counts[b, ht, i])
    m = torch.full((rows.numel(),), -math.inf, dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    ratio = math.inf
    for t in range(t_stop + 1):
        logical = int(plan.tile_offsets[b, ht, i, t]) + torch.arange(bn, device=q.device)
        if plan.key_index is None:
            phys = torch.where(logical < Nk, logical, -1)
        else:
            ki = plan.key_index[b, h // (Hq // plan.key_index.shape[1])].long()
            phys = torch.where(logical < ki.numel(), ki[logical.clamp(max=ki.numel() - 1)], -1)
        s = qb @ k[b, kh, phys.clamp(0, Nk - 1)].double().T * scale
        if t < masked:
            s = s.masked_fill(~((phys[None, :] >= 0) & (phys[None, :] < Nk) & (phys[None, :] <= qpos[:, None])), -math.inf)
        m_new = torch.maximum(m, s.amax(1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l_prev = torch.where(torch.isfinite(m), l * torch.exp(m - safe), torch.zeros_like(l))
        gain = torch.exp(s - safe[:, None]).sum(1)
        ratio = float((gain / l_prev).max())  # l_prev == 0: inf (the walk goes on)
        m, l = m_new, l_prev + gain
    return ratio


def _non_boundary_mismatches(q, k, plan, visited, ref_visited, rel=1e-3):
    """Blocks whose visited count differs from the reference for a reason other than a threshold flip: the
    disputed decision (after tile min(kernel, ref) - 1) must have a float64 ratio within ``rel`` of tau."""
    bad = []
    for b, h, i in (visited != ref_visited).nonzero().tolist():
        vk, vr = int(visited[b, h, i]), int(ref_visited[b, h, i])
        t = min(vk, vr) - 1
        ht = h // (q.shape[1] // plan.tile_offsets.shape[1])
        if t < int(plan.masked_counts[b, ht, i]):  # masked tiles never stop the walk: no threshold to flip
            bad.append(((b, h, i), vk, vr, None))
            continue
        r = _stop_ratio(q, k, plan, b, h, i, t)
        if not abs(r / plan.early_stop - 1.0) <= rel:
            bad.append(((b, h, i), vk, vr, r))
    return bad


def _assert_close(out, ref, dtype, what=""):
    err = rel_error(out, ref)
    assert err < TOL[dtype], f"{what} rel error {err:.3e} (tol {TOL[dtype]:.0e})"


gpu = pytest.mark.gpu


def _gpu_sparse_plan(B, H, Nq, Nk, bm, bn, density, **kw):
    vis = block_visibility(Nq, Nk, bm, bn, batch=B, heads=H, device="cuda",
                           key_index=kw.get("key_index"), query_index=kw.get("query_index"))
    if vis.shape[1] != H:
        vis = expand_heads(vis, H)
    keep = torch.rand(vis.shape, device="cuda") < density
    # keep every partial tile (the diagonal) so each row sees something, and the first (sink) tile
    keep |= vis == 1
    keep[..., 0] |= vis[..., 0] != VISIBLE_NONE
    return plan_from_block_mask(keep, vis, bm, bn, **kw)


def _segment_permutation(batch, heads, n, seg=256, device="cuda"):
    """Random order inside consecutive segments of ``seg`` positions (as PBS-Attn / S2O reorder), int32."""
    nseg = -(-n // seg)
    r = torch.rand(batch, heads, nseg, seg, device=device)
    r[..., -1, n - (nseg - 1) * seg:] = 2.0  # positions past n sort last in the last segment, then are cut
    idx = torch.argsort(r, -1) + torch.arange(nseg, device=device)[:, None] * seg
    return idx.flatten(2)[..., :n].to(torch.int32).contiguous()


def run_outside_the_checkout(code: str, *args: str, where, timeout: int) -> dict:
    """``python -c code *args`` in the directory ``where`` (outside the checkout, whose top-level ``kernels/``
    would shadow the ``kernels`` package), ``SPARSE_COMPILE_CONFIG`` unset; the JSON its last line prints. Skips
    where the ``kernels`` package is not installed."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from importlib import metadata

    from sparse_compile import serving

    if importlib.util.find_spec("kernels") is None:
        pytest.skip("the kernels package is not installed (pip install sparse_compile[serving])")
    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("the kernels package is not installed (pip install sparse_compile[serving]); the module "
                    "'kernels' found is this checkout's folder")
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    env.pop(serving.CONFIG_VARIABLE, None)
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
