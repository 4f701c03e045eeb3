"""Unusual and hostile inputs through the public API and the backend: each test holds one class of silent wrong
result or late failure closed (a stale cached mask, a dropped tangent, a skip entry that matches too much, an
empty batch, a value refused at every call instead of where it is given, an environment variable misread, an
error of the device taken for a compile failure)."""

import dataclasses
import json
import math
import typing

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.calibrate import Calibration
from sparse_compile.registry import registered_methods

from helpers import op_spec, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             sparge={"block_size_q": 16, "block_size_kv": 16},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16},
             s2o={"segment_size": 32, "block_size_q": 16, "block_size_kv": 16},
             sampled={"block_size": 16, "sample_every": 4},
             antidiag={"block_size": 16, "score_stride": 4, "row_stride": 2},
             peak={"block_size": 16, "sample_every": 4})


BUILT_IN = ("pbs", "sparge", "bfla", "s2o", "sampled", "antidiag", "peak")


def _compile(fn, **options):
    return torch.compile(fn, backend="sparse_prefill", options={**SMALL, **options})


# -- a padding mask changed through an alias between two calls ------------------------------------------------
def _two_layers_with_padding(q, k, v, pad):
    n = q.shape[-2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask = (j <= i)[None, None] & (pad != 0)[:, None, None, :]
    h = torch.tanh(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return F.scaled_dot_product_attention(h, k, v, attn_mask=mask)


@pytest.mark.parametrize("alias", ["numpy", "data"])
def test_padding_mask_changed_through_an_alias_is_read_again_once_per_forward(alias, monkeypatch):
    from sparse_compile import padding

    reads = []
    real = padding._layout
    monkeypatch.setattr(padding, "_layout", lambda m: reads.append(1) or real(m))
    q, k, v = random_qkv(2, 2, 2, 40, 40, 16)
    pad = torch.ones(2, 40, dtype=torch.long)
    compiled = _compile(_two_layers_with_padding, method="pbs")
    with torch.no_grad():
        compiled(q, k, v, pad)
        assert len(reads) == 1  # two layers, one read
        version = pad._version
        if alias == "numpy":
            pad.numpy()[0, :9] = 0
        else:
            pad.data[0, :9] = 0
        assert pad._version == version  # PyTorch did not see the change
        out = compiled(q, k, v, pad)
        ref = _two_layers_with_padding(q, k, v, pad)
    assert len(reads) == 2
    assert "padded batch" in sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason
    valid = pad.bool()  # padded query rows are undefined in both
    torch.testing.assert_close(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-4, atol=1e-5)


def test_transformers_front_door_reads_a_padding_mask_once_per_forward_and_again_after_an_alias_change(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from sparse_compile import padding
    from sparse_compile import transformers_attention as front

    if not front._supported(transformers.__version__):
        pytest.skip("transformers without AttentionMaskInterface")
    reads = []
    real = padding._layout
    monkeypatch.setattr(padding, "_layout", lambda m: reads.append(1) or real(m))
    config = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=256, intermediate_size=64,
                                      num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 128, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        sparse_compile.enable_transformers_attention(model, SparseConfig(**SMALL).keep_all())
        model(ids, attention_mask=mask)
        assert len(reads) == 1  # two layers, one read
        mask.numpy()[0, :9] = False  # unseen by PyTorch's version counter
        out = model(ids, attention_mask=mask).logits
        assert len(reads) == 2
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[mask], ref[mask], rtol=1e-4, atol=1e-4)


# -- forward-mode AD and torch.func ----------------------------------------------------------------------------
def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_forward_ad_through_the_compiled_model_gives_the_eager_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    tangent = torch.randn_like(q)
    compiled = _compile(_causal, kernel="triton")
    with torch.no_grad():
        compiled(q, k, v)  # the sparse path serves ordinary calls
    assert sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_path == "sparse"
    with sdpa_kernel(SDPBackend.MATH), forward_ad.dual_level():  # PyTorch's math kernel has a forward derivative
        out = compiled(forward_ad.make_dual(q, tangent), k, v)
        ref = _causal(forward_ad.make_dual(q, tangent), k, v)
        got, want = forward_ad.unpack_dual(out).tangent, forward_ad.unpack_dual(ref).tangent
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sparse_attention_under_forward_ad_jvp_and_vmap_runs_dense():
    q, k, v = random_qkv(2, 2, 2, 32, 32, 16)
    config = SparseConfig(kernel="triton", **SMALL)
    tangent = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.MATH):
        with forward_ad.dual_level():
            out = sparse_compile.sparse_attention(forward_ad.make_dual(q, tangent), k, v, config=config)
            got = forward_ad.unpack_dual(out).tangent
            want = forward_ad.unpack_dual(_causal(forward_ad.make_dual(q, tangent), k, v)).tangent
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        reason = sparse_compile.runtime_stats()["sparse_attention"].last_reason
        assert "forward-mode AD" in reason, reason
        _, jvp_out = torch.func.jvp(lambda x: sparse_compile.sparse_attention(x, k, v, config=config), (q,),
                                    (tangent,))
        _, jvp_ref = torch.func.jvp(lambda x: _causal(x, k, v), (q,), (tangent,))
        torch.testing.assert_close(jvp_out, jvp_ref, rtol=1e-4, atol=1e-5)
    batched = torch.func.vmap(lambda x: sparse_compile.sparse_attention(x, k, v, config=config))(torch.stack([q, q]))
    torch.testing.assert_close(batched[1], _causal(q, k, v), rtol=1e-4, atol=1e-5)
    assert "torch.func transform" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


def test_op_called_directly_under_forward_ad_refuses_rather_than_dropping_the_tangent():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.ops.sparse_compile.causal_attention(forward_ad.make_dual(q, torch.randn_like(q)), k, v, None,
                                                  op_spec("s", SparseConfig(**SMALL)))


# -- skip_layers entries name whole path components ------------------------------------------------------------
class _Blocks(nn.Module):
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": self.Attention()}) for _ in range(n))

    def forward(self, q, k, v):
        for block in self.blocks:
            q = torch.tanh(block["attn"](q, k, v))
        return q


def test_skip_layers_entry_matches_whole_components_not_a_prefix_of_a_number():
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    compiled = _compile(_Blocks(11), skip_layers=("blocks.1",))
    with torch.no_grad():
        compiled(q, k, v)
    stats = sparse_compile.runtime_stats()
    # left as SDPA by the rewrite: listed with its reason, never sparse
    assert stats["blocks.1.attn"].plain_sdpa and "skip_layers" in stats["blocks.1.attn"].last_reason
    assert all(path == "dense" for path, _ in stats["blocks.1.attn"].calls)
    assert stats["blocks.10.attn"].last_path == "sparse", stats["blocks.10.attn"].last_reason
    # the same entry given to a region acts at run time
    sparse_compile.reset_runtime_stats()
    compiled = _compile(_Blocks(11))
    with torch.no_grad(), sparsity(skip_layers=("blocks.1",)):
        compiled(q, k, v)
    stats = sparse_compile.runtime_stats()
    assert stats["blocks.1.attn"].last_reason == "module path matches skip_layers entry 'blocks.1'"
    assert stats["blocks.10.attn"].last_path == "sparse", stats["blocks.10.attn"].last_reason
    for entry in ("", ".", "a..b", " layers.1"):
        with pytest.raises(ValueError, match="skip_layers.*whole components"):
            SparseConfig(skip_layers=[entry])
    with pytest.raises(ValueError, match="skip_layers"):
        sparsity(skip_layers=[""])


def test_calibrate_skips_a_dense_site_by_its_whole_path():
    from sparse_compile.calibrate import SiteCalibration, calibrate

    model = _Blocks(11)
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    calibration = calibrate(model, (q, k, v), method="pbs", target_error=0.0, steps=1,
                            config=SparseConfig(method="pbs", **SMALL).replace(skip_layers=("blocks.2",)))
    # target 0: every site left dense, each by its own path; blocks.2 was skipped by the user, as given
    assert set(calibration.config.skip_layers) == {"blocks.2"} | {f"blocks.{i}.attn" for i in range(11) if i != 2}
    # a site calibrated sparse that a skip entry also matches would never use its value: refused
    base = SparseConfig(method="pbs", skip_layers=("blocks.10",), site_params={"blocks.10.attn": {"threshold": 0.5}})
    with pytest.raises(ValueError, match="skip_layers skips it"):
        Calibration(base, 0.1, "relative_l1", (SiteCalibration("blocks.10.attn", 0.5, 0.5, 0.01, 1),))


# -- empty inputs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", BUILT_IN)
@pytest.mark.parametrize("shape", [(0, 2, 32, 16), (1, 0, 32, 16), (1, 2, 0, 16), (1, 2, 32, 0)])
def test_empty_input_gives_an_empty_result_for_every_method(method, shape):
    q = torch.randn(*shape)
    config = SparseConfig(method=method, **SMALL)
    out = sparse_compile.sparse_attention(q, q, q, config=config)
    assert out.shape == shape
    out = torch.ops.sparse_compile.causal_attention(q, q, q, None, op_spec("empty", config))
    assert out.shape == shape
    assert sparse_compile.runtime_stats()["empty"].last_path == "dense"


def test_empty_batch_through_the_compiled_model_with_s2o():
    q = torch.randn(0, 2, 32, 16)
    compiled = _compile(_causal, method="s2o")
    with torch.no_grad():
        assert compiled(q, q, q).shape == q.shape


# -- values validated where they are given ---------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_scale_the_kernels_cannot_take_runs_dense_as_sdpa_does(scale):
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    with torch.no_grad():
        out = _compile(fn, kernel="triton")(q, k, v)
        ref = fn(q, k, v)
        # the eager entry point decides per call
        eager = sparse_compile.sparse_attention(q, k, v, scale=scale, config=SparseConfig(kernel="triton", **SMALL))
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(eager, sparse_compile.dense.dense_causal_attention(q, k, v, scale=scale),
                               equal_nan=True)
    assert "scale" in sparse_compile.runtime_stats()["sparse_attention"].last_reason


@pytest.mark.parametrize("params, field", [
    ({"pbs": {"block_size": 512, "segment_size": 512}}, "block_size"),
    ({"sparge": {"block_size_kv": 1024}}, "block_size_kv"),
    ({"s2o": {"block_size_q": 512, "segment_size": 2048}}, "block_size_q"),
    ({"bfla": {"score_scale": float("inf")}}, "score_scale"),
    ({"sparge": {"pv_threshold": float("-inf")}}, "pv_threshold"),
    ({"bfla": {"seed": 2**40}}, "seed"),
    ({"sampled": {"budget": float("nan")}}, "budget"),
    ({"antidiag": {"score_stride": 12}}, "score_stride"),
    ({"antidiag": {"block_size": 16, "score_stride": 32}}, "score_stride"),
    ({"antidiag": {"score_stride": 8, "row_stride": 16}}, "row_stride"),
    ({"antidiag": {"antidiagonals": 3}}, "antidiagonals"),
    ({"antidiag": {"temperature_factor": 0.0}}, "temperature_factor"),
    ({"peak": {"sample_every": 3}}, "sample_every"),
    ({"peak": {"block_size": 16, "sample_every": 32}}, "sample_every"),
    ({"peak": {"budget": 0.0}}, "budget"),
])
def test_method_parameters_out_of_range_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=f"{field}: must be"):
        SparseConfig(**params)


