"""The backend end to end through Inductor, the op (opcheck), the entry point, configuration and regions."""

import asyncio
import json
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.state import STATE
from sparse_compile.context import current_region, resolve

from helpers import op_spec, random_qkv
from models import ModelArgs, Transformer


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def small_model():
    return Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)).eval()


# -- end to end through Inductor ------------------------------------------------------------------------------
def test_compiled_logits_equal_eager_with_sparsity_off():
    model = small_model()
    x = torch.randint(0, 64, (2, 45))
    with torch.no_grad():
        ref = model(x)
        compiled = torch.compile(model, backend="sparse_prefill", options={"enabled": False, "min_seq_len": 2})
        out = compiled(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    stats = sparse_compile.runtime_stats()
    assert set(stats) == {"layers.0.attention", "layers.1.attention"}
    assert all(s.last_reason == "sparsity disabled in this region" for s in stats.values())


def test_unknown_option_names_valid_keys():
    with pytest.raises(ValueError, match="unknown key.*'bogus'.*valid keys.*min_seq_len"):
        SparseConfig.from_options({"bogus": 1})
    with pytest.raises(Exception, match="bogus"):
        torch.compile(lambda a: a + 1, backend="sparse_prefill", options={"bogus": 1})(torch.ones(3))


def test_backend_leaves_no_global_state_changed():
    import logging

    from torch._inductor import config as inductor_config

    before = inductor_config.get_config_copy()
    logger = logging.getLogger("sparse_compile")
    handlers, level = list(logger.handlers), logger.level
    q = torch.randn(1, 2, 8, 16)
    fn = torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), backend="sparse_prefill",
                       mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        fn(q)
    assert inductor_config.get_config_copy() == before
    assert logger.handlers == handlers and logger.level == level


def test_one_graph_serves_many_lengths_without_recompiling():
    model = small_model()
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(1)
        return sparse_compile.sparse_prefill(gm, example_inputs, options={"min_seq_len": 24})

    compiled = torch.compile(model, backend=counting_backend, dynamic=True)
    with torch.no_grad():
        for i, n in enumerate((9, 17, 30, 41)):
            x = torch.randint(0, 64, (1, n))
            out = compiled(x)
            if i == 0:
                first = len(compiles)  # Dynamo may restart analysis once on the first call
            torch.testing.assert_close(out[:, :8], model(x)[:, :8], rtol=1e-4, atol=1e-5)  # causal: prefix exact
    assert len(compiles) == first
    paths = sparse_compile.runtime_stats()["layers.0.attention"].calls
    assert any(p == "dense" and "min_seq_len 24" in r for p, r in paths)
    assert any(p == "sparse" for p, _ in paths)


# -- the op ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("min_seq_len", [10**6, 2])
def test_opcheck(min_seq_len):
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16)
    config = SparseConfig(min_seq_len=min_seq_len, pbs={"block_size": 16, "segment_size": 32})
    torch.library.opcheck(torch.ops.sparse_compile.causal_attention.default,
                          (q, k, v, None, op_spec("t", config, enable_gqa=True)))


def test_op_decode_step_runs_dense():
    q, k, v = random_qkv(1, 4, 2, 1, 1, 16)
    spec = op_spec("decode", SparseConfig(min_seq_len=1 + 1), enable_gqa=True)
    out = torch.ops.sparse_compile.causal_attention(q, k, v, None, spec)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert sparse_compile.runtime_stats()["decode"].last_reason == "decode step (q_len == 1)"


def test_config_json_round_trip():
    config = SparseConfig(method="bfla", skip_layers=(0, "mlp"), bfla={"mass_threshold": 0.9})
    text = config.to_json()
    assert json.loads(text)["bfla"] == {"mass_threshold": 0.9}
    assert SparseConfig.from_json(text) == config
    assert SparseConfig().to_json() == "{}"


# -- entry point -----------------------------------------------------------------------------------------------
def test_backend_name_resolves_in_fresh_interpreter():
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "assert 'sparse_compile' not in sys.modules\n"
        "fn = torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True),"
        " backend='sparse_prefill', options={'enabled': False})\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(fn(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))\n"
        "assert 'sparse_compile' in sys.modules\n"
        "import sparse_compile\n"
        "assert list(sparse_compile.runtime_stats()) == ['<scaled_dot_product_attention>']\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


