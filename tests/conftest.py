"""Shared test set-up: Triton runs in its interpreter on machines without CUDA; every test has its own fixed seed.

TRITON_INTERPRET must be set before any ``@triton.jit`` runs, so it is set here, before the package imports.
"""

import os
import zlib

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: run every test with this seed instead of its own (``SPARSE_COMPILE_TEST_SEED=123 pytest ...``)
SEED_VARIABLE = "SPARSE_COMPILE_TEST_SEED"


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def seed_of(nodeid: str) -> int:
    """A test's seed: ``SPARSE_COMPILE_TEST_SEED`` if set, else a hash of its id. The same in every run, worker and
    order, so a test's random inputs never depend on luck or on what ran before it."""
    given = os.environ.get(SEED_VARIABLE)
    if given:
        return int(given)
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _fixed_seed(request):
    import random

    seed = seed_of(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seeds = [value for name, value in item.user_properties if name == "seed"]
        if seeds:
            report.sections.append(("seed", f"{SEED_VARIABLE}={seeds[0]} (rerun with it to repeat this test's inputs)"))
    return report


@pytest.fixture(autouse=True)
def _fresh_run_time_state():
    """Every test starts from the same run-time state, whatever ran before it in this worker: no compiled code (a
    frame transformers shares between models, such as its deprecation wrapper, would otherwise reach Dynamo's
    recompile limit after enough tests and run eager), and every store of the package's run-time state as a fresh
    import has it (run-time records, break-even density history, caches, warnings given: all process-wide)."""
    import sparse_compile.extend

    torch._dynamo.reset()
    sparse_compile.extend.reset_state()
    yield


@pytest.fixture
def fresh_compile_state():
    """No compiled code and no run-time statistics carried between tests (Dynamo's caches are process-wide)."""
    import sparse_compile

    torch._dynamo.reset()
    sparse_compile.reset_runtime_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Many small tensors, two pytest workers on two cores: a second intra-op thread per worker only adds waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