def test_every_numeric_parameter_of_every_method_refuses_nan_inf_and_huge_values():
    for name, spec in registered_methods().items():
        if name not in BUILT_IN:
            continue
        hints = typing.get_type_hints(spec.params)
        for f in dataclasses.fields(spec.params):
            kind = hints[f.name]
            if kind is bool:
                continue
            numeric = [float("nan"), float("inf"), -float("inf")]
            if kind is int:
                numeric = [2**40, -(2**40)]
            for value in numeric:
                with pytest.raises(ValueError, match=f"{f.name}: must be"):
                    SparseConfig(**{name: {f.name: value}})
                with pytest.raises(ValueError, match=f"{f.name}: must be"):
                    spec.params.check_value(f.name, value)


@pytest.mark.parametrize("kwargs, field", [
    ({"threshold": 2.0}, "threshold"),
    ({"threshold": float("nan")}, "threshold"),
    ({"block_size": 100}, "block_size"),
    ({"block_size": 512}, "block_size"),
    ({"site_params": {"layers.0.attention": {"threshold": 2.0}}}, "threshold"),
    ({"method": "bfla", "site_params": {"layers.0.attention": {"mass_threshold": -1.0}}}, "mass_threshold"),
])
def test_sparsity_refuses_bad_values_where_they_are_given(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}: must be"):
        sparsity(**kwargs)