# -- configuration ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(method="nope"), "unknown method 'nope'"),
    (dict(min_seq_len=0), "min_seq_len"),
    (dict(pbs={"threshold": 1.5}), "PBSParams.threshold"),
    (dict(pbs={"tau": 0.5}), "unknown parameter.*'tau'"),
    (dict(pbs={"block_size": 128, "segment_size": 200}), "segment_size"),
    (dict(skip_layers=3), "skip_layers"),
    (dict(method="s2o", select="pbs"), "cannot be combined.*valid pairs"),
    (dict(reorder="bogus"), "unknown reorder stage 'bogus'"),
])
def test_config_validation_names_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        SparseConfig(**options)


def test_config_keeps_valid_layers_and_stage_pairs():
    assert SparseConfig(skip_layers=[1, "x"]).skip_layers == (1, "x")
    assert SparseConfig(method="pbs", select="sparge").select_stage == "sparge"


def test_keep_all_settings():
    config = SparseConfig().keep_all()
    assert config.params_of("pbs").threshold == 1.0 and config.params_of("bfla").mass_threshold == 1.0
    assert config.params_of("sparge").cdf_threshold == 1.0 and config.params_of("sparge").pv_threshold is None
    assert config.params_of("s2o").early_stop == 0.0


# -- regions ----------------------------------------------------------------------------------------------------
def test_sparsity_nests_and_restores_exactly():
    base = SparseConfig(method="pbs")
    outer_state = current_region()
    with sparsity(enabled=False):
        assert resolve(base).enabled is False
        with sparsity(method="bfla", mass_threshold=0.5, min_seq_len=64):
            cfg = resolve(base)
            # what a region leaves unspecified is inherited: still disabled
            assert not cfg.enabled and cfg.method == "bfla" and cfg.params_of("bfla").mass_threshold == 0.5
            assert cfg.min_seq_len == 64
            with sparsity(enabled=True):
                assert resolve(base).enabled and resolve(base).params_of("bfla").mass_threshold == 0.5
            with sparsity(mass_threshold=0.7):
                cfg = resolve(base)
                assert cfg.method == "bfla" and cfg.params_of("bfla").mass_threshold == 0.7 and cfg.min_seq_len == 64
            with sparsity(method="pbs", threshold=0.8):
                cfg = resolve(base)
                assert cfg.method == "pbs" and cfg.params_of("pbs").threshold == 0.8 and cfg.min_seq_len == 64
        assert resolve(base).enabled is False
    assert current_region() == outer_state
    assert resolve(base) == base


def test_sparsity_restores_on_exception():
    before = current_region()
    with pytest.raises(RuntimeError):
        with sparsity(method="s2o"):
            raise RuntimeError("boom")
    assert current_region() == before


def test_sparsity_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown method"):
        sparsity(method="dense")
    with pytest.raises(ValueError, match="unknown parameter"):
        sparsity(threshhold=0.5)
    with pytest.raises(ValueError, match="unknown parameter 'threshold' for method 'bfla'"):
        sparsity(method="bfla", threshold=0.5)
    with pytest.raises(TypeError):
        sparsity(enabled="yes")


def test_sparsity_is_per_thread_and_per_task():
    seen = {}

    def worker():
        seen["thread"] = resolve(SparseConfig()).enabled

    with sparsity(enabled=False):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["thread"] is True

    async def task(flag, delay):
        with sparsity(enabled=flag):
            await asyncio.sleep(delay)
            return resolve(SparseConfig()).enabled

    async def main():
        return await asyncio.gather(task(False, 0.02), task(True, 0.01))

    assert asyncio.run(main()) == [False, True]


def test_sparsity_as_decorator():
    @sparsity(enabled=False)
    def f():
        return resolve(SparseConfig()).enabled

    assert f() is False and resolve(SparseConfig()).enabled is True


def test_region_changes_compiled_code_at_run_time_without_recompiling():
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(1)
        return sparse_compile.sparse_prefill(gm, example_inputs, options={"min_seq_len": 2})

    q = torch.randn(1, 2, 24, 16)
    fn = torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), backend=counting_backend)
    with torch.no_grad():
        with sparsity(enabled=False):
            fn(q)
        site = "<scaled_dot_product_attention>"
        assert sparse_compile.runtime_stats()[site].last_reason == "sparsity disabled in this region"
        with sparsity(min_seq_len=10**6):
            fn(q)
        assert "min_seq_len 1000000" in sparse_compile.runtime_stats()[site].last_reason
    assert len(compiles) == 1


