"""Continuous batching through transformers' Hub-kernel route: ``sparse_compile.serving_attention`` loads the kernel
repository shipped in the package (``sparse_compile/hub_kernel``) as the flash implementation
``"sparse-compile/flash-sparse-prefill"``, and ``generate_batch`` / the manager run it: tokens as dense
``generate_batch`` gives them, long prompts counted sparse, decode tokens dense with their reason, every call counted.
The kernel functions themselves (FlashAttention's conventions, the dense reference for what the sparse path lacks)
are checked in this process.

The route runs in a subprocess started outside the checkout: Python started in its root imports the top-level
folder ``kernels/`` as ``kernels`` (the package's own kernels), not the ``kernels`` package transformers loads Hub
kernels with. It is skipped, with the reason, where ``kernels`` is missing or transformers refuses its version.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile import serving

from helpers import run_outside_the_checkout

transformers = pytest.importorskip("transformers")

PBS = dict(method="pbs", pbs={"block_size": 16, "segment_size": 32})
KEEP_ALL = SparseConfig(**PBS, min_seq_len=100).keep_all()
needs_batching = pytest.mark.skipif(not hasattr(transformers.LlamaForCausalLM, "generate_batch"),
                                    reason="this transformers has no continuous batching")


def _stats() -> dict:
    return dict(sparse_compile.runtime_stats()["varlen_attention"].calls)


def _reference(q, k, v, cq, ck, *, causal=True, window=None, softcap=None, sinks=None, scale=None):
    """Each sequence on its own, the mask written out (queries at the last positions), softmax by hand."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1).double()
        ks, vs = (t[k0:k1].repeat_interleave(group, 1).transpose(0, 1).double() for t in (k, v))
        scores = qs @ ks.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        pos_k = torch.arange(k1 - k0)[None]
        keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if causal:
            keep &= pos_k <= pos_q
        if window is not None:
            keep &= pos_q - pos_k <= window
        scores = scores.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, q1 - q0, 1)], -1)
        probs = scores.softmax(-1)[..., :k1 - k0]
        out[q0:q1] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


def _packed(q_lens, k_lens, hq=4, hkv=2, d=16, spare_q=0, spare_k=0):
    cq = [0]
    ck = [0]
    for nq, nk in zip(q_lens, k_lens):
        cq.append(cq[-1] + nq)
        ck.append(ck[-1] + nk)
    q = torch.randn(cq[-1] + spare_q, hq, d)
    k, v = torch.randn(ck[-1] + spare_k, hkv, d), torch.randn(ck[-1] + spare_k, hkv, d)
    return q, k, v, cq, ck


# -- the kernel functions, in this process ------------------------------------------------------------------------
def test_varlen_causal_calls_run_the_packages_rules_per_sequence(monkeypatch):
    monkeypatch.setenv(serving.CONFIG_VARIABLE, KEEP_ALL.to_json())  # a kernel call made without a model
    # a 250-token prompt, a 40-token chunk over 160 keys, a short prompt, two decode tokens; rows past the last
    # sequence (a padded batch) must come back zero
    q, k, v, cq, ck = _packed([250, 40, 30, 1, 1], [250, 160, 30, 77, 300], spare_q=3, spare_k=5)
    out = serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq, dtype=torch.int32),
                                         torch.tensor(ck, dtype=torch.int32), max(cq), max(ck), causal=True)
    torch.testing.assert_close(out[:cq[-1]], _reference(q, k, v, cq, ck)[:cq[-1]], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[cq[-1]:], torch.zeros_like(out[cq[-1]:]))
    stats = _stats()
    assert sum(stats.values()) == 5  # every sequence is one call
    assert sum(n for (path, reason), n in stats.items() if path == "sparse") == 2  # the prompt and the chunk
    assert stats[("dense", "decode step (q_len == 1)")] == 2
    assert stats[("dense", "q_len 30 < min_seq_len 100")] == 1


