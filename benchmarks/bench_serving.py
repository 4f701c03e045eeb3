"""Serving-shaped prefill: continuous batching of many long requests, and one long prompt prefilled in fixed
chunks over a growing cache against one call.

Servers prefill long prompts in chunks (vLLM, SGLang and transformers' continuous batching all cap the tokens per
step); each chunk's queries then attend to the whole prefix. This benchmark times, on the Llama-3.1-8B shape
(random weights, ``e2e_model.build_model``) and through the front door (``enable_transformers_attention``):

* ``dense one call`` / ``sparse one call``: the whole prompt in one forward (``logits_to_keep=1``);
* ``dense chunked`` / ``sparse chunked``: ``--chunk`` tokens per forward over one ``DynamicCache``;
* ``sparse chunked, static cache``: the same over a ``StaticCache`` (preallocated, written in place: no
  concatenation, as a server's paged cache);
* ``cache updates``: the chunked forwards' ``DynamicCache`` updates alone (it concatenates: a cost of chunking
  itself, dense and sparse alike).

``--scenario batching``: ``--requests`` prompts with lengths drawn from ``--prompt-range`` (seeded), served by
transformers' continuous batching (``generate_batch``, one new token each) with the package's kernel route
(``sparse_compile.serving_attention``; needs the ``kernels`` package and a transformers that accepts it) against
the same model on ``--dense`` (``sdpa``: transformers' paged SDPA; ``keep_all``: the same route at keep-all, dense
attention through the same kernels). Per request: TTFT (first token's timestamp minus the request's creation);
per run: prefill tokens per second, sparse and dense call counts, density. ``--scenario varlen``: one packed
step's attention, the packed launch against the per-sequence loop (``varlen``).

Contenders alternate in one loop (``harness.alternating_samples``); every row carries the sparse and dense call
counts the run made (``runtime_stats()``, per forward pass of the whole prompt) and the mean density of the sparse
calls (``record_density``). Rows go to the store ``benchmarks/results/bench_serving.jsonl`` with ``--store``.

    python benchmarks/bench_serving.py --lengths 131072 --chunk 8192 --store      # GPU
    python benchmarks/bench_serving.py --scenario batching --requests 32 --store  # GPU
    python benchmarks/bench_serving.py --smoke                                    # CPU, toy sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sparse_compile  # noqa: E402
from e2e_model import build_model, calls_by_path, mean_density, sync, with_attention  # noqa: E402
from harness import alternating_samples, write_results  # noqa: E402

from sparse_compile import SparseConfig  # noqa: E402


def chunked(model, ids, chunk: int, static: bool = False):
    """Prefill ``ids`` in ``chunk``-token forwards over one cache (a ``DynamicCache``, which concatenates each chunk's
    keys and values onto the cache, or with ``static`` a ``StaticCache`` of the prompt's length, written in place as
    a server's preallocated cache is); the last chunk's last logits."""
    import transformers

    if static:
        cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1])
    else:
        cache = transformers.DynamicCache()
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits


def profile(runs: dict, out: Path, tag: str) -> None:
    """One profiled run of each of ``runs`` (label: a callable without arguments): its kernels by total device
    time, to ``out/profile_<label>_<tag>.txt``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    for label, fn in runs.items():
        with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        (out / f"profile_{label.replace(' ', '_')}_{tag}.txt").write_text(table)


def cache_updates(model, ids, chunk: int):
    """The chunked prefill's ``DynamicCache`` updates alone (each chunk's keys and values appended in every layer,
    which concatenates the growing cache): a cost of the chunked contenders, dense and sparse alike, that one call
    does not pay."""
    import transformers

    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # in the model's layout: projected as (B, N, H, D) and transposed, which the concatenation copies slower
    part = torch.randn(1, chunk, cfg.num_key_value_heads, dim, device=ids.device, dtype=model.dtype).transpose(1, 2)
    cache = transformers.DynamicCache()
    for start in range(0, ids.shape[1], chunk):
        n = min(chunk, ids.shape[1] - start)
        for layer in range(cfg.num_hidden_layers):
            cache.update(part[:, :, :n], part[:, :, :n], layer)
    return cache


def one_call(model, ids):
    return model(ids, use_cache=False, logits_to_keep=1).logits


def serve_batch(model, prompts, cb_config) -> tuple[dict, float]:
    """One ``generate_batch`` of ``prompts`` (one new token each): (prompt length, TTFT in s) per request, and the
    wall time (s)."""
    import time

    import transformers

    steps = transformers.GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0)
    sync()
    started = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=cb_config,
                               record_timestamps=True)
    sync()
    wall = time.perf_counter() - started
    ttft = {rid: (len(o.prompt_ids), (o.timestamps[0] if o.timestamps else o.lifespan[1]) - o.created_time)
            for rid, o in out.items()}
    return ttft, wall