# -- eager entry point ----------------------------------------------------------------------------------------
def test_sparse_attention_errors_name_the_problem():
    q, k, v = random_qkv(1, 4, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="4-D"):
        sparse_compile.sparse_attention(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_compile.sparse_attention(torch.randn(1, 3, 16, 16), k, v)
    with pytest.raises(ValueError, match="head dims differ"):
        sparse_compile.sparse_attention(torch.randn(1, 4, 16, 32), k, v)
    with pytest.raises(ValueError, match="share a dtype"):
        sparse_compile.sparse_attention(q.half(), k, v)
    with pytest.raises(ValueError, match="unsupported dtype"):
        sparse_compile.sparse_attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="k and v shapes differ"):
        sparse_compile.sparse_attention(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="q_len 16 > kv_len 8"):
        sparse_compile.sparse_attention(q, k[:, :, :8], v[:, :, :8])
    with pytest.raises(ValueError, match="batch sizes differ"):
        sparse_compile.sparse_attention(q.expand(2, -1, -1, -1), k, v)
    if torch.device("meta") != q.device:
        with pytest.raises(ValueError, match="one device"):
            sparse_compile.sparse_attention(q, k.to("meta"), v)


def test_sparse_attention_short_is_exact_dense():
    q, k, v = random_qkv(2, 4, 2, 20, 50, 16)  # chunked prefill: queries at the last positions
    out = sparse_compile.sparse_attention(q, k, v)
    from sparse_compile.dense import dense_causal_attention

    torch.testing.assert_close(out, dense_causal_attention(q, k, v))
    assert "min_seq_len" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_log_env_var_reports_sites_and_diff(monkeypatch):
    import logging

    logger = logging.getLogger("sparse_compile")
    handlers, level = list(logger.handlers), logger.level
    records = []
    capture = logging.Handler()
    capture.emit = records.append
    monkeypatch.setenv("SPARSE_COMPILE_LOG", "1")
    q = torch.randn(1, 2, 8, 16)
    logger.addHandler(capture)
    try:
        with torch.no_grad():
            torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True),
                          backend="sparse_prefill")(q)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    text = "\n".join(r.getMessage() for r in records)
    assert "rewrote 1 of 1 attention sites" in text
    assert "graph diff" in text and "sparse_compile.causal_attention" in text


# -- padding and traced masks at the op --------------------------------------------------------------------------
def _masked_reference(q, k, v, valid):
    """Causal (queries at the last positions) AND key padding, float64, through an explicit bool mask."""
    nq, nk = q.shape[-2], k.shape[-2]
    causal = torch.arange(nk)[None, :] <= torch.arange(nk - nq, nk)[:, None]
    mask = causal[None, None] & valid[:, None, None, :]
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("nq, nk", [(45, 45), (20, 53)])
@pytest.mark.parametrize("method", ["pbs", "sparge", "bfla", "s2o"])
def test_op_with_key_padding_equals_masked_dense_on_valid_rows(method, nq, nk):
    q, k, v = random_qkv(4, 4, 2, nq, nk, 16)
    valid = torch.ones(4, nk, dtype=torch.bool)
    valid[0, :9] = False  # left padding
    valid[1, nk - 6:] = False  # right padding
    valid[2, 11:17] = False  # a hole
    valid[3] = False  # nothing valid
    config = SparseConfig(method=method, min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
                          sparge={"block_size_q": 16, "block_size_kv": 16},
                          bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
                          s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16}).keep_all()
    out = torch.ops.sparse_compile.causal_attention(q, k, v, None, op_spec("p", config, enable_gqa=True,
                                                                           queries_last=True), valid.long())
    ref = _masked_reference(q, k, v, valid)
    rows = valid[:, nk - nq:]  # valid query rows
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.transpose(1, 2)[rows], ref.transpose(1, 2)[rows].float(), rtol=1e-4, atol=1e-5)
    assert (out[3] == 0).all()
    stats = sparse_compile.runtime_stats()["p"]
    assert "padded batch" in stats.last_reason, stats.last_reason
    # S2O's segments describe a full prefill: with a cached prefix (nq < nk) it declines and runs dense
    assert stats.last_path == ("dense" if method == "s2o" and nq < nk else "sparse"), stats.last_reason


