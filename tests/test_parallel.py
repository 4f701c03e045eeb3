"""Tensor and sequence parallelism on CPU: two gloo processes against one process, to ~1e-5 (float32).

Both ranks run every scenario in one launch (starting a process costs seconds: torch and transformers imports),
each writes its results to a file, and the tests below check them. A scenario that fails records its traceback,
so one failure does not hide the others. Keep-all settings: sparse methods compute exact attention, so the
parallel result must equal one process's.

* tensor parallel, local outputs: a tiny Llama parallelised with ``parallelize_module`` (q/k/v/gate/up
  ``ColwiseParallel``, o/down ``RowwiseParallel``), compiled: every rank's sites run sparse on their local heads.
* tensor parallel, DTensors: the op's sharding rule (heads, batch, replicated) eagerly and in a compiled graph
  (rewrite + AOTAutograd, which traces the op through DTensor), and heads that do not divide refused.
* sequence parallel: the same Llama, compiled, each rank calling it on its chunk of the prompt inside
  ``sequence_parallel``: plain, left-padded, and chunks of unequal length; ``ulysses_attention`` eagerly. Bad
  input, and a graph that left attention as plain SDPA on one rank, raise on every rank instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

WORLD = 2
TIMEOUT_S = 480  # two processes compiling with Inductor, beside another test worker on 2 cores
SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16})
LLAMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=1024, intermediate_size=128, num_hidden_layers=2)
LAYERS = LLAMA["num_hidden_layers"]
EXACT = 1e-5  # max abs difference from one process (float32)


# -- the worker: runs in each of the WORLD processes -------------------------------------------------------------
def _compile_as_users_do(model, config, **kwargs):
    """``torch.compile(model, backend="sparse_prefill", options=config)``: the registered backend, rewrite then
    Inductor, as users run it. Returns the compiled model and the list the rewrite's site records land in."""
    import sparse_compile.backend

    records = []
    compiled = torch.compile(model, backend="sparse_prefill", options=config.to_dict(), **kwargs)

    def call(*args, **kw):
        with sparse_compile.backend.on_rewrite(lambda rows, diff: records.extend(rows)):
            return compiled(*args, **kw)

    return call, records


class Recorder:
    """A backend that runs the real rewrite and then ``after`` (default: the rewritten graph as it is, no
    Inductor: fast)."""

    def __init__(self, config, after=None):
        self.config, self.after, self.records = config, after, []

    def __call__(self, gm, example_inputs):
        from sparse_compile.rewrite import rewrite_graph

        self.records.extend(rewrite_graph(gm, self.config))
        return gm.forward if self.after is None else self.after(gm, example_inputs)


def _tiny_llama():
    import transformers

    torch.manual_seed(0)  # the same weights on every rank and in the one-process reference
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _sparse_calls():
    import sparse_compile

    return {site: sum(n for (path, _), n in entry.calls.items() if path == "sparse")
            for site, entry in sparse_compile.runtime_stats().items()}


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    return mask


def _scenario_tensor_parallel_local(rank, mesh):
    """The common plan: attention sees plain local tensors, Hq/P and Hkv/P heads per rank."""
    import sparse_compile
    from sparse_compile import SparseConfig
    from sparse_compile.state import STATE
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _tiny_llama()
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = _left_padded(ids)
    with torch.no_grad():
        ref_plain, ref_padded = model(ids).logits, model(ids, attention_mask=mask).logits
    plan = {}
    for layer in range(LAYERS):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{layer}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{layer}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    sparse_compile.reset_runtime_stats()
    compiled, records = _compile_as_users_do(model, SparseConfig(method="pbs", **SMALL).keep_all())
    registered_before = STATE["parallel.registered"].value
    with torch.no_grad():
        plain = compiled(ids).logits
        padded = compiled(ids, attention_mask=mask).logits
    valid = mask.bool()
    return dict(registered_by_rewrite=(registered_before, STATE["parallel.registered"].value),
                plain=(plain - ref_plain).abs().max().item(),
                padded=(padded[valid] - ref_padded[valid]).abs().max().item(),
                rewritten=[r.rewritten for r in records if r.q_shape[2] > 1],
                sparse_calls=_sparse_calls(),
                local_shapes=sorted({entry.last_shape for entry in sparse_compile.runtime_stats().values()}))


