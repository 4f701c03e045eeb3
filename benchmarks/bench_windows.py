"""Sliding-window layers on the package's kernels: one layer against its band's ideal and FlexAttention, and whole
models whose layers are mostly windows.

``--part layer``: one attention call of a window layer, (B=1, Hq, N, D) bf16, causal AND a window of W keys:

* ``band`` (``sparse_attention(q, k, v, window=W)``: the exact band plan on the kernels),
* ``causal keep-all`` (the same kernels over every causal tile, density 1: the kernel's efficiency),
* ``ideal`` = ``causal keep-all`` × (the band's tiles / the causal tiles): the band's FLOPs at that efficiency,
* ``flex`` (``flex_attention`` compiled, with the sliding-window ``BlockMask``), ``sdpa masked`` (SDPA with the
  band as an explicit bool mask, what transformers' SDPA path runs; skipped past ``--mask-limit`` tokens).

``--part sweep``: one window layer on the Triton kernel under each launch configuration of ``SWEEP`` (tile sizes,
warps, pipeline stages) against the causal keep-all plan on each backend and SDPA's causal kernel, ``vs_ideal``
against the faster keep-all.

``--part model``: whole-model time to first token, random bf16 weights, batch 1, for a Gemma-3-4B-shaped model (34
layers, window 1,024, five local layers per global one, 8 query / 4 KV heads, head dim 256) and a Mistral-7B-shaped
one (window 4,096): ``torch.compile`` with ``backend="sparse_prefill"`` at the default configuration against the
dense compiled model (Inductor, transformers' SDPA path: its masked layers run SDPA with an explicit mask; the SDPA
kernel that takes them is recorded) and against the model on ``attn_implementation="flex_attention"`` compiled. Every
row has the sparse and dense call counts of one forward and the mean density (``record_density``).

Contenders alternate in one loop (``harness.alternating_samples``); rows go to ``benchmarks/results/bench_windows.jsonl``
with ``--store``.

    python benchmarks/bench_windows.py --part layer --lengths 32768 131072 --store     # GPU
    python benchmarks/bench_windows.py --part model --lengths 32768 131072 --store     # GPU
    python benchmarks/bench_windows.py --smoke                                         # CPU, toy sizes
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sparse_compile  # noqa: E402
from e2e_model import calls_by_path, mean_density, sync  # noqa: E402
from harness import alternating_samples, write_results  # noqa: E402

from sparse_compile import SparseConfig  # noqa: E402
from sparse_compile.local import Local  # noqa: E402

SHAPES = {  # the attention and model shapes of the configs named
    "gemma3-4b": dict(family="gemma3", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                      vocab_size=262208, global_every=6),
    "mistral-7b": dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
                       vocab_size=32000),
}
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=128)


def band_share(n: int, window: int, block: int = 128) -> float:
    """The band's tiles over the causal tiles at ``block`` x ``block`` tiles (what density reports)."""
    blocks = -(-n // block)
    i = torch.arange(blocks)[:, None]
    j = torch.arange(blocks)[None, :]
    causal = j <= i
    # a tile meets the band where its last key is within W of its first query
    band = causal & ((i * block) - ((j + 1) * block - 1) < window)
    return float(band.sum() / causal.sum())


def flex_window(window: int, n: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(sliding, None, None, n, n, device=device, _compile=True)  # no N x N mask at long N


def layer_rows(args, device, dtype, rows: list) -> None:
    flex = None
    if device == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    for name in args.shapes:
        shape = SHAPES[name]
        hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        window = args.window or shape["sliding_window"]
        if args.smoke:
            hq, hkv, d, window = 4, 2, 16, 40
        for n in args.lengths:
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(1, hq, n, d, device=device, dtype=dtype, generator=gen)
            k = torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=gen)
            v = torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=gen)
            keep_all = SparseConfig(method="pbs", min_seq_len=2, dense_when_faster=False).keep_all()  # density 1
            contenders = {
                "band": lambda: sparse_compile.sparse_attention(q, k, v, window=window),
                "causal keep-all": lambda: sparse_compile.sparse_attention(q, k, v, config=keep_all),
            }
            if flex is not None:
                block_mask = flex_window(window, n, device)
                contenders["flex"] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
            if n <= args.mask_limit:
                mask = Local(window=window).visible(torch.arange(n, device=device), torch.arange(n, device=device))
                contenders["sdpa masked"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                     enable_gqa=True)
            with torch.no_grad():
                reference = contenders["sdpa masked"]() if "sdpa masked" in contenders else None
                out = contenders["band"]()
                error = None if reference is None else float((out.float() - reference.float()).abs().max())
                sparse_compile.reset_runtime_stats()
                contenders["band"]()
                stats = sparse_compile.runtime_stats().get("sparse_attention")
                path = None if stats is None else stats.last_path
                samples = alternating_samples(contenders, args.reps, warmup=2)
            share = band_share(n, window)
            ms = {label: statistics.median(t) for label, t in samples.items()}
            ms["ideal"] = ms["causal keep-all"] * share
            for label, value in ms.items():
                rows.append(dict(part="layer", shape=name, length=n, window=window, contender=label, ms=value,
                                 band_share=share, vs_ideal=ms["ideal"] / value if value else None,
                                 band_path=path, max_error_vs_sdpa=error if label == "band" else None))