# -- is_causal with more queries than keys, or none ------------------------------------------------------------
def test_is_causal_with_more_queries_than_keys_under_dynamic_shapes_runs_dense_as_sdpa():
    compiled = torch.compile(_causal, backend="sparse_prefill", options=SMALL, dynamic=True)
    with torch.no_grad():
        q, k, v = random_qkv(1, 2, 2, 24, 32, 16)
        torch.testing.assert_close(compiled(q, k, v), _causal(q, k, v))
        q, k, v = random_qkv(1, 2, 2, 40, 24, 16)
        torch.testing.assert_close(compiled(q, k, v), _causal(q, k, v))
    reason = sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason
    assert "top-left" in reason, reason


def test_op_with_no_queries_returns_sdpa_result():
    q = torch.randn(1, 2, 0, 16)
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    out = torch.ops.sparse_compile.causal_attention(q, k, v, None, op_spec("none", SparseConfig(**SMALL)))
    assert out.shape == (1, 2, 0, 16)
    assert "empty input" in sparse_compile.runtime_stats()["none"].last_reason


# -- Calibration.load ------------------------------------------------------------------------------------------
def _calibration_dict():
    config = SparseConfig(method="pbs", skip_layers=("layers.1.attention",),
                          site_params={"layers.0.attention": {"threshold": 0.8}})
    sites = [{"site": "layers.0.attention", "value": 0.8, "density": 0.5, "error": 0.01, "calls": 1, "note": ""},
             {"site": "layers.1.attention", "value": None, "density": 1.0, "error": 0.0, "calls": 1,
              "note": "left dense"}]
    return Calibration.from_dict({"format": "sparse_compile.calibration", "version": 1, "target_error": 0.02,
                                  "metric": "relative_l1", "config": config.to_dict(), "sites": sites}).to_dict()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(sites=5), "sites must be a JSON list"),
    (lambda d: d.update(sites=None), "sites must be a JSON list"),
    (lambda d: d.update(config=None), "config must be a JSON object"),
    (lambda d: d.update(metric=[]), "metric"),
    (lambda d: d["sites"][0].update(density=float("nan")), "density.*finite"),
    (lambda d: d["sites"][0].update(density=-0.5), "density.*>= 0"),
    (lambda d: d["sites"][0].update(error=-1.0), "error.*>= 0"),
    (lambda d: d["sites"][0].update(value=float("nan")), "value.*finite"),
    (lambda d: d["sites"][0].update(calls="1"), "calls"),
    (lambda d: d["config"].update(skip_layers=[]), "marked dense but config.skip_layers"),
    (lambda d: d["sites"].append(dict(d["sites"][0])), "appears twice"),
])
def test_calibration_load_refuses_malformed_files_with_a_clear_error(tmp_path, change, message):
    data = _calibration_dict()
    change(data)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Calibration.load(path)
    path.write_text("null")
    with pytest.raises(ValueError, match="not a sparse_compile calibration"):
        Calibration.load(path)


