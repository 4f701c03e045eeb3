"""``calibrate`` on a tiny transformers Llama (CPU, small blocks): every site meets its target, looser targets are
sparser, target 0 is exact, the calibrated configuration runs compiled in and through ``sparsity(...)`` without
recompiling with each site's own parameters, it saves and loads as JSON, and bad inputs are named."""

import json
import math
import warnings

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.extend import Calibration
from sparse_compile.calibrate import operator_error
from sparse_compile.context import resolve
from sparse_compile.dense import dense_causal_attention
from sparse_compile.pipeline import capturing
from sparse_compile.rewrite import rewrite_graph

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

SMALL = dict(min_seq_len=2, pbs={"block_size": 16, "segment_size": 32},
             bfla={"coarse_block_size": 32, "group_size": 8, "tile_size_q": 16, "tile_size_kv": 16, "local_tiles": 1,
                   "stride": 4})
SITES = ("model.layers.0.self_attn", "model.layers.1.self_attn")
METHODS = ("pbs", "bfla")
TIGHT, LOOSE = 0.05, 0.2


def tiny_llama():
    torch.manual_seed(0)  # fixed weights and sample: the searched values are then reproducible
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=1024, intermediate_size=128, num_hidden_layers=2)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.eval(), torch.randint(1, 128, (1, 256))


@pytest.fixture(scope="module")
def setup():
    model, ids = tiny_llama()
    calibrations = {(method, target): sparse_compile.calibrate(model, ids, method=method, target_error=target,
                                                               config=SparseConfig(method=method, **SMALL))
                    for method in METHODS for target in (0.0, TIGHT, LOOSE)}
    return model, ids, calibrations


class Rewriter:
    """The real rewrite, then the rewritten graph without Inductor (fast); counts compilations."""

    def __init__(self, config):
        self.config, self.compiles, self.records = config, 0, []

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        self.records.extend(rewrite_graph(gm, self.config))
        return gm.forward


def captured_inputs(model, ids) -> dict:
    """site -> (q, k, v) the op gets on ``ids``, collected independently of ``calibrate``."""
    seen = {}

    def record(site, q, k, v, scale, chunked_allowed):
        seen[site] = (q.clone(), k.clone(), v.clone())

    with torch.no_grad(), sparsity(enabled=False), capturing(record):
        torch.compile(model, backend=Rewriter(SparseConfig()))(ids)
    return seen


def site_densities() -> dict:
    return {site: s.mean_density for site, s in sparse_compile.runtime_stats().items()}


# -- the search ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_every_site_meets_its_target_measured_independently(setup, method):
    model, ids, calibrations = setup
    inputs = captured_inputs(model, ids)
    assert set(inputs) == set(SITES)
    for target in (TIGHT, LOOSE):
        calibration = calibrations[method, target]
        assert [s.site for s in calibration.sites] == list(SITES)
        assert calibration.knob == sparse_compile.registry.method_spec(method).density.name
        for entry in calibration.sites:
            assert entry.calls == 1 and entry.error <= target
            if entry.dense:
                continue
            q, k, v = inputs[entry.site]
            config = calibration.config.for_site(entry.site)
            assert getattr(config.params_of(method), calibration.knob) == entry.value
            out = sparse_compile.sparse_attention(q, k, v, config=config)
            error = operator_error(out, dense_causal_attention(q, k, v))
            assert error <= target and error == pytest.approx(entry.error, rel=1e-5, abs=1e-9)
        assert any(not s.dense and s.density < 1.0 for s in calibration.sites), str(calibration)


def test_method_defaults_to_the_configs_then_the_default_one():
    """``calibrate(model, x, target_error=...)`` searches the default method's knob (what a user compiles with no
    options); with a ``config`` and no ``method``, the config's method; every site within the target."""
    model, ids = tiny_llama()
    default = SparseConfig().method
    small = {default: {"block_size": 16, "sample_every": 4}}
    calibration = sparse_compile.calibrate(model, ids, target_error=LOOSE,
                                           config=SparseConfig(min_seq_len=2, **small))
    assert calibration.method == default
    assert calibration.knob == sparse_compile.registry.method_spec(default).density.name
    assert all(s.error <= LOOSE for s in calibration.sites)
    assert any(not s.dense and s.density < 1.0 for s in calibration.sites), str(calibration)
    pbs = sparse_compile.calibrate(model, ids, target_error=LOOSE, config=SparseConfig(method="pbs", **SMALL))
    assert pbs.method == "pbs" and pbs.knob == "threshold"