def test_padding_summary_read_once_per_mask_tensor(monkeypatch):
    from sparse_compile import padding

    reads = []
    real = padding.compute_layout
    monkeypatch.setattr(padding, "compute_layout", lambda m: reads.append(1) or real(m))
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16)
    ones = torch.ones(2, 40, dtype=torch.long)
    spec = op_spec("ones", SparseConfig(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32}), enable_gqa=True,
                   queries_last=True)
    with padding.forward_scope():  # one call of a compiled graph (the backend opens it)
        for _ in range(3):  # three layers of one forward pass
            out = torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, ones)
        assert len(reads) == 1
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                   rtol=1e-4, atol=1e-5)
        assert "padded" not in sparse_compile.runtime_stats()["ones"].last_reason  # all ones: the plain path
        ones[0, 0] = 0  # mutated in place: read again
        torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, ones)
        assert len(reads) == 2
    # outside any compiled graph's call nothing vouches for an earlier read: every call reads
    torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, ones)
    assert len(reads) == 3


def test_op_holds_query_positions_to_the_proven_ones():
    q, k, v = random_qkv(1, 2, 2, 24, 24, 16)
    spec = op_spec("pos", SparseConfig(min_seq_len=2), queries_last=True)
    ok = torch.arange(24)
    torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, None, ok)
    with pytest.raises(RuntimeError, match="cache_position.*arange\\(0, 24\\)"):
        torch.ops.sparse_compile.causal_attention(q, k, v, None, spec, None, ok + 3)


def test_op_refuses_non_binary_padding_where_only_0_1_was_proven():
    q, k, v = random_qkv(1, 2, 2, 24, 24, 16)
    config = SparseConfig(min_seq_len=2)
    binary = op_spec("bin", config, queries_last=True, binary_padding=True)
    mask = torch.ones(1, 24, dtype=torch.long)
    torch.ops.sparse_compile.causal_attention(q, k, v, None, binary, mask)
    mask[0, 3] = 2
    torch.ops.sparse_compile.causal_attention(q, k, v, None, op_spec("bin", config, queries_last=True), mask)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        torch.ops.sparse_compile.causal_attention(q, k, v, None, binary, mask)


@pytest.mark.parametrize("min_seq_len", [10**6, 2])
def test_opcheck_with_padding(min_seq_len):
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16)
    valid = torch.ones(2, 40, dtype=torch.long)
    valid[0, :5] = 0
    config = SparseConfig(min_seq_len=min_seq_len, pbs={"block_size": 16, "segment_size": 32})
    torch.library.opcheck(torch.ops.sparse_compile.causal_attention.default,
                          (q, k, v, None, op_spec("t", config, enable_gqa=True, queries_last=True), valid,
                           torch.arange(40)))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["pbs", "sparge", "bfla", "s2o"])
def test_op_with_key_padding_on_gpu_equals_masked_dense(method):
    """The padded path on the GPU: fast planners and the Triton kernel on sliced and gathered rows, bf16."""
    q, k, v = random_qkv(3, 8, 2, 4096, 4096, 128, dtype=torch.bfloat16, device="cuda")
    valid = torch.ones(3, 4096, dtype=torch.bool, device="cuda")
    valid[0, :300] = False
    valid[1, 3579:] = False
    valid[2, 1000:1200] = False
    # every group through the method (the break-even dispatch would send these dense plans to cuDNN)
    config = SparseConfig(method=method, min_seq_len=1024, dense_when_faster=False).keep_all()
    out = torch.ops.sparse_compile.causal_attention(q, k, v, None, op_spec("gpu", config, enable_gqa=True,
                                                                           queries_last=True), valid.long())
    causal = torch.ones(4096, 4096, dtype=torch.bool, device="cuda").tril()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal & valid[:, None, None, :],
                                         enable_gqa=True)
    rows = valid
    err = (out.float() - ref).transpose(1, 2)[rows].norm() / ref.transpose(1, 2)[rows].norm()
    assert torch.isfinite(out).all() and err < 2e-2, err
    assert sparse_compile.runtime_stats()["gpu"].last_path == "sparse"