def hold(model, config) -> str:
    """The front door's name, with ``config`` held by the model and its attention left on ``"sdpa"`` (each
    contender switches it per call: ``with_attention``)."""
    sparse_compile.enable_transformers_attention(model, config)
    name = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    return name


def attend_with(model, held) -> None:
    """The model on the kernel route with ``held`` (a SparseConfig), or on transformers' paged SDPA (None)."""
    if held is None:
        model.set_attn_implementation("sdpa")
    else:
        sparse_compile.serving_attention(model, held)


def batching(args, model, config, device) -> list:
    import random

    import transformers

    rng = random.Random(0)
    low, high = args.prompt_range
    lengths = [rng.randint(low, high) for _ in range(args.requests)]
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(n)] for n in lengths]
    cb = dict(max_batch_tokens=args.max_batch_tokens, auto_switch_to_flash=False, use_cuda_graph=False)
    if args.smoke:
        cb.update(num_blocks=64)
    cb_config = transformers.ContinuousBatchingConfig(**cb)
    # timed without record_density (a host sync per call); one untimed run of every request with it first: the
    # density, and every shape the kernels compile and tune for, out of the timings
    timed = config.replace(record_density=False)
    contenders = {"sparse": timed, "dense": timed.keep_all() if args.dense == "keep_all" else None}
    attend_with(model, config)
    sparse_compile.reset_runtime_stats()
    with torch.no_grad():
        serve_batch(model, prompts, cb_config)
    density = mean_density()
    attend_with(model, contenders["dense"])
    with torch.no_grad():
        serve_batch(model, prompts[:2], cb_config)
    rows = []
    for rep in range(args.reps):
        for label in (["sparse", "dense"] if rep % 2 == 0 else ["dense", "sparse"]):  # alternated
            held = contenders[label]
            attend_with(model, held)
            sparse_compile.reset_runtime_stats()
            with torch.no_grad():
                ttft, wall = serve_batch(model, prompts, cb_config)
            calls = calls_by_path()
            contender = label if held is not None or label == "sparse" else f"dense ({args.dense})"
            for rid, (n, seconds) in ttft.items():
                rows.append(dict(scenario="batching", rep=rep, contender=contender, request=rid, prompt=n,
                                 ttft_ms=seconds * 1e3))
            rows.append(dict(scenario="batching", rep=rep, contender=contender, request="all", prompt=sum(lengths),
                             wall_ms=wall * 1e3, prefill_tok_s=sum(lengths) / wall, sparse_calls=calls["sparse"],
                             dense_calls=calls["dense"], density=density if label == "sparse" else None))
    return rows


def varlen_mixes(smoke: bool, rng) -> dict:
    """(query length, key length) per sequence of each packed step."""
    if smoke:
        return {"decode": [(1, rng.randint(16, 300)) for _ in range(8)],
                "mixed": [(64, 200), (64, 300), (40, 40), (1, 90), (1, 150), (7, 7)],
                "prefill": [(n, n) for n in (256, 128)]}
    return {"decode": [(1, rng.randint(1024, 32768)) for _ in range(64)],
            "mixed": [(8192, 8192 * 4), (8192, 8192 * 8)] + [(n, n) for n in (500, 1000, 1500, 2000)]
            + [(1, rng.randint(1024, 65536)) for _ in range(32)],
            "prefill": [(n, n) for n in (16384, 32768, 49152, 65536)]}