@pytest.mark.parametrize("method", METHODS)
def test_looser_target_keeps_less(setup, method):
    _, _, calibrations = setup
    tight, loose = calibrations[method, TIGHT], calibrations[method, LOOSE]
    keeps_more = sparse_compile.registry.method_spec(method).density.higher_keeps_more
    for a, b in zip(tight.sites, loose.sites):
        assert not b.dense
        if not a.dense:
            assert (b.value <= a.value) if keeps_more else (b.value >= a.value)
            assert b.density <= a.density + 1e-9
    assert loose.density < tight.density


@pytest.mark.parametrize("method", METHODS)
def test_target_zero_leaves_every_site_dense_and_exact(setup, method):
    model, ids, calibrations = setup
    calibration = calibrations[method, 0.0]
    assert all(s.dense and "target" in s.note for s in calibration.sites)
    assert set(SITES) <= set(calibration.config.skip_layers) and not calibration.config.site_params
    backend = Rewriter(calibration.config)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids).logits
        ref = model(ids).logits
    assert not any(r.rewritten for r in backend.records)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_padded_batch_through_dict_inputs():
    model, _ = tiny_llama()
    ids = torch.randint(1, 128, (2, 128))
    mask = torch.ones_like(ids)
    mask[0, :40] = 0  # left padding: the op runs two groups of rows per site
    calibration = sparse_compile.calibrate(model, {"input_ids": ids, "attention_mask": mask}, method="pbs",
                                           target_error=LOOSE, config=SparseConfig(**SMALL))
    assert [s.site for s in calibration.sites] == list(SITES)
    assert all(s.calls == 2 and s.error <= LOOSE for s in calibration.sites)


# -- the calibrated configuration at run time ----------------------------------------------------------------------
def test_calibrated_config_compiled_in_through_inductor(setup):
    model, ids, calibrations = setup
    calibration = calibrations["pbs", LOOSE]
    compiled = torch.compile(model, backend="sparse_prefill", options=calibration.config.replace(record_density=True))
    with torch.no_grad():
        assert torch.isfinite(compiled(ids).logits).all()
    densities = site_densities()
    for entry in calibration.sites:
        assert densities[entry.site] == pytest.approx(entry.density, abs=0.02)


def test_region_applies_calibration_without_recompiling(setup):
    model, ids, calibrations = setup
    backend = Rewriter(SparseConfig(method="pbs", record_density=True, **SMALL))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(ids)
        compiles = backend.compiles
        uncalibrated = site_densities()
        for method in METHODS:
            calibration = calibrations[method, LOOSE]
            sparse_compile.reset_runtime_stats()
            with calibration.sparsity():
                compiled(ids)
            densities = site_densities()
            # each site ran its own value: the calibration's density (exactly at the first site; later sites see
            # inputs computed through the sparse sites before them, calibration saw the dense model's)
            first, later = calibration.sites[0], calibration.sites[1:]
            assert densities[first.site] == pytest.approx(first.density, abs=1e-9)
            for entry in later:
                assert densities[entry.site] == pytest.approx(entry.density, abs=0.02)
            assert densities != uncalibrated
            assert {s.last_reason for s in sparse_compile.runtime_stats().values()} == {f"method {method} (reference)"}
        # per-site values set by hand: site 0 keeps everything, site 1 the least pbs can
        sparse_compile.reset_runtime_stats()
        with sparsity(site_params={SITES[0]: {"threshold": 1.0}, SITES[1]: {"threshold": 0.0}}):
            compiled(ids)
        densities = site_densities()
        assert densities[SITES[0]] >= 1.0 > 0.5 > densities[SITES[1]]
    assert backend.compiles == compiles


def test_site_params_belong_to_their_method():
    config = SparseConfig(method="pbs", site_params={"a.0": {"threshold": 0.5}})
    with sparsity(method="bfla", mass_threshold=0.9):  # another method: the pbs values stay behind
        assert resolve(config).method == "bfla" and not resolve(config).site_params
    with sparsity(threshold=0.7):  # the site's own value wins at the site
        assert resolve(config).for_site("a.0").params_of("pbs").threshold == 0.5
        assert resolve(config).for_site("a.1").params_of("pbs").threshold == 0.7
    with sparsity(site_params={}):
        assert not resolve(config).site_params
    assert not config.keep_all().site_params
    eager = SparseConfig(method="pbs", site_params={"sparse_attention": {"threshold": 1.0}}, **SMALL)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    torch.testing.assert_close(sparse_compile.sparse_attention(q, k, v, config=eager),
                               dense_causal_attention(q, k, v), rtol=1e-5, atol=1e-5)
    assert sparse_compile.runtime_stats()["sparse_attention"].last_path == "sparse"  # exact by the site's value


