"""Shared test set-up: Triton runs in its interpreter on machines without CUDA.

TRITON_INTERPRET must be set before any ``@triton.jit`` runs, so it is set here, before the package imports.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    # fresh random inputs per test, reproducible from the printed seed on failure
    import random

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    yield seed


@pytest.fixture
def fresh_compile_state():
    """No compiled code and no run-time statistics carried between tests (Dynamo's caches are process-wide)."""
    import sparse_compile

    torch._dynamo.reset()
    sparse_compile.reset_runtime_stats()
    yield
    torch._dynamo.reset()
