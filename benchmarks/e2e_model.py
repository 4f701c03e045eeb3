"""The end-to-end benchmarks' model (Llama-3.1-8B shape, random weights, transformers' SDPA attention), its
compiled contenders, the attention it passes (captured) and the timing of its prefill: for ``bench_e2e.py``,
``profile_layer.py`` and ``bench_parallel.py``."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

import sparse_compile


def build_model(smoke: bool, device: str, dtype: torch.dtype, num_layers: int | None = None):
    """The Llama-3.1-8B-shaped model (``num_layers`` overrides its 32 decoder layers; tiny with ``smoke``)."""
    import transformers

    if smoke:
        sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    else:  # Llama-3.1-8B
        sizes = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    config = transformers.LlamaConfig(max_position_embeddings=131072, **sizes)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in bf16 on the device: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def register_noop_attention() -> str:
    from transformers import AttentionInterface

    def noop_attention(module, query, key, value, attention_mask, **kwargs):
        # the output layout transformers expects (batch, seq, heads, dim); no attention computed
        return query.transpose(1, 2), None

    AttentionInterface.register("noop", noop_attention)
    return "noop"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def in_region(fn, **region):
    """``fn(ids)`` called inside ``sparse_compile.sparsity(**region)``."""
    def call(ids):
        with sparse_compile.sparsity(**region):
            return fn(ids)
    return call


def with_attention(model, implementation: str, fn):
    """``fn(ids)`` with the model's attention implementation switched to ``implementation`` for that call only
    (back to ``"sdpa"``, what the compiled contenders traced, after it)."""
    def call(ids):
        model.config._attn_implementation = implementation
        try:
            return fn(ids)
        finally:
            model.config._attn_implementation = "sdpa"
    return call


def calls_by_path() -> dict:
    """Attention calls ``runtime_stats()`` counts since its last reset, by path (sparse, dense)."""
    totals = {"sparse": 0, "dense": 0}
    for stats in sparse_compile.runtime_stats().values():
        for (path, _), n in stats.calls.items():
            totals[path] = totals.get(path, 0) + n
    return totals


def mean_density():
    """The mean over sites of their mean density (``record_density``), or None where none was recorded."""
    import statistics

    values = [s.mean_density for s in sparse_compile.runtime_stats().values() if s.mean_density is not None]
    return statistics.fmean(values) if values else None


def time_first_call(first_call: dict, key: str, fn, ids) -> None:
    """The first call of ``key`` (Dynamo's and Inductor's compile included), timed once into ``first_call``,
    outside every measurement."""
    if key not in first_call:
        sync()
        started = time.perf_counter()
        with torch.no_grad():
            fn(ids)
        sync()
        first_call[key] = round(time.perf_counter() - started, 1)


def ttft(fn, ids, reps: int) -> float:
    """Median seconds of ``fn(ids)`` over ``reps`` runs after one warm-up run."""
    with torch.no_grad():
        fn(ids)
        times = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn(ids)
            sync()
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def capture_qkv(model, ids, layer: int = 1):
    """(query, key, value) that transformers passes to attention in ``layer`` on ``ids``: after RoPE, strides as
    they come (``clone`` keeps them). For calibration here and for ``profile_layer.py``."""
    captured = {}
    from transformers import AttentionInterface

    def capture(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) == layer:
            captured["qkv"] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return query.transpose(1, 2), None

    AttentionInterface.register("capture", capture)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "capture"
    try:
        with torch.no_grad():
            model(ids, logits_to_keep=1)
    finally:
        model.config._attn_implementation = previous
    return captured["qkv"]


@contextlib.contextmanager
def attention_noop():
    """The compiled graph with its attention ops doing nothing: the non-attention floor of the very same graph (the
    op is opaque to Inductor, so everything around it is unchanged), without compiling a second model."""
    from sparse_compile import pipeline

    real = pipeline.attend, pipeline.attend_padded
    pipeline.attend = lambda q, k, v, *args, **kwargs: q.new_empty((*q.shape[:-1], v.shape[-1]))
    pipeline.attend_padded = pipeline.attend
    try:
        yield
    finally:
        pipeline.attend, pipeline.attend_padded = real


def compile_contenders(model, options: dict, args):
    """(sparse_prefill, backend=inductor or None, the floor: a callable like the model without attention)."""
    if not args.regional:
        # the backend object, not its name: a source checkout has no installed entry point
        backend = functools.partial(sparse_compile.sparse_prefill, options=options)
        compiled = torch.compile(model, backend=backend, dynamic=True)
        inductor = torch.compile(model, backend="inductor", dynamic=True) if args.inductor else None

        def floor(*a, **kw):
            with attention_noop():
                return compiled(*a, **kw)

        return compiled, inductor, floor
    # regional compilation: the layers are compiled in place, so the model object serves every contender; which
    # backend a call uses is selected per call by swapping each layer's compiled forward
    layers = model.model.layers
    eager_forward = [layer.forward for layer in layers]
    backends = {
        "sparse": [torch.compile(f, backend=functools.partial(sparse_compile.sparse_prefill, options=options),
                                 dynamic=True) for f in eager_forward],
        "floor": [torch.compile(f, backend="inductor", dynamic=True) for f in eager_forward],
    }
    if args.inductor:
        backends["inductor"] = [torch.compile(f, backend="inductor", dynamic=True) for f in eager_forward]

    def with_layers(kind):
        def call(*a, **kw):
            for layer, fn in zip(layers, backends[kind]):
                layer.forward = fn
            try:
                return model(*a, **kw)
            finally:
                for layer, fn in zip(layers, eager_forward):
                    layer.forward = fn
        return call

    floor = with_layers("floor")

    def floor_noop(*a, **kw):  # transformers' attention replaced by a no-op, in the regionally compiled layers
        model.config._attn_implementation = register_noop_attention()
        try:
            return floor(*a, **kw)
        finally:
            model.config._attn_implementation = "sdpa"

    return with_layers("sparse"), (with_layers("inductor") if args.inductor else None), floor_noop