def _scenario_dtensor_rule(rank, mesh):
    """DTensor inputs: the op runs per rank on its shard, eagerly and inside a compiled graph."""
    import sparse_compile
    from sparse_compile import SparseConfig
    from sparse_compile.site import SiteSpec
    from sparse_compile.parallel import register_dtensor_sharding
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    register_dtensor_sharding()  # the rewrite and sparse_attention do this themselves; the raw op does not
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, 40, 16, generator=generator) for heads in (4, 2, 2))
    padding = torch.ones(2, 40, dtype=torch.long)
    padding[0, :5] = 0
    config = SparseConfig(method="pbs", **SMALL).keep_all()
    op = torch.ops.sparse_compile.causal_attention
    sparse_compile.reset_runtime_stats()

    def run(placement, padding_placement):
        args = [distribute_tensor(t, mesh, [placement]) for t in (q, k, v)]
        pad = distribute_tensor(padding, mesh, [padding_placement])
        out = op(*args, None, SiteSpec("dtensor", config, enable_gqa=True, queries_last=True).to_json(), pad)
        ref = op(q, k, v, None, SiteSpec("reference", config, enable_gqa=True, queries_last=True).to_json(), padding)
        return dict(placements=[str(p) for p in out.placements], local_shape=list(out.to_local().shape),
                    error=(out.full_tensor() - ref).abs().max().item())

    result = dict(heads=run(Shard(1), Replicate()), batch=run(Shard(0), Shard(0)),
                  replicated=run(Replicate(), Replicate()))
    stats = sparse_compile.runtime_stats()["dtensor"]
    result["eager_paths"] = sorted({path for path, _ in stats.calls})

    out = sparse_compile.sparse_attention(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)), config=config)
    ref = sparse_compile.sparse_attention(q, k, v, config=config)
    result["sparse_attention"] = dict(placements=[str(p) for p in out.placements],
                                      error=(out.full_tensor() - ref).abs().max().item())

    # compiled: rewrite, then AOTAutograd traces the graph through DTensor (Inductor would compile the same graph)
    class CausalAttention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    from torch._dynamo.backends.debugging import aot_eager

    sparse_compile.reset_runtime_stats()
    backend = Recorder(config, after=aot_eager)
    compiled = torch.compile(CausalAttention(), backend=backend)
    sharded = [distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)]
    # CPU SDPA has no DTensor rule: trace the math form (the rewrite replaces it anyway), plain masks replicated
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), implicit_replication():
        out = compiled(*sharded)
    ref = 2 * torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result["compiled"] = dict(placements=[str(p) for p in out.placements],
                              error=(out.full_tensor() - ref).abs().max().item(),
                              rewritten=[r.rewritten for r in backend.records], sparse_calls=_sparse_calls(),
                              local_shapes=[entry.last_shape for entry in sparse_compile.runtime_stats().values()])

    uneven = [distribute_tensor(torch.randn(1, heads, 40, 16), mesh, [Shard(1)]) for heads in (6, 3, 3)]
    try:
        op(*uneven, None, SiteSpec("uneven", config, enable_gqa=True).to_json())
        result["uneven_error"] = None
    except Exception as exc:  # DTensor wraps the rule's ValueError
        result["uneven_error"] = str(exc)
    return result


def _chunk(tensor, lengths, rank, dim=1):
    """This rank's chunk, as a tensor of its own (a view's storage offset would be one more Dynamo guard)."""
    return tensor.narrow(dim, sum(lengths[:rank]), lengths[rank]).contiguous()


def _scenario_sequence_parallel(rank, mesh):
    """Each rank calls the compiled model on its chunk of the prompt; attention sees the whole prompt."""
    import sparse_compile
    from sparse_compile import SparseConfig

    model = _tiny_llama()
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(70).expand(2, 70)
    mask = _left_padded(ids)
    with torch.no_grad():
        ref_plain = model(ids, position_ids=positions).logits
        ref_padded = model(ids, attention_mask=mask, position_ids=positions).logits
    sparse_compile.reset_runtime_stats()
    compiled, records = _compile_as_users_do(model, SparseConfig(method="s2o", **SMALL).keep_all(), dynamic=True)
    result = {}
    with torch.no_grad(), sparse_compile.sequence_parallel():
        for name, lengths, attention_mask, ref in (("plain", (35, 35), None, ref_plain),
                                                   ("padded", (35, 35), mask, ref_padded),
                                                   ("unequal", (44, 26), mask, ref_padded)):
            extra = {} if attention_mask is None else {"attention_mask": _chunk(attention_mask, lengths, rank)}
            out = compiled(_chunk(ids, lengths, rank), position_ids=_chunk(positions, lengths, rank), **extra).logits
            valid = _chunk(mask if attention_mask is not None else torch.ones_like(ids), lengths, rank).bool()
            result[name] = (out[valid] - _chunk(ref, lengths, rank)[valid]).abs().max().item()
    result["rewritten"] = [r.rewritten for r in records]
    result["sparse_calls"] = _sparse_calls()
    result["full_shapes"] = sorted({entry.last_shape for entry in sparse_compile.runtime_stats().values()})
    return result