@pytest.mark.parametrize("feature", ["not causal", "softcap", "sinks", "window"])
def test_what_the_sparse_path_lacks_runs_the_dense_reference_and_says_so(feature, monkeypatch):
    monkeypatch.setenv(serving.CONFIG_VARIABLE, KEEP_ALL.to_json())
    q, k, v, cq, ck = _packed([200, 1, 50], [200, 120, 90])
    sinks = torch.randn(q.shape[1])
    kwargs, expect, reason = {"causal": True}, {}, None
    if feature == "not causal":
        kwargs, expect, reason = {"causal": False}, {"causal": False}, "not causal (causal=False)"
    elif feature == "softcap":
        kwargs["softcap"], expect["softcap"], reason = 5.0, 5.0, "attention logit soft-capping (5.0)"
    elif feature == "sinks":
        kwargs["s_aux"], expect["sinks"], reason = sinks, sinks, "attention sinks (s_aux)"
    else:  # transformers passes (sliding_window - 1, sliding_window - 1): a window of 100 keys
        kwargs["window_size"], expect["window"] = (99, 99), 99
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq), torch.tensor(ck), max(cq), max(ck), **kwargs)
        serving.flash_attn_varlen_func(q, k, v, torch.tensor(cq), torch.tensor(ck), max(cq), max(ck), **kwargs)
    torch.testing.assert_close(out, _reference(q, k, v, cq, ck, **expect), rtol=1e-5, atol=1e-5)
    said = [str(w.message) for w in seen if "flash-sparse-prefill" in str(w.message)]
    assert len(said) == 1  # once per reason, not once per call or sequence
    stats = _stats()
    assert sum(stats.values()) == 6  # three sequences, twice
    if feature == "window":  # it binds where a query is 100 keys or more from the first: the prompt, the decode token
        binding = {r: n for (p, r), n in stats.items() if r.startswith("sliding window 99 shorter than the")}
        assert binding == {f"sliding window 99 shorter than the {n} keys (the window drops keys): the dense "
                           "reference": 2 for n in (200, 120)}
        # the 50-token chunk over 90 keys sees all of them: the package's rules (dense here: too short)
        assert [r for (p, r), n in stats.items() if r not in binding] == [
            "q_len 50 over 90 keys computes as much as a 80-token prefill < min_seq_len 100"]
    else:
        assert stats == {("dense", f"{reason}: the dense reference"): 6}


def test_flash_attn_func_is_one_sequence_per_row(monkeypatch):
    monkeypatch.setenv(serving.CONFIG_VARIABLE, KEEP_ALL.to_json())
    q, k, v = torch.randn(2, 160, 4, 16), torch.randn(2, 200, 2, 16), torch.randn(2, 200, 2, 16)
    out = serving.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    flat = _reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), [0, 160, 320], [0, 200, 400], scale=0.3)
    torch.testing.assert_close(out, flat.view(2, 160, 4, 16), rtol=1e-5, atol=1e-5)
    assert sum(n for (path, _), n in _stats().items() if path == "sparse") == 2


def test_the_kernel_function_takes_what_transformers_passes():
    """transformers passes a flash kernel only the keywords its signature names (dropping the others silently):
    attention sinks and soft-capping must be named, or a model using them would run without them."""
    import inspect

    named = set(inspect.signature(serving.flash_attn_varlen_func).parameters)
    assert {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
            "window_size", "softcap", "alibi_slopes", "deterministic", "s_aux"} <= named
    assert "block_table" not in named  # no paged decode: continuous batching reads the cache for the varlen call
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        serving.flash_attn_varlen_func(*_packed([4], [4])[:3], torch.tensor([0, 4]), torch.tensor([0, 4]),
                                       return_attn_probs=True)


def test_the_name_is_a_hub_kernel_continuous_batching_takes():
    generic = pytest.importorskip("transformers.utils.generic")
    hub = pytest.importorskip("transformers.integrations.hub_kernels")
    if not hasattr(generic, "is_flash_attention_requested") or not hasattr(hub, "is_kernel"):
        pytest.skip(f"transformers {transformers.__version__} has no is_kernel / is_flash_attention_requested")
    is_flash_attention_requested = generic.is_flash_attention_requested
    assert hub.is_kernel(serving.KERNEL_NAME)
    assert is_flash_attention_requested(requested_attention_implementation=serving.KERNEL_NAME)
    # no version digit: a "flash...2" / "flash...3" name would be taken for FA2 / FA3 (paged decode with block tables)
    assert not is_flash_attention_requested(requested_attention_implementation=serving.KERNEL_NAME, version=[2, 3])
    builds = {path.name: path for path in (serving.KERNEL_PATH / "build").iterdir() if path.is_dir()}
    assert sorted(builds) == ["torch-cpu", "torch-cuda", "torch-universal"]
    modules = {(path / "__init__.py").read_text() for path in builds.values()}
    assert len(modules) == 1  # one module, three builds
    for name, path in builds.items():
        metadata = json.loads((path / "metadata.json").read_text())
        assert metadata["name"] == "flash-sparse-prefill" and metadata["python-depends"] == []
        assert metadata["backend"]["type"] == ("cuda" if name == "torch-cuda" else "cpu")


