"""What a newcomer's copied recipe does is what it says: ``calibrate`` returns a configuration under which its sample
runs sparse (or says why not, naming ``min_seq_len``); ``sparse_attention`` at its defaults says once that a short
call ran dense; a bad ``SPARSE_COMPILE_LOG`` fails at import in one line; ``SparseConfig``'s repr shows only what
differs from the defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig
from sparse_compile.rewrite import rewrite_graph

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

PBS_SMALL = {"block_size": 16, "segment_size": 32}  # a 256-token sample has blocks to skip
SITES = ("model.layers.0.self_attn",)


def tiny_llama(length: int = 256):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=1024, intermediate_size=128, num_hidden_layers=1)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.eval(), torch.randint(1, 128, (1, length))


def rewriter(config):
    """The real rewrite, then the rewritten graph without Inductor (fast)."""
    def backend(gm, example_inputs):
        rewrite_graph(gm, config)
        return gm.forward
    return backend


def paths(stats) -> dict:
    return {site: {path for path, _ in stats[site].calls} for site in SITES}


def calibrate(model, ids, **kwargs):
    kwargs.setdefault("config", SparseConfig(method="pbs", pbs=PBS_SMALL))
    return sparse_compile.calibrate(model, ids, method="pbs", target_error=0.2, steps=2, **kwargs)


# -- calibrate: the sample's length runs sparse -------------------------------------------------------------------
def test_calibrated_config_runs_its_sample_sparse():
    model, ids = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: the length is lowered, not kept
        calibration = calibrate(model, ids)
    assert SparseConfig(method="pbs").min_seq_len == 16384
    assert calibration.config.min_seq_len == 256, calibration.config
    assert "min_seq_len 256" in str(calibration)
    sparse_compile.reset_runtime_stats()
    with torch.no_grad():
        torch.compile(model, backend=rewriter(calibration.config))(ids)
    assert paths(sparse_compile.runtime_stats()) == {site: {"sparse"} for site in SITES}
    # a model compiled before, at the defaults (min_seq_len 16384): the region brings the calibrated length too
    torch._dynamo.reset()
    sparse_compile.reset_runtime_stats()
    compiled = torch.compile(model, backend=rewriter(SparseConfig(method="pbs")))
    with torch.no_grad(), calibration.sparsity():
        compiled(ids)
    assert paths(sparse_compile.runtime_stats()) == {site: {"sparse"} for site in SITES}
    # Calibration.save/load keeps it
    assert sparse_compile.extend.Calibration.from_dict(calibration.to_dict()).config.min_seq_len == 256


def test_a_length_the_caller_sets_is_kept():
    model, ids = tiny_llama()
    given = calibrate(model, ids, min_seq_len=128)
    assert given.config.min_seq_len == 128
    assert calibrate(model, ids, config=None).config.min_seq_len == 256  # the method's defaults, lowered alike


def test_a_set_length_above_the_sample_warns_naming_min_seq_len():
    model, ids = tiny_llama()
    with pytest.warns(UserWarning, match=r"min_seq_len=512 \(config.min_seq_len\) is above the sample's length 256"):
        calibration = calibrate(model, ids, config=SparseConfig(method="pbs", min_seq_len=512, pbs=PBS_SMALL))
    assert calibration.config.min_seq_len == 512  # the caller's value stands
    with pytest.warns(UserWarning, match=r"min_seq_len=300 \(calibrate\(min_seq_len=...\)\).*min_seq_len=256"):
        calibrate(model, ids, min_seq_len=300)
    with pytest.raises(ValueError, match=r"calibrate\(min_seq_len=...\): SparseConfig.min_seq_len"):
        calibrate(model, ids, min_seq_len=1)


# -- sparse_attention: the dense path at the defaults is said ---------------------------------------------------
def test_sparse_attention_below_min_seq_len_warns_once():  # once per process: the reset before each test
    q = torch.randn(1, 2, 64, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sparse_compile.sparse_attention(q, q, q)
        sparse_compile.sparse_attention(q, q, q)
        sparse_compile.sparse_attention(q[:, :, -1:], q, q)  # a decode step: dense, as expected, not warned
    said = [str(w.message) for w in caught if "sparse_attention:" in str(w.message)]
    assert len(said) == 1, said
    assert "q_len 64 < min_seq_len 16384" in said[0] and "SparseConfig(min_seq_len=...)" in said[0]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert sparse_compile.runtime_stats()["sparse_attention"].last_path == "dense"


def test_sparse_attention_says_nothing_where_it_runs_sparse_or_is_disabled():
    q = torch.randn(1, 2, 64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sparse_compile.sparse_attention(q, q, q, config=SparseConfig(min_seq_len=32))
        with sparse_compile.sparsity(enabled=False):
            sparse_compile.sparse_attention(q, q, q)
        with sparse_compile.sparsity(min_seq_len=32):
            sparse_compile.sparse_attention(q, q, q)
    assert "16,384" in sparse_compile.sparse_attention.__doc__ and "min_seq_len" in sparse_compile.sparse_attention.__doc__


# -- SPARSE_COMPILE_LOG at import; SparseConfig's repr ---------------------------------------------------------
def test_a_bad_log_value_fails_at_import_in_one_line():
    env = {**os.environ, "SPARSE_COMPILE_LOG": "verbose"}
    done = subprocess.run([sys.executable, "-c", "import sparse_compile"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: SPARSE_COMPILE_LOG='verbose': unknown value; valid"), done.stderr[-2000:]
    assert "BackendCompilerFailed" not in done.stderr and len(done.stderr.splitlines()) < 20


def test_config_repr_shows_only_what_differs():
    assert repr(SparseConfig()) == "SparseConfig()"
    config = SparseConfig(method="pbs", min_seq_len=4096, skip_layers=(0,), site_params={"a.0": {"threshold": 0.5}})
    assert repr(config) == ("SparseConfig(method='pbs', min_seq_len=4096, skip_layers=(0,), "
                            "site_params={'a.0': {'threshold': 0.5}})")
    kept = SparseConfig(method="pbs").keep_all()
    assert "pbs={'threshold': 1.0}" in repr(kept) and len(repr(kept)) < 400, repr(kept)
    assert "block_size" not in repr(kept)  # unchanged fields are left out
    for value in (config, kept, SparseConfig(threshold=0.5, method="pbs", record_density=True)):
        assert eval(repr(value), {"SparseConfig": SparseConfig}) == value