SWEEP = [  # (plan tile, kernel block_m, block_n, warps, stages): the band's launch candidates
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 2), (128, 128, 64, 8, 2), (128, 128, 64, 4, 2), (128, 64, 64, 4, 2),
    (128, 64, 64, 4, 3), (128, 64, 128, 4, 2), (64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (128, 128, 32, 8, 2),
]


def sweep_rows(args, device, dtype, rows: list) -> None:
    """One window layer on the Triton kernel under each of ``SWEEP``'s launch configurations, against the causal
    keep-all plan on each backend: where the band's time per tile goes."""
    from sparse_compile.kernels import KernelConfig, block_sparse_attention
    from sparse_compile.kernels import attention as kernel_module
    from sparse_compile.plan import local_plan

    for name in args.shapes:
        shape = SHAPES[name]
        hq, hkv, d, window = (4, 2, 16, 40) if args.smoke else (
            shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
            args.window or shape["sliding_window"])
        for n in args.lengths:
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, h, n, d, device=device, dtype=dtype, generator=gen) for h in (hq, hkv, hkv))
            contenders, backends = {}, {}
            if device == "cuda":  # the fastest dense causal kernel PyTorch picks: the keep-all plan's yardstick
                contenders["sdpa causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                   enable_gqa=True)
            for backend in ("triton", "auto"):
                full = local_plan(1, hq, n, n, 128, 128, device=device)

                def keep_all(full=full, backend=backend):
                    return block_sparse_attention(q, k, v, full.tile_offsets, full.tile_counts, full.masked_counts,
                                                  block_m=128, block_n=128, backend=backend)
                contenders[f"causal keep-all ({backend})"] = keep_all
            if d > 128:  # the D=256 default before the sweep chose 128x64 with 8 warps
                full = local_plan(1, hq, n, n, 128, 128, device=device)
                contenders["causal keep-all (triton) 64x64 w4 s2"] = lambda full=full: block_sparse_attention(
                    q, k, v, full.tile_offsets, full.tile_counts, full.masked_counts, block_m=128, block_n=128,
                    config=KernelConfig(64, 64, num_warps=4, num_stages=2), backend="triton")
            # the band as users call it (plan built per call, the rules, dispatch): its cost over the bare launch
            contenders["band: sparse_attention(window=)"] = lambda: sparse_compile.sparse_attention(q, k, v,
                                                                                                  window=window)
            for tile, bm, bn, warps, stages in ([(64, 64, 64, 4, 1)] if args.smoke else SWEEP):
                band = local_plan(1, hq, n, n, tile, tile, device=device, window=window)
                config = KernelConfig(bm, bn, num_warps=warps, num_stages=stages)

                def run(band=band, config=config, tile=tile):
                    return block_sparse_attention(q, k, v, band.tile_offsets, band.tile_counts, band.masked_counts,
                                                  block_m=tile, block_n=tile, window=window, config=config,
                                                  backend="triton")
                contenders[f"band {tile}: {bm}x{bn} w{warps} s{stages}"] = run
            with torch.no_grad():
                for label, fn in list(contenders.items()):
                    try:
                        fn()
                        backends[label] = kernel_module.last_backend
                    except Exception as exc:  # a configuration that does not compile (shared memory): a row says so
                        print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)
                        del contenders[label]
                samples = alternating_samples(contenders, args.reps, warmup=2)
            ms = {label: statistics.median(t) for label, t in samples.items()}
            share = band_share(n, window)
            ideal = min(ms[c] for c in ms if c.startswith("causal keep-all")) * share
            for label, value in ms.items():
                rows.append(dict(part="sweep", shape=name, length=n, window=window, contender=label, ms=value,
                                 band_share=share, vs_ideal=ideal / value, backend=backends.get(label)))