# -- never slower than dense: the break-even decision --------------------------------------------------------
def test_break_even_runs_dense_where_the_last_plan_was_too_dense(monkeypatch):
    from sparse_compile import breakeven

    # PBS at threshold 0.9: dense plans
    config = SparseConfig(method="pbs", min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})
    shape = "16x16+keys"
    # a table for the CPU: the sparse kernel at every tile costs 1.25x dense, selection 10%: break-even 0.68 with
    # the 5% margin the sparse path must be predicted to gain
    monkeypatch.setattr(STATE["breakeven.tables"], "value", {"cpu": {shape: {"64": {"kernel": 1.25, "select": 0.1}}}})
    breakeven.HISTORY.clear()
    q, k, v = random_qkv(1, 4, 2, 64, 64, 16)
    first = sparse_compile.sparse_attention(q, k, v, config=config)  # no history: plans, runs sparse, remembers
    assert sparse_compile.runtime_stats()["sparse_attention"].last_path == "sparse"
    second = sparse_compile.sparse_attention(q, k, v, config=config)
    stats = sparse_compile.runtime_stats()["sparse_attention"]
    assert stats.last_path == "dense" and "above break-even 0.68" in stats.last_reason, stats.last_reason
    torch.testing.assert_close(second, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert torch.isfinite(first).all()
    # after PROBE_EVERY dense calls the site plans again (and still runs dense: the plan is known to be too
    # dense only once it lands); while the new plans stay too dense, the wait doubles
    replans = []
    for call in range(1, 3 * breakeven.PROBE_EVERY + 1):
        sparse_compile.sparse_attention(q, k, v, config=config)
        stats = sparse_compile.runtime_stats()["sparse_attention"]
        assert stats.last_path == "dense", stats.last_reason
        if "planned again" in stats.last_reason:
            replans.append(call)
    assert replans == [breakeven.PROBE_EVERY - 1, 3 * breakeven.PROBE_EVERY - 1], replans
    sparse_compile.sparse_attention(q, k, v, config=config.replace(dense_when_faster=False))
    assert sparse_compile.runtime_stats()["sparse_attention"].last_path == "sparse"
    # a sparse enough plan keeps running sparse
    breakeven.HISTORY.clear()
    sparse = config.with_overrides(None, {"threshold": 0.05})
    q, k, v = random_qkv(1, 4, 2, 512, 512, 16)
    for _ in range(3):
        sparse_compile.sparse_attention(q, k, v, config=sparse)
    assert sparse_compile.runtime_stats()["sparse_attention"].last_path == "sparse"


def test_early_stop_replan_runs_the_whole_call(monkeypatch):
    """An early-stop plan's cost is known only by running it: the re-plan plans and runs the whole call (every head:
    the shapes its kernels already ran) and returns its output; the calls between re-plans run dense."""
    from sparse_compile import breakeven, methods
    from sparse_compile.methods import s2o

    config = SparseConfig(method="s2o", min_seq_len=2,
                          s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16, "early_stop": 1e-9})
    monkeypatch.setattr(STATE["breakeven.tables"], "value",
                        {"cpu": {"16x16+keys+queries+stop": {"64": {"kernel": 1.25, "select": 0.1}}}})
    breakeven.HISTORY.clear()
    q, k, v = random_qkv(1, 8, 2, 64, 64, 16)
    sparse_compile.sparse_attention(q, k, v, config=config)  # no history: runs every head, remembers density 1
    heads, planned, paths = [], [], []
    real, real_plan = s2o.execute_plan, methods.build_plan
    monkeypatch.setattr(s2o, "execute_plan", lambda q, *a, **kw: heads.append(q.shape[1]) or real(q, *a, **kw))
    monkeypatch.setattr(methods, "build_plan",
                        lambda q, k, *a, **kw: planned.append((q.shape[1], k.shape[1])) or real_plan(q, k, *a, **kw))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for _ in range(3 * breakeven.PROBE_EVERY):
        out = sparse_compile.sparse_attention(q, k, v, config=config)
        paths.append(sparse_compile.runtime_stats()["sparse_attention"].last_path)
        if paths[-1] == "dense":
            torch.testing.assert_close(out, dense)
    assert heads == [8, 8] and planned == [(8, 2), (8, 2)], (heads, planned)  # two re-plans (doubling), whole
    assert paths.count("sparse") == 2 and paths.count("dense") == 3 * breakeven.PROBE_EVERY - 2, paths
    breakeven.HISTORY.clear()