# -- environment variables -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, level", [("false", None), ("OFF", None), ("no", None), ("0", None), ("", None),
                                          ("True", 20), ("on", 20), ("yes", 20), ("1", 20), ("DEBUG", 10)])
def test_log_variable_is_read_as_users_write_it(monkeypatch, value, level):
    from sparse_compile.backend import log_level

    monkeypatch.setenv("SPARSE_COMPILE_LOG", value)
    assert log_level() == level


@pytest.mark.parametrize("variable", ["SPARSE_COMPILE_LOG", "SPARSE_COMPILE_ATTENTION_BACKEND"])
def test_unknown_environment_values_are_refused_naming_the_variable(monkeypatch, variable):
    monkeypatch.setenv(variable, "bogus")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(Exception, match=f"{variable}='bogus': unknown value; valid"):
        with torch.no_grad():
            torch.compile(_causal, backend="sparse_prefill")(q, q, q)


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_log_off_values_log_nothing(monkeypatch, value):
    import logging

    logger = logging.getLogger("sparse_compile")
    handlers, level = list(logger.handlers), logger.level
    records = []
    capture = logging.Handler()
    capture.emit = records.append
    monkeypatch.setenv("SPARSE_COMPILE_LOG", value)
    logger.handlers[:] = [capture]
    logger.setLevel(logging.WARNING)
    q = torch.randn(1, 2, 8, 16)
    try:
        with torch.no_grad():
            torch.compile(_causal, backend="sparse_prefill")(q, q, q)
        assert logger.level == logging.WARNING and not records, [r.getMessage() for r in records]
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