def varlen(args, config, device, dtype) -> list:
    """``--scenario varlen``: the attention of one packed step alone (Llama-3.1-8B's heads, bf16), as continuous
    batching hands it to the kernel route: ``pipeline.attend_segments``' packed launch (every sequence decided on its
    own, the joinable ones in one kernel launch) against its per-sequence path (``joined=False``: one decision and
    one launch per sequence), on three mixes (``varlen_mixes``): ``decode`` (64 decode tokens over 1K-32K keys),
    ``mixed`` (two 8K chunks over long prefixes, four short prompts, 32 decode tokens) and ``prefill`` (four prompts
    of 16K-64K). Per row: milliseconds per call, sparse and dense call counts. On sm_90 the long prompts' plans run
    on the Gluon Hopper kernel in both (the packed launch leaves them to it); ``SPARSE_COMPILE_ATTENTION_BACKEND=
    triton`` times the Triton kernel alone. ``python benchmarks/bench_serving.py --scenario varlen --store`` (GPU).
    """
    import random

    from sparse_compile import pipeline

    heads, kv_heads, dim = (4, 2, 16) if args.smoke else (32, 8, 128)
    rows = []
    for mix, lengths in varlen_mixes(args.smoke, random.Random(0)).items():
        q_total, k_total = sum(a for a, _ in lengths), sum(b for _, b in lengths)
        q, k, v = (torch.randn(1, h, n, dim, device=device, dtype=dtype)
                   for h, n in ((heads, q_total), (kv_heads, k_total), (kv_heads, k_total)))
        segments, q0, k0 = [], 0, 0
        for a, b in lengths:
            segments.append((q0, q0 + a, k0, k0 + b))
            q0, k0 = q0 + a, k0 + b
        contenders = {f"{label}": (lambda joined=joined: pipeline.attend_segments(
            q, k, v, None, config, "varlen", tuple(segments), joined=joined)) for label, joined in
            (("packed launch", True), ("per sequence", False))}
        per_run = {}
        for label, fn in contenders.items():  # one untimed run each: its call counts
            sparse_compile.reset_runtime_stats()
            with torch.no_grad():
                fn()
            sync()
            per_run[label] = calls_by_path()
        with torch.no_grad():
            samples = alternating_samples(contenders, args.reps, warmup=1)
        if args.profile and args.out:
            profile(contenders, Path(args.out), mix)
        loop = statistics.median(samples["per sequence"])
        for label, times in samples.items():
            rows.append(dict(scenario="varlen", mix=mix, sequences=len(lengths), queries=q_total, keys=k_total,
                             contender=label, ms=statistics.median(times), vs_per_sequence=statistics.median(times)
                             / loop, sparse_calls=per_run[label]["sparse"], dense_calls=per_run[label]["dense"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("chunked", "batching", "varlen"), default="chunked")
    parser.add_argument("--requests", type=int, default=32, help="batching: how many requests")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[8192, 131072], help="batching: prompt lengths")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="batching: tokens per step")
    parser.add_argument("--dense", choices=("sdpa", "keep_all"), default="sdpa", help="batching: the baseline")
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--method", default=None, help="a method name (default: the package's default config)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 32)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fixed-budget", type=float, default=None,
                        help="sampled keeps this share of every block's visible tiles (mass_target=0): one call and "
                             "the chunks then run at the same density")
    parser.add_argument("--profile", action="store_true",
                        help="a torch.profiler table of each sparse contender (chunked) or each mix's contenders (varlen) under --out")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, for testing the script")
    parser.add_argument("--out", default=None)
    parser.add_argument("--store", action="store_true", help="append the rows to the benchmark's store")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        args.lengths, args.chunk, args.reps = [256], 64, min(args.reps, 2)
        args.requests, args.prompt_range, args.max_batch_tokens = 4, [40, 300], 256
    options = dict(record_density=True)
    if args.method:
        options["method"] = args.method
    if args.fixed_budget is not None:
        options.update(method="sampled", sampled={"mass_target": 0.0, "budget": args.fixed_budget})
    if args.smoke:  # toy lengths: lower the floor and the blocks so the toy run takes the sparse path
        options.update(method=args.method or ("sampled" if args.scenario == "varlen" else "pbs"), min_seq_len=16,
                       pbs={"block_size": 16, "segment_size": 32}, sampled={"block_size": 16, "sample_every": 4})
    config = SparseConfig(**options)
    if args.scenario == "varlen":
        rows = varlen(args, config, device, dtype)
        meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype=str(dtype),
                    config=repr(config))
        print(write_results("bench_serving_varlen", rows, meta=meta, out_dir=args.out,
                            store="bench_serving" if args.store else None,
                            params=("scenario", "mix", "contender"), extra=dict(method=args.method or "default")))
        return
    model = build_model(args.smoke, device, dtype, args.layers)
    if args.scenario == "batching":
        rows = batching(args, model, config, device)
        meta = dict(model="Llama-3.1-8B shape" if not args.smoke else "toy", requests=args.requests,
                    prompt_range=args.prompt_range, max_batch_tokens=args.max_batch_tokens, dense=args.dense,
                    device=torch.cuda.get_device_name() if device == "cuda" else "cpu", config=repr(config))
        print(write_results("bench_serving_batching", rows, meta=meta, out_dir=args.out,
                            store="bench_serving" if args.store else None,
                            params=("scenario", "rep", "contender", "request", "prompt"),
                            extra=dict(layers=model.config.num_hidden_layers, method=args.method or "default")))
        return
    rows = []
    for length in args.lengths:
        name = hold(model, config)  # the counted runs record densities
        ids = torch.randint(1, model.config.vocab_size, (1, length), device=device)
        contenders = {
            "dense one call": with_attention(model, "sdpa", lambda x: one_call(model, x)),
            "sparse one call": with_attention(model, name, lambda x: one_call(model, x)),
            "dense chunked": with_attention(model, "sdpa", lambda x: chunked(model, x, args.chunk)),
            "sparse chunked": with_attention(model, name, lambda x: chunked(model, x, args.chunk)),
            "sparse chunked, static cache": with_attention(model, name,
                                                           lambda x: chunked(model, x, args.chunk, static=True)),
            "cache updates": lambda x: cache_updates(model, x, args.chunk),
        }
        per_run = {}
        for label, fn in contenders.items():  # one untimed run each: its call counts and density
            sparse_compile.reset_runtime_stats()
            with torch.no_grad():
                fn(ids)
            sync()
            per_run[label] = (calls_by_path(), mean_density())
        # timed without record_density: its host sync per call would weigh on the chunked runs' many calls
        hold(model, config.replace(record_density=False))
        memory = {}
        if device == "cuda":
            for label, fn in contenders.items():
                torch.cuda.reset_peak_memory_stats()
                with torch.no_grad():
                    fn(ids)
                memory[label] = torch.cuda.max_memory_allocated() / 2**30
        with torch.no_grad():
            samples = alternating_samples({k: (lambda f=f: f(ids)) for k, f in contenders.items()}, args.reps,
                                          warmup=1)
        if args.profile and args.out:
            profile({label: (lambda f=contenders[label]: f(ids)) for label in ("sparse one call", "sparse chunked")},
                    Path(args.out), str(length))
        one = statistics.median(samples["sparse one call"])
        for label, times in samples.items():
            calls, density = per_run[label]
            rows.append(dict(scenario="chunked", length=length, chunk=length if "one call" in label else args.chunk, contender=label,
                             ttft_ms=statistics.median(times), sparse_calls=calls["sparse"],
                             dense_calls=calls["dense"], density=density,
                             vs_sparse_one_call=statistics.median(times) / one,
                             peak_gib=memory.get(label)))
    meta = dict(model="Llama-3.1-8B shape" if not args.smoke else "toy", layers=model.config.num_hidden_layers,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype=str(dtype),
                config=repr(config))
    print(write_results("bench_serving", rows, meta=meta, out_dir=args.out,
                        store="bench_serving" if args.store else None, params=("scenario", "length", "chunk", "contender"),
                        extra=dict(layers=model.config.num_hidden_layers, method=args.method or "default")))


if __name__ == "__main__":
    main()
