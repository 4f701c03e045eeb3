"""``skip_layers``: entries name whole module-path components, act per site at run time, and warn when they
match no site."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.calibrate import Calibration
from sparse_compile.rewrite import rewrite_graph

from helpers import SMALL, SMALL_PBS, compile_small, random_qkv, small_model

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


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
    compiled = compile_small(_Blocks(11), skip_layers=("blocks.1",))
    with torch.no_grad():
        compiled(q, k, v)
    stats = sparse_compile.runtime_stats()
    # left as SDPA by the rewrite: listed with its reason, never sparse
    assert stats["blocks.1.attn"].plain_sdpa and "skip_layers" in stats["blocks.1.attn"].last_reason
    assert all(path == "dense" for path, _ in stats["blocks.1.attn"].calls)
    assert stats["blocks.10.attn"].last_path == "sparse", stats["blocks.10.attn"].last_reason
    # the same entry given to a region acts at run time
    sparse_compile.reset_runtime_stats()
    compiled = compile_small(_Blocks(11))
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


def test_skip_layers_in_a_region_acts_per_site_at_run_time():
    compiled = torch.compile(small_model(), backend="sparse_prefill", options=SMALL_PBS)
    with torch.no_grad(), sparsity(skip_layers=(0,)):
        compiled(torch.randint(0, 64, (1, 40)))
    stats = sparse_compile.runtime_stats()
    assert stats["layers.0.attention"].last_path == "dense"
    assert stats["layers.0.attention"].last_reason == "layer 0 is in skip_layers"
    assert stats["layers.1.attention"].last_path == "sparse"


def test_skip_layer_that_matches_no_site_warns():
    def backend(gm, example_inputs):
        rewrite_graph(gm, SparseConfig(skip_layers=(40,), **SMALL_PBS))
        return gm.forward

    with pytest.warns(UserWarning, match=r"skip_layers \[40\] matched no attention site"), torch.no_grad():
        torch.compile(small_model(), backend=backend)(torch.randint(0, 64, (1, 20)))