def test_break_even_below_any_plan_skips_planning(monkeypatch):
    from sparse_compile import breakeven, methods

    config = SparseConfig(method="pbs", min_seq_len=2, pbs={"block_size": 16, "segment_size": 32})
    # selection alone costs 1.5x dense: break-even 0, below the least density of any 16x16 plan
    monkeypatch.setattr(STATE["breakeven.tables"], "value", {"cpu": {"16x16+keys": {"64": {"kernel": 1.0, "select": 1.5}}}})
    breakeven.HISTORY.clear()
    q, k, v = random_qkv(1, 4, 2, 64, 64, 16)
    sparse_compile.sparse_attention(q, k, v, config=config)  # the first plan of this configuration: its shape
    planned = []
    monkeypatch.setattr(methods, "build_plan", lambda *a, **kw: planned.append(1))
    for site_length in (64, 96):  # another length: no history there, but the shape is known
        q, k, v = random_qkv(1, 4, 2, site_length, site_length, 16)
        out = sparse_compile.sparse_attention(q, k, v, config=config)
        stats = sparse_compile.runtime_stats()["sparse_attention"]
        assert stats.last_path == "dense" and "below the least any 16x16+keys@pbs plan keeps" in stats.last_reason
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert not planned
    assert breakeven.lowest_density("16x16+keys", 64, 64) == 4 / 10
    breakeven.HISTORY.clear()


def test_break_even_density_interpolates_in_log_length(monkeypatch):
    from sparse_compile import breakeven

    table = {"cpu": {"s": {"1024": {"kernel": 2.0, "select": 0.0}, "4096": {"kernel": 1.0, "select": 0.0}}}}
    monkeypatch.setattr(STATE["breakeven.tables"], "value", table)
    cpu = torch.device("cpu")
    gain = 1 - breakeven.MARGIN  # the sparse path must be predicted MARGIN faster than dense
    assert breakeven.break_even_density(cpu, "s", 512) == gain / 2  # nearest below
    assert abs(breakeven.break_even_density(cpu, "s", 2048) - gain / 1.5) < 1e-9
    assert breakeven.break_even_density(cpu, "s", 10**6) == gain
    assert breakeven.break_even_density(cpu, "other", 2048) is None


def test_a_gpus_own_break_even_entry_wins_over_its_architectures():
    """An H200 reads its own measured entry; another GPU of its compute capability the architecture's (the H100's)."""
    from sparse_compile import breakeven

    tables = {"sm_90": {}, "sm_90:NVIDIA H200": {}}
    assert breakeven.table_key(("sm_90:NVIDIA H200", "sm_90"), tables) == "sm_90:NVIDIA H200"
    assert breakeven.table_key(("sm_90:NVIDIA H100 80GB HBM3", "sm_90"), tables) == "sm_90"
    assert breakeven.table_key(("sm_100:NVIDIA B200", "sm_100"), tables) == "sm_100"  # no entry: no table
    assert breakeven.table_key(("cpu", "cpu"), tables) == "cpu"
    shipped = breakeven.load_tables()
    assert "sm_90" in shipped and "sm_90:NVIDIA H200" in shipped  # both measured entries ship


def test_break_even_entry_of_the_selector_wins_over_the_shape(monkeypatch):
    """Two selectors can make plans of one shape at different selection costs (PBS without its permutation and
    the sampled selector: 128x128): a ``shape@select`` entry serves that selector, the plain shape the others."""
    from sparse_compile import breakeven

    table = {"cpu": {"16x16": {"64": {"kernel": 1.0, "select": 0.05}},
                     "16x16@sampled": {"64": {"kernel": 1.0, "select": 0.45}}}}
    monkeypatch.setattr(STATE["breakeven.tables"], "value", table)
    cpu = torch.device("cpu")
    assert abs(breakeven.break_even_density(cpu, "16x16@sampled", 64) - 0.5) < 1e-9
    assert abs(breakeven.break_even_density(cpu, "16x16@pbs", 64) - 0.9) < 1e-9
    assert breakeven.lowest_density("16x16@sampled", 64, 64) == breakeven.lowest_density("16x16", 64, 64)
    plan = sparse_compile.extend.build_plan(*random_qkv(1, 2, 1, 64, 64, 16)[:2], None,
                                     SparseConfig(method="sampled", sampled={"block_size": 16}))
    assert breakeven.plan_shape(plan) == "16x16" and breakeven.plan_shape(plan, "sampled") == "16x16@sampled"