def _scenario_plain_sdpa_refused(rank, mesh):
    """The real backend (Inductor). Rank 1's graph keeps attention as SDPA (not causal), rank 0's is rewritten:
    inside sequence_parallel both raise (rank 1's refusal reaches rank 0 in its header exchange: no hang)."""
    import sparse_compile

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=rank == 0)

    compiled = torch.compile(Attention(), backend="sparse_prefill", options={"min_seq_len": 2})
    x = torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        outside = compiled(x, x, x)
        outside = (outside - torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=rank == 0)).abs()
        try:
            with sparse_compile.sequence_parallel():
                compiled(x, x, x)
            inside = None
        except RuntimeError as exc:
            inside = str(exc)
    return dict(outside=outside.max().item(), inside=inside)


def _scenario_ulysses_attention(rank, mesh):
    import sparse_compile
    from sparse_compile import SparseConfig

    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, heads, 90, 32, generator=generator) for heads in (8, 2, 2))
    config = SparseConfig(method="bfla", **SMALL, bfla={"coarse_block_size": 32, "group_size": 8,
                                                         "tile_size_q": 16, "tile_size_kv": 16, "local_tiles": 1,
                                                         "stride": 4}).keep_all()
    ref = sparse_compile.sparse_attention(q, k, v, config=config)
    lengths = (50, 40)
    with torch.no_grad():
        out = sparse_compile.ulysses_attention(*(_chunk(t, lengths, rank, dim=2) for t in (q, k, v)), config=config)
    result = dict(error=(out - _chunk(ref, lengths, rank, dim=2)).abs().max().item(), shape=list(out.shape))
    errors = {}
    for name, call in (
        ("heads", lambda: sparse_compile.ulysses_attention(q[:, :3], k[:, :1], v[:, :1], config=config)),
        ("decode_on_one_rank", lambda: sparse_compile.ulysses_attention(
            q[:, :, -1:] if rank == 1 else q[:, :, :8], k[:, :, :8], v[:, :, :8], config=config)),
    ):
        try:
            call()
            errors[name] = None
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    result["errors"] = errors
    return result


SCENARIOS = {
    "tensor_parallel_local": _scenario_tensor_parallel_local,
    "dtensor_rule": _scenario_dtensor_rule,
    "sequence_parallel": _scenario_sequence_parallel,
    "plain_sdpa_refused": _scenario_plain_sdpa_refused,
    "ulysses_attention": _scenario_ulysses_attention,
}


def _worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for name, scenario in SCENARIOS.items():
            started = time.perf_counter()
            torch._dynamo.reset()  # no compiled code carried between scenarios
            try:
                results[name] = dict(ok=True, value=scenario(rank, mesh))
            except Exception:
                results[name] = dict(ok=False, value=traceback.format_exc())
            results[name]["seconds"] = round(time.perf_counter() - started, 2)
            print(f"rank {rank}: {name} {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['seconds']} s",
                  flush=True)
            dist.barrier()  # a scenario that failed on one rank only must not shift the next one's collectives
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results, default=str))
    finally:
        dist.destroy_process_group()