def build(name: str, smoke: bool, device, dtype, implementation: str = "sdpa", layers=None):
    import transformers

    shape = dict(SHAPES[name])
    family, every = shape.pop("family"), shape.pop("global_every", None)
    if smoke:
        shape.update(TOY, sliding_window=40)
    if layers:  # fewer decoder layers, the same local / global pattern: a shorter compile
        shape["num_hidden_layers"] = layers
    layers = shape["num_hidden_layers"]
    if family == "gemma3":
        kinds = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
        config = transformers.Gemma3TextConfig(layer_types=kinds, max_position_embeddings=131072, **shape)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.MistralConfig(max_position_embeddings=131072, **shape)
        cls = transformers.MistralForCausalLM
    config._attn_implementation = implementation
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)


def model_rows(args, device, dtype, rows: list) -> None:
    options = dict(record_density=True)
    if args.smoke:
        options.update(method="pbs", min_seq_len=16, pbs={"block_size": 16, "segment_size": 32})
    config = SparseConfig(**options)
    for name in args.shapes:
        model = build(name, args.smoke, device, dtype, layers=args.layers)
        flex_model = build(name, args.smoke, device, dtype, "flex_attention", args.layers) if device == "cuda" else None
        if flex_model is not None:
            flex_model.load_state_dict(model.state_dict())
        contenders = {
            "sparse_prefill": torch.compile(model, backend="sparse_prefill", options=config),
            "inductor (sdpa)": torch.compile(model),
        }
        if flex_model is not None:
            contenders["inductor (flex_attention)"] = torch.compile(flex_model)
        for n in args.lengths:
            ids = torch.randint(1, model.config.vocab_size, (1, n), device=device)
            counts = {}
            with torch.no_grad():
                for label, fn in contenders.items():  # compile, then one counted forward each
                    started = time.perf_counter()
                    fn(ids, logits_to_keep=1)
                    sync()
                    print(f"{name} {n}: {label} compiled and ran in {time.perf_counter() - started:.1f} s",
                          file=sys.stderr, flush=True)
                    sparse_compile.reset_runtime_stats()
                    fn(ids, logits_to_keep=1)
                    sync()
                    counts[label] = (calls_by_path(), mean_density())
                samples = alternating_samples({k: (lambda f=f: f(ids, logits_to_keep=1)) for k, f in contenders.items()},
                                              args.reps, warmup=1)
            dense = statistics.median(samples["inductor (sdpa)"])
            for label, times in samples.items():
                calls, density = counts[label]
                rows.append(dict(part="model", shape=name, length=n, contender=label,
                                 ttft_ms=statistics.median(times), speedup_vs_inductor=dense / statistics.median(times),
                                 sparse_calls=calls["sparse"], dense_calls=calls["dense"], density=density,
                                 layers=model.config.num_hidden_layers))
        del model, flex_model, contenders
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("layer", "model", "both", "sweep"), default="both")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--window", type=int, default=None, help="layer part: override the shape's window")
    parser.add_argument("--mask-limit", type=int, default=32768, help="layer part: longest SDPA-with-mask run")
    parser.add_argument("--layers", type=int, default=None, help="model part: decoder layers (default: the shape's)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU, for testing the script")
    parser.add_argument("--out", default=None)
    parser.add_argument("--store", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        args.lengths, args.reps = [200], 1
    rows = []  # filled as each row is measured: a run stopped early (SIGTERM, an error) still writes what it has
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    try:
        if args.part in ("layer", "both"):
            layer_rows(args, device, dtype, rows)
        if args.part in ("model", "both"):
            model_rows(args, device, dtype, rows)
        if args.part == "sweep":
            sweep_rows(args, device, dtype, rows)
    finally:
        write(args, device, dtype, rows)


def write(args, device, dtype, rows: list) -> None:
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype=str(dtype),
                sdpa_backends=None if device != "cuda" else "cuDNN / flash / efficient as PyTorch picks")
    print(write_results("bench_windows", rows, meta=meta, out_dir=args.out,
                        store="bench_windows" if args.store else None,
                        params=("part", "shape", "length", "contender")))


if __name__ == "__main__":
    main()