# -- the route, in a subprocess ----------------------------------------------------------------------------------
CHILD = r"""
import json, sys, warnings
import torch, transformers
import sparse_compile
from sparse_compile import SparseConfig, serving

result = {"transformers": transformers.__version__}
from kernels import get_local_kernel  # the kernels package: this process started outside the checkout
module = get_local_kernel(serving.KERNEL_PATH)
result["local_kernel"] = module.flash_attn_varlen_func is serving.flash_attn_varlen_func

from transformers.utils import import_utils
if not import_utils.is_kernels_available():
    from importlib import metadata
    result["skip"] = (f"transformers {transformers.__version__} loads Hub kernels with kernels >= "
                      f"{getattr(import_utils, 'KERNELS_MIN_VERSION', '?')}, < "
                      f"{getattr(import_utils, 'KERNELS_MAX_VERSION', '?')}; kernels {metadata.version('kernels')} "
                      "is installed")
    print(json.dumps(result))
    sys.exit(0)

config = SparseConfig.from_json(sys.argv[1])
torch.manual_seed(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
        intermediate_size=128, num_hidden_layers=2)).eval()
prompts = [torch.randint(1, 128, (n,)).tolist() for n in (60, 150, 250)]
steps = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
small = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=512)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ref = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    result["reference_implementation"] = model.config._attn_implementation
    result["name"] = sparse_compile.serving_attention(model, config)
    result["implementation"] = model.config._attn_implementation
    sparse_compile.reset_runtime_stats()
    out = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    result["generate_batch"] = {
        "same": all(out[r].generated_tokens == ref[r].generated_tokens for r in ref) and len(out) == len(ref),
        "calls": [[p, r, n] for s in sparse_compile.runtime_stats().values() for (p, r), n in s.calls.items()],
        "sites": sorted(sparse_compile.runtime_stats())}
    sparse_compile.reset_runtime_stats()
    manager = model.init_continuous_batching(generation_config=steps, continuous_batching_config=small)
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"m{i}", max_new_tokens=3) for i, p in enumerate(prompts)]
        got = {}
        for _ in ids:
            answer = manager.get_result(timeout=120)
            got[answer.request_id] = answer.generated_tokens
    finally:
        manager.stop(block=True, timeout=60)
    result["manager"] = {
        "same": [got.get(f"m{i}") for i in range(3)] == [ref[r].generated_tokens for r in sorted(ref)],
        "calls": [[p, r, n] for s in sparse_compile.runtime_stats().values() for (p, r), n in s.calls.items()]}
    # the model's configuration per layer: skip_layers leaves layer 1 dense
    sparse_compile.serving_attention(model, config.replace(skip_layers=(1,)))
    sparse_compile.reset_runtime_stats()
    out = model.generate_batch(prompts, generation_config=steps, continuous_batching_config=small)
    result["skip_layers"] = {
        "same": all(out[r].generated_tokens == ref[r].generated_tokens for r in ref),
        "calls": {site: [[p, r, n] for (p, r), n in s.calls.items()]
                  for site, s in sparse_compile.runtime_stats().items()}}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def route(tmp_path_factory):
    result = run_outside_the_checkout(CHILD, KEEP_ALL.to_json(), where=tmp_path_factory.mktemp("outside_the_checkout"),
                                      timeout=240)
    assert result["local_kernel"], "kernels.get_local_kernel did not load sparse_compile.serving's functions"
    return result


def _route_ran(route):
    if "skip" in route:
        pytest.skip(route["skip"])


def test_the_kernel_repository_loads_through_kernels(route):
    assert route["local_kernel"]


def _check_calls(calls):
    layers, prompts, new = 2, 3, 3
    total = sum(n for _, _, n in calls)
    assert total == layers * (prompts + prompts * (new - 1))  # each prompt once, then each decode token
    sparse = sum(n for p, r, n in calls if p == "sparse")
    assert sparse == 2 * layers and all(r.startswith("method pbs") for p, r, _ in calls if p == "sparse")
    dense: dict = {}
    for p, r, n in calls:
        if p == "dense":
            dense[r] = dense.get(r, 0) + n
    assert dense == {"q_len 60 < min_seq_len 100": layers, "decode step (q_len == 1)": layers * prompts * (new - 1)}


@needs_batching
def test_generate_batch_runs_the_kernel_with_the_models_configuration(route):
    _route_ran(route)
    assert route["name"] == route["implementation"] == serving.KERNEL_NAME
    assert route["reference_implementation"] in ("sdpa", "paged|eager")
    assert route["generate_batch"]["same"], route
    assert route["generate_batch"]["sites"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    _check_calls(route["generate_batch"]["calls"])  # min_seq_len 100 is the model's: the default is 16384


@needs_batching
def test_the_manager_runs_it_in_its_thread(route):
    _route_ran(route)
    assert route["manager"]["same"], route
    _check_calls(route["manager"]["calls"])


def test_serving_attention_names_what_it_needs():
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        pytest.skip("transformers accepts the installed kernels: the route runs (the subprocess tests)")
    with pytest.raises(ImportError, match="kernels"):
        sparse_compile.serving_attention(torch.nn.Linear(2, 2))


@needs_batching
def test_skip_layers_of_the_models_configuration_apply_per_layer(route):
    _route_ran(route)
    calls = route["skip_layers"]["calls"]
    assert route["skip_layers"]["same"]
    assert sorted(calls) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert sum(n for p, _, n in calls["model.layers.0.self_attn"] if p == "sparse") == 2
    skipped = calls["model.layers.1.self_attn"]
    assert all(p == "dense" for p, _, _ in skipped) and sum(n for _, _, n in skipped) == 3 + 3 * 2
    assert any("skip_layers" in r for _, r, _ in skipped), skipped


# -- transformers serve, in a subprocess ---------------------------------------------------------------------------
SERVE_CHILD = r"""
import json, os, socket, sys, time, urllib.request, warnings
import torch, transformers
from transformers.utils import import_utils

