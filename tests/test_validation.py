"""Values validated where they are given: method parameters, configuration fields, ``sparsity(...)`` values,
``options``, environment variables."""

import dataclasses
import typing

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.registry import registered_methods

from helpers import BUILT_IN, SMALL_PBS, causal_sdpa, small_model

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


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
            torch.compile(causal_sdpa, backend="sparse_prefill")(q, q, q)


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
            torch.compile(causal_sdpa, backend="sparse_prefill")(q, q, q)
        assert logger.level == logging.WARNING and not records, [r.getMessage() for r in records]
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def test_configuration_values_of_the_wrong_kind_are_rejected():
    with pytest.raises(ValueError, match="record_density"):
        SparseConfig(record_density="yes")
    with pytest.raises(ValueError, match="keep_first_block"):
        SparseConfig(pbs={"keep_first_block": "no"})
    with pytest.raises(ValueError, match="skip_layers.*>= 0"):
        SparseConfig(skip_layers=(-1,))


def test_options_may_be_a_sparse_config():
    config = SparseConfig(method="bfla", **SMALL_PBS)
    compiled = torch.compile(small_model(), backend="sparse_prefill", options=config)
    with torch.no_grad():
        compiled(torch.randint(0, 64, (1, 40)))
    assert all("method bfla" in s.last_reason for s in sparse_compile.runtime_stats().values())
    with pytest.raises(ValueError, match="expected a dict of SparseConfig fields or a SparseConfig"):
        SparseConfig.from_options(["method", "pbs"])
