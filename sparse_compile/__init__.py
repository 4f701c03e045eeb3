"""sparse_compile: a torch.compile backend that runs causal prefill attention through sparse Triton kernels.

    model = torch.compile(model, backend="sparse_prefill", options={"method": "pbs"})
    with sparse_compile.sparsity(method="bfla"):
        logits = model(input_ids)
    print(sparse_compile.explain(model, input_ids))
    calibration = sparse_compile.calibrate(model, input_ids, method="pbs", target_error=0.02)
"""

try:  # the top-level folder kernels/, installed as sparse_compile.kernels (pyproject.toml's package-dir)
    from . import kernels as _kernels  # noqa: F401
except ImportError as _missing:  # a checkout on PYTHONPATH, not installed: the mapping is the install's
    raise ImportError(
        "sparse_compile.kernels is not installed: install the package (pip install -e .); its kernels live in the "
        "top-level folder kernels/, which installing maps to sparse_compile.kernels, so a checkout that is only on "
        "PYTHONPATH cannot import them"
    ) from _missing
from pathlib import Path as _Path  # noqa: E402

_HERE = _Path(__file__).resolve().parent
if _Path(_kernels.__file__).resolve().parent not in (_HERE / "kernels", _HERE.parent / "kernels"):
    # this checkout on PYTHONPATH beside another checkout's install: its mapping would serve the other's kernels
    raise ImportError(f"sparse_compile.kernels comes from {_Path(_kernels.__file__).parent}, not from this "
                      f"package's checkout ({_HERE.parent}): install this checkout (pip install -e .)")

from . import methods as _methods  # noqa: E402, F401  (first: the built-in methods register themselves)
from .backend import sparse_prefill  # noqa: E402
from .config import SparseConfig  # noqa: E402
from .context import sparsity  # noqa: E402
from .calibrate import calibrate  # noqa: E402
from .explain import explain  # noqa: E402
from .api import precompile, sparse_attention, varlen_attention  # noqa: E402
from .parallel import sequence_parallel, ulysses_attention  # noqa: E402
from .report import reset_runtime_stats, runtime_stats  # noqa: E402
from .transformers_attention import enable_transformers_attention, register as _register  # noqa: E402
from .serving import serving_attention  # noqa: E402
from . import extend  # noqa: E402, F401  (the extension API: methods, their parameters, plans)

_register()  # the "sparse_prefill" attention implementation, where transformers is imported already

__all__ = [  # the user API; the extension API is sparse_compile.extend
    "SparseConfig",
    "sparse_prefill",
    "sparsity",
    "sparse_attention",
    "varlen_attention",
    "precompile",
    "calibrate",
    "explain",
    "runtime_stats",
    "reset_runtime_stats",
    "enable_transformers_attention",
    "serving_attention",
    "sequence_parallel",
    "ulysses_attention",
]

__version__ = "0.1.0"
