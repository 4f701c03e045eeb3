"""Size-like method parameters are bounded where they are given, and one parameter given by two spellings (or a
malformed ``params``) is a clear ValueError on every entry: ``SparseConfig``, ``from_options``, ``torch.compile``'s
``options`` and ``sparsity``.

Reported: BFLA ``coarse_block_size=2**20, group_size=1`` asked for 8.8 TB and S2O ``segment_size=2**30`` for
8.6 GB on a 200-token prompt; ``{"sampled": {"budget": 0.5}, "budget": 0.3}`` was accepted and the flat key won;
``{"params": ...}`` failed with "dictionary update sequence element #0" or a BackendCompilerFailed.
"""

import dataclasses
import time

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.methods.bfla import MAX_GROUPS
from sparse_compile.params import MAX_SPAN, MAX_TILES
from sparse_compile.registry import registered_methods

from helpers import BUILT_IN, causal_sdpa

#: every size-like parameter of every built-in method: (method, field, largest accepted, its other fields there)
#: block sizes and strides are powers of two <= MAX_BLOCK (tests/test_validation.py); these are the spans and counts
SIZES = [
    ("bfla", "coarse_block_size", MAX_SPAN, {"group_size": MAX_SPAN // MAX_GROUPS}),
    ("bfla", "group_size", MAX_SPAN, {"coarse_block_size": MAX_SPAN}),
    ("bfla", "local_tiles", MAX_TILES, {}),
    ("bfla", "sink_tiles", MAX_TILES, {}),
    ("s2o", "segment_size", MAX_SPAN, {}),
    ("pbs", "segment_size", MAX_SPAN, {}),
    ("sampled", "local_tiles", MAX_TILES, {}),
    ("sampled", "exact_tail_blocks", MAX_TILES, {}),
    ("peak", "local_tiles", MAX_TILES, {}),
    ("peak", "exact_tail_blocks", MAX_TILES, {}),
    ("antidiag", "local_tiles", MAX_TILES, {}),
    ("antidiag", "exact_tail_blocks", MAX_TILES, {}),
]
BOUND_NAME = {MAX_SPAN: "MAX_SPAN", MAX_TILES: "MAX_TILES"}


def _prompt(n=200, heads=2, kv_heads=1, dim=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, dim, generator=g)
    k = torch.randn(1, kv_heads, n, dim, generator=g)
    v = torch.randn(1, kv_heads, n, dim, generator=g)
    return q, k, v


def _dense(q, k, v):
    group = q.shape[1] // k.shape[1]
    return causal_sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


# -- 1. sizes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, field, high, extra", SIZES, ids=[f"{m}.{f}" for m, f, _, _ in SIZES])
def test_a_size_past_its_bound_is_refused_where_it_is_given_naming_field_and_bound(method, field, high, extra):
    cls = registered_methods()[method].params
    # the field's own check (what sparsity(...) runs on entry) and construction, directly and from options
    pattern = rf"{cls.__name__}\.{field}: must be .*{high}\], got {2 * high}.*{BOUND_NAME[high]}"
    with pytest.raises(ValueError, match=pattern):
        cls.check_value(field, 2 * high)
    with pytest.raises(ValueError, match=pattern):
        SparseConfig(**{method: {**extra, field: 2 * high}})
    with pytest.raises(ValueError, match=pattern):
        SparseConfig.from_options({"method": method, **{method: extra}, field: 2 * high})
    with pytest.raises(ValueError, match=pattern):
        sparsity(method=method, **{field: 2 * high})
    with pytest.raises(ValueError, match=rf"{field}: must be .*{high}\], got {2 * high}"):
        sparsity(**{field: 2 * high})  # checked against every method that has the field
    SparseConfig(**{method: {**extra, field: high}})  # the bound itself is accepted


def test_the_reported_allocations_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"BFLAParams\.coarse_block_size: must be a power of two in \[16, 65536\], "
                                         r"got 1048576 \(.*padded to whole coarse blocks"):
        SparseConfig(method="bfla", bfla={"coarse_block_size": 2**20, "group_size": 1})
    with pytest.raises(ValueError, match=r"S2OParams\.segment_size: must be an integer in \[16, 65536\], got "
                                         r"1073741824 \(.*whole segment"):
        SparseConfig(method="s2o", s2o={"segment_size": 2**30})
    with pytest.raises(ValueError, match=r"PBSParams\.segment_size: must be an integer in \[16, 65536\]"):
        SparseConfig(pbs={"segment_size": 2**30})


def test_bfla_groups_per_coarse_block_are_bounded_by_what_the_kernel_holds():
    # the default coarse block (256) with groups of 1 token: 256 groups, G x G scores per block pair
    with pytest.raises(ValueError, match=rf"BFLAParams\.group_size: must be at least coarse_block_size / "
                                         rf"{MAX_GROUPS} = 2 \(coarse_block_size=256\), got 1: that is 256 groups "
                                         rf"per coarse block, and at most MAX_GROUPS = {MAX_GROUPS}"):
        SparseConfig(bfla={"group_size": 1})
    with pytest.raises(ValueError, match=r"group_size: must be at least coarse_block_size / 128 = 512"):
        SparseConfig(bfla={"coarse_block_size": MAX_SPAN})  # the default group (64): 1024 groups
    # a region naming the method meets the rule on entry, not at the first call inside it
    with pytest.raises(ValueError, match=r"group_size: must be at least"):
        sparsity(method="bfla", group_size=1)
    assert SparseConfig(bfla={"group_size": 2}).params_of("bfla").group_size == 2  # 128 groups


def test_every_int_field_of_every_built_in_method_has_a_bound_below_the_kernels_32_bits():
    """No integer parameter left at the bare 32-bit limit except the hash seed and BFLA's stride modulus (neither
    sizes anything)."""
    not_sizes = {("bfla", "seed"), ("bfla", "stride"), ("antidiag", "antidiagonals")}
    for name, spec in registered_methods().items():
        if name not in BUILT_IN:
            continue
        for f in dataclasses.fields(spec.params):
            if f.type not in ("int", int) or (name, f.name) in not_sizes:
                continue
            with pytest.raises(ValueError, match=f"{f.name}: must be"):
                spec.params.check_value(f.name, MAX_TILES + 1 if "tiles" in f.name or "blocks" in f.name
                                        else MAX_SPAN + 1)


def test_the_largest_accepted_sizes_run_a_200_token_prompt_quickly_and_exactly_enough():
    """At the bounds each method plans a 200-token prompt in a bounded time (the CPU reference planner) and gives
    attention within float32 rounding of dense (every tile is kept or the plan is exact there)."""
    q, k, v = _prompt()
    dense = _dense(q, k, v)
    at_bounds = [(method, {**extra, field: high}) for method, field, high, extra in SIZES]
    merged = {}  # one configuration per method where the sizes go together (fewer runs: the file stays fast)
    for method, params in at_bounds:
        if method != "bfla" or "coarse_block_size" not in params or params["group_size"] != MAX_SPAN:
            merged.setdefault(method, {}).update(params)
    runs = list(merged.items()) + [("bfla", {"coarse_block_size": MAX_SPAN, "group_size": MAX_SPAN})]
    start = time.perf_counter()
    for method, params in runs:
        config = SparseConfig(method=method, min_seq_len=2, **{method: params})
        out = sparse_compile.sparse_attention(q, k, v, config=config)
        torch.testing.assert_close(out, dense, atol=1e-4, rtol=1e-4, msg=f"{method} {params}")
    assert time.perf_counter() - start < 20


# -- 2. one parameter, two spellings -----------------------------------------------------------------------------------
def test_a_section_value_and_a_flat_key_for_the_same_parameter_is_an_error_naming_both():
    both = r"parameter 'budget' of method 'sampled' is given twice, as sampled\['budget'\]=0\.5 .* and as budget=0\.3"
    with pytest.raises(ValueError, match=both):
        SparseConfig.from_options({"sampled": {"budget": 0.5}, "budget": 0.3})
    with pytest.raises(ValueError, match=both):
        SparseConfig(sampled={"budget": 0.5}, budget=0.3)
    with pytest.raises(ValueError, match=r"given twice, as sampled\['budget'\]=0\.3 .* and as budget=0\.3"):
        SparseConfig.from_options({"sampled": {"budget": 0.3}, "budget": 0.3})  # the same value: still given twice
    with pytest.raises(ValueError, match=r"'threshold' of method 'pbs' is given twice, as "
                                         r"pbs=PBSParams\(threshold=0\.97, \.\.\.\) .* and as threshold=0\.5"):
        SparseConfig(method="pbs", pbs=sparse_compile.methods.pbs.PBSParams(), threshold=0.5)


def test_different_parameters_of_a_section_and_flat_keys_merge():
    config = SparseConfig.from_options({"sampled": {"mass_target": 0.5}, "budget": 0.3})
    assert (config.params_of("sampled").mass_target, config.params_of("sampled").budget) == (0.5, 0.3)
    # another method's section beside the configured method's flat key: no conflict
    config = SparseConfig.from_options({"method": "pbs", "sampled": {"budget": 0.5}, "threshold": 0.3})
    assert config.params_of("sampled").budget == 0.5 and config.params_of("pbs").threshold == 0.3
    # replace(...) takes the configured method's parameters by their own names, as before
    assert SparseConfig().replace(budget=0.3).params_of("sampled").budget == 0.3
    assert SparseConfig().replace(method="pbs", threshold=0.3).params_of("pbs").threshold == 0.3
    with pytest.raises(ValueError, match="given twice"):
        SparseConfig().replace(method="pbs", pbs={"threshold": 0.2}, threshold=0.3)


def test_params_is_a_documented_spelling_checked_for_its_shape():
    source = SparseConfig(method="pbs", pbs={"threshold": 0.5}, bfla={"mass_threshold": 0.9})
    assert SparseConfig(method="pbs", params=source.params) == source  # the pairs config.params holds
    config = SparseConfig.from_options({"method": "pbs", "params": {"pbs": {"threshold": 0.4}}})
    assert config.params_of("pbs").threshold == 0.4
    config = SparseConfig.from_options({"params": {"pbs": {"threshold": 0.4}}, "pbs": {"block_size": 64}})
    assert (config.params_of("pbs").threshold, config.params_of("pbs").block_size) == (0.4, 64)
    shape = r"SparseConfig\.params: must be a dict \{method name: its parameters"
    for bad in ([1], 5, 3.5, "pbs", [("pbs", 1, 2)]):
        with pytest.raises(ValueError, match=shape):
            SparseConfig.from_options({"params": bad})
    with pytest.raises(ValueError, match=r"SparseConfig\.params: unknown method 'budget'.*'budget' is a parameter of "
                                         r"method\(s\) \[.*'sampled'.*\], not a method"):
        SparseConfig.from_options({"params": {"budget": 0.3}})
    with pytest.raises(ValueError, match=r"SparseConfig\.params\['pbs'\]: must be a PBSParams or a dict"):
        SparseConfig(params={"pbs": 0.5})
    with pytest.raises(ValueError, match=r"'threshold' of method 'pbs' is given twice, as "
                                         r"params\['pbs'\]\['threshold'\]=0\.3 and as pbs\['threshold'\]=0\.4"):
        SparseConfig.from_options({"params": {"pbs": {"threshold": 0.3}}, "pbs": {"threshold": 0.4}})
    with pytest.raises(ValueError, match=r"given twice, as params\['sampled'\]\['budget'\]=0\.3 .* and as budget=0\.2"):
        SparseConfig.from_options({"params": {"sampled": {"budget": 0.3}}, "budget": 0.2})


def test_odd_option_keys_and_values_are_value_errors():
    with pytest.raises(ValueError, match=r"keys must be names \(str\), got \[1\]"):
        SparseConfig.from_options({1: 2})
    with pytest.raises(ValueError, match="skip_layers: must be a sequence"):
        SparseConfig.from_options({"skip_layers": None})
    with pytest.raises(ValueError, match=r"SparseConfig\.method: unknown method \['pbs'\]"):
        SparseConfig.from_options({"method": ["pbs"]})


@pytest.mark.usefixtures("fresh_compile_state")
@pytest.mark.parametrize("options, message", [
    ({"sampled": {"budget": 0.5}, "budget": 0.3}, r"given twice, as sampled\['budget'\]=0\.5"),
    ({"params": [1]}, r"SparseConfig\.params: must be a dict"),
    ({"params": {"budget": 0.3}}, r"unknown method 'budget'"),
    ({"method": "s2o", "segment_size": 2**30}, r"S2OParams\.segment_size: must be an integer in \[16, 65536\]"),
    ({"bfla": {"coarse_block_size": 2**20, "group_size": 1}}, r"coarse_block_size: must be a power of two"),
])
def test_torch_compile_options_fail_with_the_plain_error_at_the_first_call(options, message):
    from torch._dynamo.exc import BackendCompilerFailed

    compiled = torch.compile(lambda a: a + 1, backend="sparse_prefill", options=options)
    with pytest.raises(ValueError, match=message) as info:
        compiled(torch.ones(3))
    assert not isinstance(info.value, BackendCompilerFailed)


def test_kernel_options_are_validated_where_given_and_travel_with_the_configuration():
    """``kernel_options`` (FlexAttention's ``kernel_options``): names and values checked at construction, held
    hashable, kept by JSON (the graph's copy) and accepted by ``torch.compile``'s options and regions."""
    config = SparseConfig(kernel_options={"num_warps": 8, "num_stages": 2})
    assert config.kernel_options == (("num_stages", 2), ("num_warps", 8))
    assert SparseConfig.from_json(config.to_json()) == config and hash(config) == hash(config.replace())
    assert SparseConfig.from_options({"kernel_options": {"use_tma": False}}).kernel_options == (("use_tma", False),)
    assert SparseConfig().to_json() == "{}"  # the default holds none
    with sparsity(kernel_options={"masked_stages": 1}):
        pass
    for bad, match in (({"num_warps": 3}, "num_warps"), ({"num_stages": 2.0}, "num_stages"),
                       ({"num_warps": True}, "num_warps"), ({"block": 64}, "unknown launch parameter 'block'"),
                       ([("num_warps", 4)], "dict of launch parameters")):
        with pytest.raises(ValueError, match=match):
            SparseConfig(kernel_options=bad)