result = {}
if not import_utils.is_serve_available():
    result["skip"] = "transformers serve needs fastapi, uvicorn and openai (pip install transformers[serving])"
elif not import_utils.is_kernels_available():
    result["skip"] = f"transformers {transformers.__version__} does not accept the installed kernels version"
if result:
    print(json.dumps(result))
    sys.exit(0)
import sparse_compile
from sparse_compile import serving
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.cli.serve import Serve

# a tiny llama and a word-level tokenizer, saved as a model directory
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": i + 4 for i in range(124)}}
tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer.decoder = decoders.WordPiece(prefix="##")
fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                            eos_token="</s>", pad_token="<pad>")
torch.manual_seed(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
        intermediate_size=128, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=3))
    model.save_pretrained("tiny")
fast.save_pretrained("tiny")
path = os.path.abspath("tiny")


def serve(implementation):
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Serve(force_model=path, continuous_batching=True, attn_implementation=implementation, device="cpu",
                   dtype="float32", cb_num_blocks=16, cb_max_batch_tokens=512, host="127.0.0.1", port=port,
                   non_blocking=True, log_level="error")
    texts = []
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        for n in (60, 150, 250):
            body = {"model": path, "prompt": " ".join(f"w{(7 * i) % 124}" for i in range(n)), "max_tokens": 3,
                    "temperature": 0}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            texts.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["text"])
    finally:
        server.kill_server()
    return texts


result["reference"] = serve("sdpa")
sparse_compile.reset_runtime_stats()
result["texts"] = serve(serving.KERNEL_NAME)
result["calls"] = {site: [[p, r, n] for (p, r), n in s.calls.items()]
                   for site, s in sparse_compile.runtime_stats().items()}
print(json.dumps(result))
"""


def test_transformers_serve_loads_it_through_local_kernels(tmp_path):
    """``transformers serve --continuous-batching --attn-implementation sparse-compile/flash-sparse-prefill`` (the
    CLI's own ``Serve``, in a process of its own), configured by ``LOCAL_KERNELS`` and ``SPARSE_COMPILE_CONFIG``
    alone: completions as an SDPA server gives them, long prompts sparse."""
    from importlib import metadata

    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("the kernels package is not installed (pip install sparse_compile[serving])")
    missing = [name for name in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"transformers serve needs {', '.join(missing)} (pip install transformers[serving])")
    env = {**os.environ, "LOCAL_KERNELS": serving.local_kernels_entry(), serving.CONFIG_VARIABLE: KEEP_ALL.to_json(),
           "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    done = subprocess.run([sys.executable, "-c", SERVE_CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["texts"] == result["reference"] and all(result["texts"]), result
    assert sorted(result["calls"]) == ["varlen_attention"]  # a model transformers loaded: no layer is known
    _check_calls(result["calls"]["varlen_attention"])  # min_seq_len 100 from SPARSE_COMPILE_CONFIG