# -- the launcher and the tests -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Launch the WORLD workers once for the module; returns each rank's results."""
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available")
    pytest.importorskip("transformers")
    out_dir = tmp_path_factory.mktemp("parallel")
    package_root = Path(__import__("sparse_compile").__file__).resolve().parent.parent
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")]))
    logs = [out_dir / f"rank{rank}.log" for rank in range(WORLD)]
    processes = []
    for rank in range(WORLD):
        with open(logs[rank], "w") as log:  # a file, not a pipe: a full pipe cannot stall a worker
            processes.append(subprocess.Popen([sys.executable, __file__, str(rank), str(WORLD), str(out_dir)],
                                              env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [rank for rank, process in enumerate(processes) if process.poll() is None]
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for rank, process in enumerate(processes):
        path = out_dir / f"rank{rank}.json"
        if rank in timed_out or process.returncode != 0 or not path.exists():
            why = f"did not finish in {TIMEOUT_S} s" if rank in timed_out else f"exited with {process.returncode}"
            pytest.fail(f"rank {rank} {why}:\n{logs[rank].read_text()[-4000:]}")
        results.append(json.loads(path.read_text()))
    return results


def _values(ranks, name):
    for rank, results in enumerate(ranks):
        assert results[name]["ok"], f"rank {rank}:\n{results[name]['value']}"
    return [results[name]["value"] for results in ranks]


def test_tensor_parallel_local_outputs_equal_one_process(ranks):
    for value in _values(ranks, "tensor_parallel_local"):
        assert value["registered_by_rewrite"] == [False, True], value  # DTensor was loaded: the rule came with it
        assert value["rewritten"] == [True] * LAYERS * 2, value  # two graphs: plain and padded
        assert value["plain"] < EXACT and value["padded"] < EXACT, value
        assert value["sparse_calls"] == {f"model.layers.{i}.self_attn": 2 for i in range(LAYERS)}, value
        # each rank ran 2 of the 4 query heads (and 1 of the 2 key/value heads): no gather
        assert value["local_shapes"] == [[2, 2, 70, 16]], value


def test_dtensor_sharding_rule_heads_batch_replicated(ranks):
    for value in _values(ranks, "dtensor_rule"):
        assert value["heads"]["placements"] == ["S(1)"] and value["heads"]["local_shape"] == [2, 2, 40, 16]
        assert value["batch"]["placements"] == ["S(0)"] and value["batch"]["local_shape"] == [1, 4, 40, 16]
        assert value["replicated"]["placements"] == ["R"]
        for name in ("heads", "batch", "replicated"):
            assert value[name]["error"] < EXACT, (name, value)
        assert value["eager_paths"] == ["sparse"]
        assert value["sparse_attention"]["placements"] == ["S(1)"] and value["sparse_attention"]["error"] < EXACT


def test_dtensor_compiled_graph_runs_local_heads(ranks):
    for value in _values(ranks, "dtensor_rule"):
        compiled = value["compiled"]
        assert compiled["rewritten"] == [True] and compiled["placements"] == ["S(1)"], compiled
        assert compiled["error"] < EXACT, compiled
        assert list(compiled["sparse_calls"].values()) == [1] and compiled["local_shapes"] == [[2, 2, 40, 16]]


def test_dtensor_heads_not_divisible_are_refused(ranks):
    for value in _values(ranks, "dtensor_rule"):
        message = value["uneven_error"]
        assert message and "query heads (6) and key/value heads (3) must both be divisible by the 2 ranks" in message


def test_sequence_parallel_equals_one_process(ranks):
    for value in _values(ranks, "sequence_parallel"):
        assert value["rewritten"] and all(value["rewritten"]), value
        for name in ("plain", "padded", "unequal"):
            assert value[name] < EXACT, (name, value)
        assert value["sparse_calls"] == {f"model.layers.{i}.self_attn": 3 for i in range(LAYERS)}, value
        # attention ran on the whole prompt (70 tokens) for 2 of the 4 query heads
        assert value["full_shapes"] == [[2, 2, 70, 16]], value


def test_sequence_parallel_refuses_graphs_with_attention_left_as_sdpa_on_every_rank(ranks):
    values = _values(ranks, "plain_sdpa_refused")
    for value in values:
        assert value["outside"] < 1e-6, value
        assert "refused on rank 1: its compiled graph left attention as plain SDPA" in (value["inside"] or ""), value
    assert "this rank: this compiled graph left attention as plain SDPA" in values[1]["inside"]
    assert "not causal" in values[1]["inside"]


def test_ulysses_attention_equals_one_process_and_refuses_bad_input_on_every_rank(ranks):
    values = _values(ranks, "ulysses_attention")
    assert [value["shape"] for value in values] == [[1, 8, 50, 32], [1, 8, 40, 32]]
    for value in values:
        assert value["error"] < EXACT, value
        heads_error = value["errors"]["heads"] or ""
        assert "query heads (3) and key/value heads (1) must both be divisible by the 2 ranks" in heads_error
        assert "q_len, kv_len per rank [(8, 8, 8), (1, 8, 8)]" in value["errors"]["decode_on_one_rank"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
