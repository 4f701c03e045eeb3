"""The benchmarks' own checks (``python -m pytest -n 2 benchmarks/tests``): smoke runs of each maintained benchmark
at toy sizes on the CPU. They run apart from the package's suite (``tests/``), which imports no benchmark script.

The package suite's set-up applies here too: Triton's interpreter without CUDA, one fixed seed per test, fresh
run-time state.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import (  # noqa: E402,F401  (fixtures and hooks, registered by being names here)
    _fixed_seed,
    _fresh_run_time_state,
    fresh_compile_state,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
)
