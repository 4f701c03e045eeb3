"""``sparsity(...)`` regions: inheritance of ``enabled``, and leaving them out of order."""

import pytest
import torch

import sparse_compile
from sparse_compile import SparseConfig, sparsity
from sparse_compile.context import resolve

from helpers import SMALL_PBS, small_model

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def test_nested_region_inherits_disabled():
    base = SparseConfig(method="pbs", **SMALL_PBS)
    with sparsity(enabled=False):
        with sparsity(threshold=0.5):
            assert resolve(base).enabled is False and resolve(base).params_of("pbs").threshold == 0.5
    model = small_model()
    compiled = torch.compile(model, backend="sparse_prefill", options=dict(SMALL_PBS, method="pbs", enabled=False))
    with torch.no_grad(), sparsity(threshold=0.5):
        compiled(torch.randint(0, 64, (1, 40)))
    stats = sparse_compile.runtime_stats()
    assert stats and all(s.last_reason == "sparsity disabled in this region" for s in stats.values()), stats


def test_out_of_order_region_exit_is_an_error():
    outer, inner = sparsity(enabled=False), sparsity(method="bfla")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert resolve(SparseConfig()) == SparseConfig()