def test_site_config_lookup_is_cached():
    config = SparseConfig(method="pbs", site_params={"a.0": {"threshold": 0.5}})
    assert config.for_site("a.0") is config.for_site("a.0")  # no rebuilding per call of the op
    assert config.for_site("a.1") is config
    plain = SparseConfig()
    assert plain.for_site("a.0") is plain


# -- JSON ------------------------------------------------------------------------------------------------------------
def test_site_params_travel_in_the_graph_json():
    config = SparseConfig(method="bfla", bfla={"mass_threshold": 0.9}, site_params={"m.layers.3.attn": {
        "mass_threshold": 0.75}})
    text = config.to_json()
    assert json.loads(text)["site_params"] == {"m.layers.3.attn": {"mass_threshold": 0.75}}
    assert SparseConfig.from_json(text) == config and hash(SparseConfig.from_json(text)) == hash(config)
    assert SparseConfig.from_options(config.to_dict()) == config


def test_save_and_load_round_trip(setup, tmp_path):
    _, _, calibrations = setup
    for calibration in (calibrations["bfla", TIGHT], calibrations["pbs", 0.0]):
        path = tmp_path / "calibration.json"
        calibration.save(path)
        assert Calibration.load(path) == calibration
    data = json.loads(path.read_text())
    data["config"]["site_params"] = {SITES[0]: {"bogus": 1}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"calibration.json: config: .*site_params.*bogus"):
        Calibration.load(path)
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a sparse_compile calibration"):
        Calibration.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        Calibration.load(path)


# -- errors ----------------------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_problem():
    model, ids = tiny_llama()
    with pytest.raises(ValueError, match="unknown method 'nope'.*valid"):
        sparse_compile.calibrate(model, ids, method="nope", target_error=0.1)
    for bad in (-0.1, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="target_error.*finite number >= 0"):
            sparse_compile.calibrate(model, ids, method="pbs", target_error=bad)
    with pytest.raises(ValueError, match="unknown metric 'l3'"):
        sparse_compile.calibrate(model, ids, method="pbs", target_error=0.1, metric="l3")
    with pytest.raises(ValueError, match="steps"):
        sparse_compile.calibrate(model, ids, method="pbs", target_error=0.1, steps=0)
    with pytest.raises(ValueError, match="example_inputs must be a tensor"):
        sparse_compile.calibrate(model, 3, method="pbs", target_error=0.1)
    with pytest.raises(ValueError, match="ran no attention call"):
        sparse_compile.calibrate(torch.nn.Linear(4, 4), torch.randn(2, 4), method="pbs", target_error=0.1)
    with pytest.raises(ValueError, match=r"site_params\['a.0'\].*unknown parameter.*'mass_threshold'"):
        SparseConfig(site_params={"a.0": {"mass_threshold": 0.5}})
    with pytest.raises(ValueError, match=r"site_params\['a.0'\].*threshold.*\[0.0, 1.0\]"):
        SparseConfig(method="pbs", site_params={"a.0": {"threshold": 2.0}})
    with pytest.raises(ValueError, match="module paths"):
        SparseConfig(method="pbs", site_params={3: {"threshold": 0.5}})
    with pytest.raises(ValueError, match="must be a dict"):
        SparseConfig(site_params=["a.0"])
    with pytest.raises(ValueError, match=r"sparsity\(site_params=...\)\['a.0'\]: unknown parameter.*'bogus'"):
        sparsity(site_params={"a.0": {"bogus": 1}})


def test_site_params_for_no_site_of_the_graph_warn():
    model, ids = tiny_llama()
    # paths of model.model
    config = SparseConfig(method="pbs", site_params={"layers.0.self_attn": {"threshold": 0.5}}, **SMALL)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(model, backend=Rewriter(config))(ids)
    assert any("site_params name none of this graph's 2 attention sites" in str(w.message) for w in caught)


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