# -- the Hopper kernel's errors --------------------------------------------------------------------------------
def _hopper_call(monkeypatch, error):
    from sparse_compile.kernels import attention, hopper

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(attention, "_hopper_unsupported", lambda *a, **k: None)  # as on an H100
    monkeypatch.setattr(hopper, "hopper_block_sparse_attention", failing)
    monkeypatch.setattr(attention, "_HOPPER_FAILED", {})
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16)
    # the causal plan of 2 query blocks of 16: block 0 its diagonal tile, block 1 its diagonal tile then tile 0
    offsets = torch.tensor([[0, 0], [16, 0]], dtype=torch.int32).view(1, 1, 2, 2).expand(1, 2, 2, 2).contiguous()
    counts = torch.tensor([1, 2], dtype=torch.int32).view(1, 1, 2).expand(1, 2, 2).contiguous()
    masked = torch.ones(1, 2, 2, dtype=torch.int32)
    out = attention.block_sparse_attention(q, k, v, offsets, counts, masked, block_m=16, block_n=16)
    return out, (q, k, v), attention


def test_hopper_out_of_memory_propagates_and_does_not_switch_kernels(monkeypatch):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _hopper_call(monkeypatch, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    from sparse_compile.kernels import attention

    assert attention._HOPPER_FAILED == {}
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _hopper_call(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_hopper_compile_failure_falls_back_to_the_triton_kernel(monkeypatch):
    from triton.compiler.errors import CompilationError

    out, (q, k, v), attention = _hopper_call(monkeypatch, NotImplementedError("no wgmma here"))
    assert attention.last_backend == "triton" and len(attention._HOPPER_FAILED) == 1
    torch.testing.assert_close(out, _causal(q, k, v), rtol=1e-4, atol=1e-5)
    assert attention.is_compile_failure(CompilationError.__new__(CompilationError))
    assert not attention.is_compile_failure(torch.cuda.OutOfMemoryError("out of memory"))
